// Attention backward, step 3 (SPEC.md): dQ_i = scale * sum_j dS_ij k_j with
// dS_ij = p_ij (dO_i . v_j - D_i) and p_ij = exp(s_ij - lse_i) recomputed from the saved lse.
// Parallel over query blocks like the forward kernel, so no float atomics and bitwise reproducible.
// Each invocation owns four query rows, one per vec4 lane (q and dO transposed, dQ accumulator in
// registers); K/V tiles are staged and read a quad (four keys by eight dims, attention/cpu/quads.wgsl) at
// a time. The key loop runs over [chunk_begin, chunk_end); later chunks add to dQ.
//
// With REL_BUCKETS > 0 (learned relative-position buckets) it also writes each query row's
// gradient of the relative table, d_score = p (dP - D) summed per bucket over the row's keys in
// order: rel_rows [B * Lq, H * REL_BUCKETS], whose column sums (in row order) are the table's
// gradient.

override WG: u32 = 64u;
override BLOCK_N: u32 = 32u;
// Buckets of the learned relative table whose gradient this pipeline accumulates (0: none).
override REL_BUCKETS: u32 = 0u;

// The per-invocation arrays' sizes, declared by the pipeline's key (private arrays need constant
// lengths; src/kernels/attention/variant.rs): MAX_D: the head dims rounded up to whole quads;
// MAX_REL: REL_BUCKETS, at least 1. The head dims (DK, DV, their staged strides DK4P, DV4P) and
// the staged tiles of K and V (tile_qk, tile_vo): attention/cpu/quads.wgsl.
override TILE_ROWS: u32 = BLOCK_N;

// Q, K, V, dO, stats (bindings 2-6): attention/cpu/backward_inputs.wgsl; the staged tiles' views
// (K and V): attention/cpu/views_kv.wgsl.
@group(0) @binding(7) var<storage, read_write> dq_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> rel_rows: array<f32>;

// One key's share of the four rows' gradients: which rows see it, their score gradient d_score =
// p (dP - D) (the relative table's) and ds = d_score times the modifier's derivative (dQ's).
struct KeyGrad {
    seen: vec4<bool>,
    d_score: vec4<f32>,
    ds: vec4<f32>,
}

