// Attention backward, dK and dV, on tensor cores (SPEC.md; the "coop" family): the GPU family's
// dK/dV (attention/gpu/backward_dkdv.wgsl) with its four products as 16x16 tile multiply-adds
// through the matrix interface the host appends (matrix/cooperative.wgsl or
// matrix/portable.wgsl):
//   S^T = K Q^T,  dP^T = V dO^T,  dV += P^T dO,  dK += dS^T Q  (dS = P (dP - D), times scale at the end),
// summed over every query head that shares kv head h_kv in a fixed order: deterministic, no atomics.
// The build with attention/coop/dq_sums.wgsl also adds dQ from each tile's dS^T (with atomics).
//
// A workgroup is NSG tile groups of SG invocations (subgroups in the tensor-core build) and owns
// BN = 16 NSG keys of one (batch, kv head); group g owns keys 16 g .. 16 g + 15. K (pre-scaled) and
// V are staged once (their tiles loaded at each use: held across the loop they spilled at head dim
// 128 on RDNA3, benchmarks/coop-backward-2026-11-28), dK and dV held in accumulator tiles. The
// workgroup steps over tiles of BM query rows (Q, dO and each row's keys, lse and D staged, the
// next tile's Q and dO read into registers meanwhile): S^T and dP^T go through workgroup memory in
// f32 to the elementwise step, which writes P^T and dS^T rounded to MatElem for the two products. Under the causal mask, query tiles that
// see none of the block's keys are skipped.
// A product skips nothing, and 0 x NaN is NaN: a tile whose Q or dO holds a non-finite value adds
// its products in scalar arithmetic that skips the pairs a row masks (P^T holds masked_p there), so
// such a value reaches only the keys its row sees (as the GPU family).
//
// The loop over (query head g of the group, query row i), flattened as g * Lq + i, runs over
// [chunk_begin, chunk_end); later chunks add to dK and dV (drivers that cap loop iterations).

override BM: u32 = 32u;
override BN: u32 = 16u * NSG;
// Row strides of P^T / dS^T and of S^T / dP^T (KS and VS, and SG, NSG, WG, DK, DV, DKP and DVP:
// attention/coop/backward_tiles.wgsl).
override PS: u32 = BM + 8u;
override SS: u32 = BM + 4u;

// The lengths of the register arrays, declared by the pipeline's key
// (src/kernels/attention/variant.rs): K_TILES = DKP / 16 and V_TILES = DVP / 16, the tiles of a
// group's K and dK, and of its V and dV.

// InElem / OutElem: the element types of the inputs and outputs (f32, or f16 with SHADER_F16),
// aliased by the host before the common header. Q, K, V and dO: bindings 2-5; (lse, D): 6.
@group(0) @binding(7) var<storage, read_write> dk_buf: array<OutElem>;
@group(0) @binding(8) var<storage, read_write> dv_buf: array<OutElem>;

