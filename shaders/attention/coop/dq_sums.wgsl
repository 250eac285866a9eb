// dQ from the tensor-core dK/dV kernel (FlashAttention-2's split of the backward, as the GPU
// family's attention/gpu/dq_sums.wgsl): each tile group has dS^T of the query tile against its 16
// keys in mat_mem (DST_AT, masked pairs zero; P^T at PT_AT says which pairs are seen) and those
// keys staged pre-scaled (K at 0), so
//   dQ[rows, cols] += dS[rows, group keys] (scale K)[group keys, cols]
// is one 16x16 multiply-add per 16 rows and 16 columns; the groups' partial tiles are added in group
// order and then to f32 sums [B, H, Lq, DK] (binding 9) with atomics, one per element and workgroup:
// the dQ kernel, which computes S and dP a second time, does not run. The key blocks' terms arrive
// in no fixed order, so dQ is not bitwise repeatable
// (ContextOptions::atomic_gradients says when the host builds this); attention/gpu/dq_store.wgsl
// writes the sums into the dq view.
//
// A key block holding a non-finite K value adds its terms in scalar arithmetic that skips the
// pairs a row masks (a product skips nothing, and 0 x inf is NaN), so such a value reaches only the
// rows that see its key.

@group(0) @binding(9) var<storage, read_write> dq_sums: array<atomic<f32>>;

// Partial tiles between their multiply-add and their atomics: slots of 16 columns in the group's
// rows of the S^T and dP^T spaces (read by now), SS / 16 per space.
override DQ_SLOTS: u32 = 2u * (SS / 16u);

// Whether any of the block's staged keys is not finite (`staged_bad`: this invocation's share, from
// stage_tile), the same for the whole workgroup: slot 1 of the kernel's operand flags
// (attention/coop/backward_tiles.wgsl; the query tiles use slot 0). Called once, by every
// invocation, after the keys are staged.
fn dq_keys_bad_of(lid: u32, staged_bad: bool) -> bool {
    if lid == 0u {
        atomicStore(&operand_bad[1], 0u);
    }
    workgroupBarrier();
    if staged_bad {
        atomicOr(&operand_bad[1], 1u);
    }
    workgroupBarrier();
    if lid == 0u {
        tile_flags[1] = atomicLoad(&operand_bad[1]);
    }
    return workgroupUniformLoad(&tile_flags[1]) != 0u;
}

// Element offset in acc_mem of partial-tile slot `slot` of the group whose keys start at keys_at.
fn dq_slot_at(keys_at: u32, slot: u32) -> u32 {
    return select(0u, DPT_AT, slot % 2u == 1u) + keys_at * SS + 16u * (slot / 2u);
}

// Adds slots 0 .. count - 1 (column tiles c0 .. c0 + count - 1 of rows base_row ..) to the sums,
// each element the tile groups' partials added in group order first (one atomic per element and
// workgroup): every invocation a share, rows past `hi` and columns past DK skipped.
fn dq_add_slots(lid: u32, count: u32, c0: u32, base_row: u32, hi: u32, row_base: u32) {
    for (var e = lid; e < 256u * count; e += WG) {
        let slot = e / 256u;
        let r = (e % 256u) / 16u;
        let d = 16u * (c0 + slot) + e % 16u;
        let i = base_row + r;
        if i < hi && d < DK {
            var x = 0.0;
            for (var g = 0u; g < NSG; g++) {
                x += acc_mem[dq_slot_at(16u * g, slot) + r * SS + e % 16u];
            }
            atomicAdd(&dq_sums[(row_base + i) * DK + d], x);
        }
    }
}

// Adds the group's dQ terms for the query tile (rows m0 .. min(m0 + BM, hi) - 1 of head h of batch
// b). Called by every invocation, after the barrier that publishes P^T and dS^T and once the
// S^T and dP^T spaces are read; ends with a barrier. `keys_bad`: dq_keys_bad_of's flag.
fn add_dq_tile(lid: u32, b: u32, h: u32, m0: u32, hi: u32, keys_at: u32, keys_bad: bool) {
    let row_base = (b * params.heads + h) * params.q_seq;
    if keys_bad {
        // Scalar products over the block's keys in order, each skipped where the row masks it.
        for (var e = lid; e < BM * DK; e += WG) {
            let ii = e / DK;
            let d = e % DK;
            if m0 + ii < hi {
                var x = 0.0;
                for (var k = 0u; k < BN; k++) {
                    let at = k * PS + ii;
                    if p_visible(vec4<f32>(f32(mat_mem[PT_AT + at]))).x {
                        x += f32(mat_mem[DST_AT + at]) * f32(mat_mem[k * KS + d]);
                    }
                }
                atomicAdd(&dq_sums[(row_base + m0 + ii) * DK + d], x);
            }
        }
        workgroupBarrier();
        return;
    }
    for (var m = 0u; m < BM; m += 16u) {
        // dS[m .. m + 15, group keys] = the transpose of dS^T's rows keys_at .. + 15 there.
        let ds = mat_load_a_transposed(DST_AT + keys_at * PS + m, PS);
        for (var c0 = 0u; c0 < K_TILES; c0 += DQ_SLOTS) {
            let count = min(DQ_SLOTS, K_TILES - c0);
            for (var slot = 0u; slot < count; slot++) {
                let k = mat_load_b(keys_at * KS + 16u * (c0 + slot), KS);
                mat_store(mat_mma(ds, k, mat_zero()), dq_slot_at(keys_at, slot), SS);
            }
            workgroupBarrier();
            dq_add_slots(lid, count, c0, m0 + m, hi, row_base);
            workgroupBarrier();
        }
    }
}
