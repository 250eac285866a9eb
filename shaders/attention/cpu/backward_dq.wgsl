// Attention backward, step 3 (SPEC.md): dQ_i = scale * sum_j dS_ij k_j with
// dS_ij = p_ij (dO_i . v_j - D_i) and p_ij = exp(s_ij - lse_i) recomputed from the saved lse.
// Parallel over query blocks like the forward kernel, so no float atomics and bitwise reproducible.
// Each invocation owns four query rows, one per vec4 lane (q and dO transposed, dQ accumulator in
// registers); K/V tiles are staged and read a quad (four keys by eight dims, attention/cpu/quads.wgsl) at
// a time, STEP_QUADS per step. The key loop runs over [chunk_begin, chunk_end); later chunks add to dQ.
//
// With REL_BUCKETS > 0 (learned relative-position buckets) it also writes each query row's
// gradient of the relative table, d_score = p (dP - D) summed per bucket over the row's keys in
// order: rel_rows [B * Lq, H * REL_BUCKETS], whose column sums (in row order) are the table's
// gradient.

override WG: u32 = 64u;
override BLOCK_N: u32 = 32u;
// Buckets of the learned relative table whose gradient this pipeline accumulates (0: none).
override REL_BUCKETS: u32 = 0u;
// Quads of keys per step: 2 where the quads come by subgroup broadcast (each private entry then
// serves 8 keys; 4 measured no faster on lavapipe), 1 where they come from workgroup memory (the
// compile time through GL: benchmarks/cpu-quad-steps-2026-11-28/). The host stages tiles of whole
// steps.
override STEP_QUADS: u32 = 2u;

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

// A quad of keys' share of the four rows' gradients (keys n0 + j .. n0 + j + 3, those past the
// tile's n_tile masked): each key's key_grad, the rows that mask a key skipping its K.
struct QuadGrads {
    seen: QuadSeen,
    d_score: QuadLanes,
    ds: QuadLanes,
}

fn quad_grads(
    s: QuadLanes,
    dp: QuadLanes,
    rows: vec4<u32>,
    n0: u32,
    j: u32,
    n_tile: u32,
    b: u32,
    h: u32,
    lse: vec4<f32>,
    delta: vec4<f32>,
    row_start: vec4<u32>,
    row_end: vec4<u32>,
) -> QuadGrads {
    // Masked pairs (and so every pair of a row whose lse is -inf) contribute exactly 0, whatever
    // their dP or score holds (a NaN in a key or value the row does not see is not the row's).
    let g0 = key_grad(s.r0, dp.r0, rows, n0 + j, j < n_tile, b, h, lse, delta, row_start, row_end);
    let g1 = key_grad(s.r1, dp.r1, rows, n0 + j + 1u, j + 1u < n_tile, b, h, lse, delta, row_start, row_end);
    let g2 = key_grad(s.r2, dp.r2, rows, n0 + j + 2u, j + 2u < n_tile, b, h, lse, delta, row_start, row_end);
    let g3 = key_grad(s.r3, dp.r3, rows, n0 + j + 3u, j + 3u < n_tile, b, h, lse, delta, row_start, row_end);
    return QuadGrads(
        QuadSeen(g0.seen, g1.seen, g2.seen, g3.seen),
        QuadLanes(g0.d_score, g1.d_score, g2.d_score, g3.d_score),
        QuadLanes(g0.ds, g1.ds, g2.ds, g3.ds),
    );
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

        // STEP_QUADS quads of keys (j0 .. j0 + 4 STEP_QUADS - 1) per step: every private q, dO
        // and dQ entry is read or updated once for them all, the private-memory traffic that
        // dominates on CPU drivers. Keys past n_tile are staged as zeros and masked; a quad past
        // the tile's end reads inside it (step_quad), masked all the same. dQ adds the quads one
        // after the other: the bits of one quad per step.
        for (var j0 = 0u; j0 < n_tile; j0 += 4u * STEP_QUADS) {
            let j4 = step_quad(j0, 1u);
            var s_a = QuadLanes();
            var s_b = QuadLanes();
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let d = d8 * 8u;
                let x0 = qt[d];
                let x1 = qt[d + 1u];
                let x2 = qt[d + 2u];
                let x3 = qt[d + 3u];
                let x4 = qt[d + 4u];
                let x5 = qt[d + 5u];
                let x6 = qt[d + 6u];
                let x7 = qt[d + 7u];
                s_a = quad_dots(s_a, qk_quad(j0, d8), x0, x1, x2, x3, x4, x5, x6, x7);
                if STEP_QUADS == 2u {
                    s_b = quad_dots(s_b, qk_quad(j4, d8), x0, x1, x2, x3, x4, x5, x6, x7);
                }
            }
            var dp_a = QuadLanes();
            var dp_b = QuadLanes();
            for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
                let d = d8 * 8u;
                let x0 = dot_t[d];
                let x1 = dot_t[d + 1u];
                let x2 = dot_t[d + 2u];
                let x3 = dot_t[d + 3u];
                let x4 = dot_t[d + 4u];
                let x5 = dot_t[d + 5u];
                let x6 = dot_t[d + 6u];
                let x7 = dot_t[d + 7u];
                dp_a = quad_dots(dp_a, vo_quad(j0, d8), x0, x1, x2, x3, x4, x5, x6, x7);
                if STEP_QUADS == 2u {
                    dp_b = quad_dots(dp_b, vo_quad(j4, d8), x0, x1, x2, x3, x4, x5, x6, x7);
                }
            }
            let g_a = quad_grads(s_a, dp_a, rows, n0, j0, n_tile, b, h, lse, delta, row_start, row_end);
            var g_b = QuadGrads();
            if STEP_QUADS == 2u {
                g_b = quad_grads(s_b, dp_b, rows, n0, j0 + 4u, n_tile, b, h, lse, delta, row_start, row_end);
            }
            if REL_BUCKETS > 0u {
                for (var r = 0u; r < 4u; r++) {
                    let delta0 = i32(n0 + j0) - aligned(rows[r]);
                    rel[relative_bucket(delta0)][r] += g_a.d_score.r0[r];
                    rel[relative_bucket(delta0 + 1)][r] += g_a.d_score.r1[r];
                    rel[relative_bucket(delta0 + 2)][r] += g_a.d_score.r2[r];
                    rel[relative_bucket(delta0 + 3)][r] += g_a.d_score.r3[r];
                    if STEP_QUADS == 2u {
                        rel[relative_bucket(delta0 + 4)][r] += g_b.d_score.r0[r];
                        rel[relative_bucket(delta0 + 5)][r] += g_b.d_score.r1[r];
                        rel[relative_bucket(delta0 + 6)][r] += g_b.d_score.r2[r];
                        rel[relative_bucket(delta0 + 7)][r] += g_b.d_score.r3[r];
                    }
                }
            }
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let d = d8 * 8u;
                let k_a = qk_quad(j0, d8);
                var k_b = Quad();
                if STEP_QUADS == 2u {
                    k_b = qk_quad(j4, d8);
                }
                for (var e = 0u; e < 8u; e++) {
                    var sum = dq[d + e] + column_products(g_a.ds, quad_column(k_a, e), g_a.seen);
                    if STEP_QUADS == 2u {
                        sum += column_products(g_b.ds, quad_column(k_b, e), g_b.seen);
                    }
                    dq[d + e] = sum;
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