// MatElem tiles, rows KS, VS or PS apart: K and V [BN x DKP / DVP], Q and dO [BM x DKP / DVP],
// P^T and dS^T [BN x BM]. Every offset is a multiple of 16 bytes (cooperative loads need it).
override V_AT: u32 = BN * KS;
override Q_AT: u32 = V_AT + BN * VS;
override DO_AT: u32 = Q_AT + BM * KS;
override PT_AT: u32 = DO_AT + BM * VS;
override DST_AT: u32 = PT_AT + BN * PS;
override MAT_MEM: u32 = DST_AT + BN * PS;
var<workgroup> mat_mem: array<MatElem, MAT_MEM>;
// f32: S^T and dP^T [BN x BM], rows SS apart; also where dK and dV pass on their way out (and
// through the scalar products), 16 columns at a time.
override DPT_AT: u32 = BN * SS;
override ACC_MEM: u32 = 2u * BN * SS;
var<workgroup> acc_mem: array<f32, ACC_MEM>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier and tile call uniform.
    if group >= params.total_groups {
        return;
    }
    let keys_at = 16u * (lid / SG);
    mat_init(lid % SG);
    let owned = key_block(group);
    let k_block = owned.block;
    let b = owned.b;
    let h_kv = owned.h_kv;
    let group_size = params.heads / params.kv_heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let col0 = k_block * BN;

    // K and V are the first factors of S^T and dP^T: a non-finite value there reaches only its
    // own key's row of P^T and dS^T, so they need no check.
    let k_bad = stage_tile(lid, VIEW_K, b, h_kv, col0, BN, kvlen, DK, DKP, 0u, KS, params.scale);
    stage_tile(lid, VIEW_V, b, h_kv, col0, BN, kvlen, DV, DVP, V_AT, VS, 1.0);
    workgroupBarrier();
    // Where the host builds dQ in (attention/coop/dq_sums.wgsl), whether a key is not finite.
    let keys_bad = dq_keys_bad_of(lid, k_bad);
    var dk_tiles: array<TileC, K_TILES>;
    for (var d = 0u; d < K_TILES; d++) {
        dk_tiles[d] = mat_zero();
    }
    var dv_tiles: array<TileC, V_TILES>;
    for (var d = 0u; d < V_TILES; d++) {
        dv_tiles[d] = mat_zero();
    }

    // The query tiles: BM rows at a time of each query head in turn, within the rows that see
    // the block's keys and this dispatch's chunk; the next tile's Q and dO read one tile ahead
    // (attention/coop/backward_tiles.wgsl).
    let rows = key_block_rows(col0, BN, qlen, kvlen);
    var tile = query_tile_from(0u, rows, group_size);
    var q_next: array<vec4<MatElem>, LOADS>;
    var do_next: array<vec4<MatElem>, LOADS>;
    if tile.x < group_size {
        let h = h_kv * group_size + tile.x;
        let hi = head_rows(tile.x, rows).y;
        q_next = read_tile(lid, VIEW_Q, b, h, tile.y, BM, hi, DK, DKP);
        do_next = read_tile(lid, VIEW_DO, b, h, tile.y, BM, hi, DV, DVP);
    }
    while tile.x < group_size {
        let h = h_kv * group_size + tile.x;
        let m0 = tile.y;
        let hi = head_rows(tile.x, rows).y;
        if lid == 0u {
            atomicStore(&operand_bad[0], 0u);
        }
        // The previous tile's products have read Q, dO, P^T and dS^T.
        workgroupBarrier();
        let q_bad = store_tile(lid, q_next, BM, DKP, Q_AT, KS);
        let do_bad = store_tile(lid, do_next, BM, DVP, DO_AT, VS);
        if q_bad || do_bad {
            atomicOr(&operand_bad[0], 1u);
        }
        stage_row_values(lid, b, h, m0, hi, kvlen);
        workgroupBarrier();
        let next = next_query_tile(tile, rows, group_size);
        if next.x < group_size {
            let next_h = h_kv * group_size + next.x;
            let next_hi = head_rows(next.x, rows).y;
            q_next = read_tile(lid, VIEW_Q, b, next_h, next.y, BM, next_hi, DK, DKP);
            do_next = read_tile(lid, VIEW_DO, b, next_h, next.y, BM, next_hi, DV, DVP);
        }
        tile = next;

        // S^T and dP^T for the group's keys, 16 query rows at a time.
        for (var m = 0u; m < BM; m += 16u) {
            var s = mat_zero();
            for (var d = 0u; d < K_TILES; d++) {
                s = mat_mma(mat_load_a(keys_at * KS + 16u * d, KS), mat_load_b_transposed(Q_AT + m * KS + 16u * d, KS), s);
            }
            mat_store(s, keys_at * SS + m, SS);
            var dp = mat_zero();
            for (var d = 0u; d < V_TILES; d++) {
                dp = mat_mma(mat_load_a(V_AT + keys_at * VS + 16u * d, VS), mat_load_b_transposed(DO_AT + m * VS + 16u * d, VS), dp);
            }
            mat_store(dp, DPT_AT + keys_at * SS + m, SS);
        }
        if lid == 0u {
            tile_flags[0] = atomicLoad(&operand_bad[0]);
        }
        workgroupBarrier();

        // P^T and dS^T, four query rows of one key at a time. Key j is visible to row i iff
        // row_start[i] <= j < row_end[i] (none for rows outside [lo, hi)); such a row saw a key
        // in the forward, so its lse is finite. Masked pairs: P^T holds masked_p (the scalar
        // products skip them), dS^T 0.
        for (var t = lid; t < BN * BM / 4u; t += WG) {
            let jj = t / (BM / 4u);
            let ii = 4u * (t % (BM / 4u));
            let j = vec4<u32>(col0 + jj);
            let at = jj * SS + ii;
            let s = vec4<f32>(acc_mem[at], acc_mem[at + 1u], acc_mem[at + 2u], acc_mem[at + 3u]);
            let dp = vec4<f32>(
                acc_mem[DPT_AT + at],
                acc_mem[DPT_AT + at + 1u],
                acc_mem[DPT_AT + at + 2u],
                acc_mem[DPT_AT + at + 3u],
            );
            let start = vec4<u32>(row_start[ii], row_start[ii + 1u], row_start[ii + 2u], row_start[ii + 3u]);
            let end = vec4<u32>(row_end[ii], row_end[ii + 1u], row_end[ii + 2u], row_end[ii + 3u]);
            let lse = vec4<f32>(row_lse[ii], row_lse[ii + 1u], row_lse[ii + 2u], row_lse[ii + 3u]);
            let delta = vec4<f32>(row_delta[ii], row_delta[ii + 1u], row_delta[ii + 2u], row_delta[ii + 3u]);
            let i = vec4<u32>(m0 + ii) + vec4<u32>(0u, 1u, 2u, 3u);
            let x = modify_scores(s, i, j, b, h);
            let seen = (j >= start) & (j < end) & score_visible(x);
            let p = select(vec4<f32>(masked_p()), exp(x - lse), seen);
            let ds = select(vec4<f32>(0.0), p * (dp - delta) * score_grad(s), seen);
            for (var e = 0u; e < 4u; e++) {
                mat_mem[PT_AT + jj * PS + ii + e] = MatElem(p[e]);
                mat_mem[DST_AT + jj * PS + ii + e] = MatElem(ds[e]);
            }
        }
        // A barrier too (P^T and dS^T are written), and uniform: every invocation takes the
        // same branch below.
        let fix = workgroupUniformLoad(&tile_flags[0]);

        if fix == 0u {
            // dV += P^T dO and dK += dS^T Q for the group's keys.
            for (var m = 0u; m < BM; m += 16u) {
                let pt = mat_load_a(PT_AT + keys_at * PS + m, PS);
                let dst = mat_load_a(DST_AT + keys_at * PS + m, PS);
                for (var c = 0u; c < V_TILES; c++) {
                    dv_tiles[c] = mat_mma(pt, mat_load_b(DO_AT + m * VS + 16u * c, VS), dv_tiles[c]);
                }
                for (var c = 0u; c < K_TILES; c++) {
                    dk_tiles[c] = mat_mma(dst, mat_load_b(Q_AT + m * KS + 16u * c, KS), dk_tiles[c]);
                }
            }
        } else {
            // The same sums in scalar arithmetic, one accumulator tile at a time through the
            // S^T space (read by now), skipping each key's masked rows.
            for (var c = 0u; c < V_TILES; c++) {
                mat_store(dv_tiles[c], keys_at * SS, SS);
                workgroupBarrier();
                scalar_products(lid, PT_AT, DO_AT, VS, 16u * c);
                workgroupBarrier();
                dv_tiles[c] = mat_load_c(keys_at * SS, SS);
                // Every lane has its share before the next tile's store overwrites it.
                workgroupBarrier();
            }
            for (var c = 0u; c < K_TILES; c++) {
                mat_store(dk_tiles[c], keys_at * SS, SS);
                workgroupBarrier();
                scalar_products(lid, DST_AT, Q_AT, KS, 16u * c);
                workgroupBarrier();
                dk_tiles[c] = mat_load_c(keys_at * SS, SS);
                workgroupBarrier();
            }
        }
        // dQ of the tile from the group's keys, where the host builds it
        // (attention/coop/dq_sums.wgsl).
        add_dq_tile(lid, b, h, m0, hi, keys_at, keys_bad);
    }

    // dK (times scale) and dV out, 16 columns at a time through the S^T space; a later chunk adds
    // to an earlier one's.
    let accumulate = params.accumulate != 0u;
    for (var c = 0u; c < K_TILES; c++) {
        workgroupBarrier();
        mat_store(dk_tiles[c], keys_at * SS, SS);
        workgroupBarrier();
        for (var t = lid; t < BN * 16u; t += WG) {
            let j = col0 + t / 16u;
            let d = 16u * c + t % 16u;
            if row_stored(VIEW_DK, b, j) && d < DK {
                let index = view_index(VIEW_DK, b, j, h_kv) + d;
                var x = acc_mem[(t / 16u) * SS + t % 16u] * params.scale;
                if accumulate {
                    x += f32(dk_buf[index]);
                }
                dk_buf[index] = OutElem(x);
            }
        }
    }
    for (var c = 0u; c < V_TILES; c++) {
        workgroupBarrier();
        mat_store(dv_tiles[c], keys_at * SS, SS);
        workgroupBarrier();
        for (var t = lid; t < BN * 16u; t += WG) {
            let j = col0 + t / 16u;
            let d = 16u * c + t % 16u;
            if row_stored(VIEW_DV, b, j) && d < DV {
                let index = view_index(VIEW_DV, b, j, h_kv) + d;
                var x = acc_mem[(t / 16u) * SS + t % 16u];
                if accumulate {
                    x += f32(load_dv(index));
                }
                store_dv(index, OutElem(x));
            }
        }
    }
}