fn key_grad(
    s: vec4<f32>,
    dp: vec4<f32>,
    rows: vec4<u32>,
    j: u32,
    in_tile: bool,
    b: u32,
    h: u32,
    lse: vec4<f32>,
    delta: vec4<f32>,
    row_start: vec4<u32>,
    row_end: vec4<u32>,
) -> KeyGrad {
    let x = modify_scores(s, rows, vec4<u32>(j), b, h);
    let seen = visible(j, row_start, row_end) & vec4<bool>(in_tile) & score_visible(x);
    let zero = vec4<f32>(0.0);
    let p = select(zero, exp(x - lse), seen);
    let d_score = select(zero, p * (dp - delta), seen);
    return KeyGrad(seen, d_score, select(zero, d_score * score_grad(s), seen));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, ids: QuadIds) {
    quad_init(ids);
    let lid = ids.index;
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    let q_block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let h_kv = h / (params.heads / params.kv_heads);
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let row0 = q_block * WG * 4u;
    let rows = vec4<u32>(row0 + lid) + vec4<u32>(0u, 1u, 2u, 3u) * WG;

    var qt: array<vec4<f32>, MAX_D>;
    var dot_t: array<vec4<f32>, MAX_D>;
    var dq: array<vec4<f32>, MAX_D>;
    // Rows that see no key keep lse = 0 here: every one of their pairs is masked and contributes 0.
    var lse = vec4<f32>(0.0);
    var delta = vec4<f32>(0.0);
    var row_start = vec4<u32>(0u);
    var row_end = vec4<u32>(0u);
    for (var d = 0u; d < DK4P * 4u; d++) {
        qt[d] = vec4<f32>(0.0);
        dq[d] = vec4<f32>(0.0);
    }
    for (var d = 0u; d < DV4P * 4u; d++) {
        dot_t[d] = vec4<f32>(0.0);
    }
    // Per bucket, the four rows' relative-table gradient.
    var rel: array<vec4<f32>, MAX_REL>;
    for (var u = 0u; u < REL_BUCKETS; u++) {
        rel[u] = vec4<f32>(0.0);
    }
    for (var r = 0u; r < 4u; r++) {
        let i = rows[r];
        if i < qlen {
            row_start[r] = key_start(i);
            row_end[r] = key_end(i, kvlen);
            if row_end[r] > row_start[r] {
                let st = stats[(b * params.heads + h) * params.q_seq + i];
                lse[r] = st.x;
                delta[r] = st.y;
            }
            let q_base = view_index(VIEW_Q, b, i, h);
            for (var d4 = 0u; d4 < DK4; d4++) {
                let x = q_row4(q_base + 4u * d4, DK - 4u * d4) * params.scale;
                for (var c = 0u; c < 4u; c++) {
                    qt[4u * d4 + c][r] = x[c];
                }
            }
            let do_base = view_index(VIEW_DO, b, i, h);
            for (var d4 = 0u; d4 < DV4; d4++) {
                let x = do_row4(do_base + 4u * d4, DV - 4u * d4);
                for (var c = 0u; c < 4u; c++) {
                    dot_t[4u * d4 + c][r] = x[c];
                }
            }
        }
    }

    let keys = query_block_keys(aligned(0u), row0, WG * 4u, qlen, kvlen);
    let n_end = min(keys.y, params.chunk_end);
    let n_begin = max(params.chunk_begin, keys.x);

    for (var n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        let n_tile = min(BLOCK_N, n_end - n0);
        workgroupBarrier();
        stage_tiles(lid, b, n0, n_tile, h_kv);
        workgroupBarrier();

        // A quad of keys (j0 .. j0 + 3) per step: every private q, dO and dQ entry is read or
        // updated once for the four, the private-memory traffic that dominates on CPU drivers.
        // BLOCK_N is a multiple of 4 and keys past n_tile are staged as zeros and masked.
        for (var j0 = 0u; j0 < n_tile; j0 += 4u) {
            var s = QuadLanes();
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let d = d8 * 8u;
                s = quad_dots(
                    s,
                    qk_quad(j0, d8),
                    qt[d], qt[d + 1u], qt[d + 2u], qt[d + 3u],
                    qt[d + 4u], qt[d + 5u], qt[d + 6u], qt[d + 7u],
                );
            }
            var dp = QuadLanes();
            for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
                let d = d8 * 8u;
                dp = quad_dots(
                    dp,
                    vo_quad(j0, d8),
                    dot_t[d], dot_t[d + 1u], dot_t[d + 2u], dot_t[d + 3u],
                    dot_t[d + 4u], dot_t[d + 5u], dot_t[d + 6u], dot_t[d + 7u],
                );
            }
            // Masked pairs (and so every pair of a row whose lse is -inf) contribute exactly 0,
            // whatever their dP or score holds (a NaN in a key or value the row does not see is
            // not the row's).
            let g0 = key_grad(s.r0, dp.r0, rows, n0 + j0, j0 < n_tile, b, h, lse, delta, row_start, row_end);
            let g1 = key_grad(s.r1, dp.r1, rows, n0 + j0 + 1u, j0 + 1u < n_tile, b, h, lse, delta, row_start, row_end);
            let g2 = key_grad(s.r2, dp.r2, rows, n0 + j0 + 2u, j0 + 2u < n_tile, b, h, lse, delta, row_start, row_end);
            let g3 = key_grad(s.r3, dp.r3, rows, n0 + j0 + 3u, j0 + 3u < n_tile, b, h, lse, delta, row_start, row_end);
            if REL_BUCKETS > 0u {
                for (var r = 0u; r < 4u; r++) {
                    let delta0 = i32(n0 + j0) - aligned(rows[r]);
                    rel[relative_bucket(delta0)][r] += g0.d_score[r];
                    rel[relative_bucket(delta0 + 1)][r] += g1.d_score[r];
                    rel[relative_bucket(delta0 + 2)][r] += g2.d_score[r];
                    rel[relative_bucket(delta0 + 3)][r] += g3.d_score[r];
                }
            }
            // Rows that mask a key skip its K.
            let ds = QuadLanes(g0.ds, g1.ds, g2.ds, g3.ds);
            let seen = QuadSeen(g0.seen, g1.seen, g2.seen, g3.seen);
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let k = qk_quad(j0, d8);
                for (var e = 0u; e < 8u; e++) {
                    dq[d8 * 8u + e] += column_products(ds, quad_column(k, e), seen);
                }
            }
        }
    }

    for (var r = 0u; r < 4u; r++) {
        let i = rows[r];
        if i >= params.q_seq {
            continue;
        }
        let rel_base = ((b * params.q_seq + i) * params.heads + h) * REL_BUCKETS;
        for (var u = 0u; u < REL_BUCKETS; u++) {
            var x = rel[u][r];
            if params.accumulate != 0u {
                x += rel_rows[rel_base + u];
            }
            rel_rows[rel_base + u] = x;
        }
        if !row_stored(VIEW_DQ, b, i) {
            continue;
        }
        let base = view_index(VIEW_DQ, b, i, h);
        for (var d = 0u; d < DK; d++) {
            var g = dq[d][r] * params.scale;
            if params.accumulate != 0u {
                g += dq_buf[base + d];
            }
            dq_buf[base + d] = g;
        }
    }
}
