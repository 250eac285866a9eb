// dQ from the GPU family's dK/dV kernel (FlashAttention-2's split of the backward): the kernel has
// dS^T of a query tile against its key block in workgroup memory (dst_tile, masked pairs zero; P^T
// in pt_tile says which pairs are seen) and its keys staged pre-scaled (k_tile), so
//   dQ_i += sum_j dS_ij (scale k_j)
// over the block's keys is one more product, added to f32 sums [B, H, Lq, DK] (binding 9) with
// atomics: the dQ kernel, which computes S and dP a second time, does not run. The sums of the key
// blocks arrive in no fixed order, so dQ is not bitwise repeatable (ContextOptions::atomic_gradients
// says when the host builds this). attention/gpu/dq_store.wgsl writes the sums into the dq view.
//
// Each invocation owns four rows of the tile by one vec4 column: a key group's four k_tile reads
// serve the four rows, its dS and P reads the column.

@group(0) @binding(9) var<storage, read_write> dq_sums: array<atomic<f32>>;

// One key group's terms of a row's dQ column: ds (the row's dS for keys 4g .. 4g + 3) times their
// columns k0 .. k3, keys in order; pairs the row does not see skip their key (a NaN there is not
// the row's).
fn dq_key_group(
    acc: vec4<f32>,
    ds: vec4<f32>,
    p: vec4<f32>,
    k0: vec4<f32>,
    k1: vec4<f32>,
    k2: vec4<f32>,
    k3: vec4<f32>,
) -> vec4<f32> {
    let keep = p_visible(p);
    if all(keep) {
        return acc + (((ds.x * k0 + ds.y * k1) + ds.z * k2) + ds.w * k3);
    }
    let zero = vec4<f32>(0.0);
    return acc + (((select(zero, ds.x * k0, keep.x) + select(zero, ds.y * k1, keep.y))
        + select(zero, ds.z * k2, keep.z)) + select(zero, ds.w * k3, keep.w));
}

// Adds the tile's dQ rows m0 .. min(m0 + BM, hi) - 1 of query head h. Called by every invocation
// after the barrier that publishes dst_tile and pt_tile; reads workgroup memory only.
fn add_dq_tile(lid: u32, b: u32, h: u32, m0: u32, hi: u32) {
    for (var u = lid; u < (BM / 4u) * DK4; u += WG) {
        let r0 = (u / DK4) * 4u;
        let d4 = u % DK4;
        var acc0 = vec4<f32>(0.0);
        var acc1 = vec4<f32>(0.0);
        var acc2 = vec4<f32>(0.0);
        var acc3 = vec4<f32>(0.0);
        for (var g = 0u; g < TK; g++) {
            let k0 = k_tile[(4u * g) * KS + d4];
            let k1 = k_tile[(4u * g + 1u) * KS + d4];
            let k2 = k_tile[(4u * g + 2u) * KS + d4];
            let k3 = k_tile[(4u * g + 3u) * KS + d4];
            let t = r0 * TK + g;
            acc0 = dq_key_group(acc0, dst_tile[t], pt_tile[t], k0, k1, k2, k3);
            acc1 = dq_key_group(acc1, dst_tile[t + TK], pt_tile[t + TK], k0, k1, k2, k3);
            acc2 = dq_key_group(acc2, dst_tile[t + 2u * TK], pt_tile[t + 2u * TK], k0, k1, k2, k3);
            acc3 = dq_key_group(acc3, dst_tile[t + 3u * TK], pt_tile[t + 3u * TK], k0, k1, k2, k3);
        }
        let acc = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
        for (var r = 0u; r < 4u; r++) {
            let i = m0 + r0 + r;
            if i >= hi {
                break;
            }
            let base = ((b * params.heads + h) * params.q_seq + i) * DK + d4 * 4u;
            for (var e = 0u; e < 4u; e++) {
                if d4 * 4u + e < DK {
                    atomicAdd(&dq_sums[base + e], acc[r][e]);
                }
            }
        }
    }
}