// Adds to the accumulator tiles staged in acc_mem (key row jj at jj * SS, columns col .. col + 15
// of the product) each key's sum over the query tile of weights[jj, i] x operand[i, col + ..],
// skipping the rows the key is masked for (P^T holds masked_p there).
fn scalar_products(lid: u32, weights: u32, operand: u32, stride: u32, col: u32) {
    for (var t = lid; t < BN * 16u; t += WG) {
        let jj = t / 16u;
        let at = jj * SS + t % 16u;
        var x = acc_mem[at];
        for (var ii = 0u; ii < BM; ii++) {
            let p = f32(mat_mem[PT_AT + jj * PS + ii]);
            if p_visible(vec4<f32>(p)).x {
                x += f32(mat_mem[weights + jj * PS + ii]) * f32(mat_mem[operand + ii * stride + col + t % 16u]);
            }
        }
        acc_mem[at] = x;
    }
}

// Query rows [lo, hi) of query head g of the group that see the block's keys (`rows`) within this
// dispatch's chunk of the flattened (head, row) loop; empty outside it.
fn head_rows(g: u32, rows: vec2<u32>) -> vec2<u32> {
    let t0 = g * params.q_seq;
    if params.chunk_end <= t0 || params.chunk_begin >= t0 + params.q_seq {
        return vec2<u32>(0u);
    }
    let lo = max(rows.x, max(params.chunk_begin, t0) - t0);
    let hi = min(rows.y, min(params.chunk_end, t0 + params.q_seq) - t0);
    return vec2<u32>(lo, max(lo, hi));
}

// The first query tile (head, first row) of heads g0 and after; head `heads` past the last.
fn query_tile_from(g0: u32, rows: vec2<u32>, heads: u32) -> vec2<u32> {
    for (var g = g0; g < heads; g++) {
        let range = head_rows(g, rows);
        if range.x < range.y {
            return vec2<u32>(g, range.x);
        }
    }
    return vec2<u32>(heads, 0u);
}

// The query tile after `tile`: BM rows on in its head, else the next head's first.
fn next_query_tile(tile: vec2<u32>, rows: vec2<u32>, heads: u32) -> vec2<u32> {
    if tile.y + BM < head_rows(tile.x, rows).y {
        return vec2<u32>(tile.x, tile.y + BM);
    }
    return query_tile_from(tile.x + 1u, rows, heads);
}
