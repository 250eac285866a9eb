// Attention backward, step 2 (SPEC.md): for each key j, with p_ij recomputed from the saved lse,
//   dV_j = sum_i p_ij dO_i,   dK_j = scale * sum_i dS_ij q_i,   dS_ij = p_ij (dO_i . v_j - D_i),
// summed over every query head that shares kv head h_kv (grouped/multi-query attention), in a fixed
// order: deterministic, no atomics. A workgroup owns BLOCK_N = 4 * WG keys of one (batch, kv head);
// each invocation owns four keys, one per vec4 lane (k, v transposed, dK, dV accumulators in
// registers), and the workgroup stages Q, dO and (lse, D) tiles of BLOCK_M query rows, read a quad
// (four rows by eight dims, attention/cpu/quads.wgsl) at a time, STEP_QUADS per step. Under the
// causal mask, query tiles that see none of the block's keys are skipped.
//
// The loop over (query head g of the group, query row i), flattened as g * Lq + i, runs over
// [chunk_begin, chunk_end); later chunks add to dK and dV.

override WG: u32 = 64u;
override BLOCK_M: u32 = 32u;
// Quads of query rows per step: 4 where the quads come by subgroup broadcast (each private entry
// then serves 16 rows: 1.15x two quads' speed, 1.3x one's on lavapipe), 1 where they come from
// workgroup memory (4 gained 1.1x there, for 2.6x the compile time through GL:
// benchmarks/cpu-quad-steps-2026-11-28/). The host stages tiles of whole steps.
override STEP_QUADS: u32 = 4u;

// The per-invocation arrays' sizes, declared by the pipeline's key (private arrays need constant
// lengths; src/kernels/attention/variant.rs): MAX_D: the head dims rounded up to whole quads. The
// head dims (DK, DV, their staged strides DK4P, DV4P) and the staged tiles of Q and dO (tile_qk,
// tile_vo): attention/cpu/quads.wgsl.
override TILE_ROWS: u32 = BLOCK_M;

// Q, K, V, dO, stats (bindings 2-6): attention/cpu/backward_inputs.wgsl; the staged tiles' views
// (Q and dO): attention/cpu/views_qdo.wgsl.
@group(0) @binding(7) var<storage, read_write> dk_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> dv_buf: array<f32>;

var<workgroup> stat_tile: array<vec2<f32>, BLOCK_M>;

// The keys (lanes) query row `row` sees: valid keys whose visible range holds it, in the tile
// (`in_tile`), with a visible modified score `x`.
fn keys_seen(
    row: u32,
    in_tile: bool,
    x: vec4<f32>,
    live: vec4<bool>,
    q_lo: vec4<u32>,
    q_hi: vec4<u32>,
) -> vec4<bool> {
    let r = vec4<u32>(row);
    return live & (r >= q_lo) & (r < q_hi) & vec4<bool>(in_tile) & score_visible(x);
}

// One quad of query rows' weights for the invocation's four keys: p = exp(x - lse) where a key is
// seen (zero elsewhere), which keys each row sees, and the rows' (lse, D). The quad's rows are
// m0 + i .. m0 + i + 3 (masked by that place in the tile), staged at `staged` (step_quad).
struct RowWeights {
    p: QuadLanes,
    seen: QuadSeen,
    delta: vec4<f32>,
}

fn row_weights(
    s: QuadLanes,
    i: u32,
    staged: u32,
    m_tile: u32,
    m0: u32,
    cols: vec4<u32>,
    b: u32,
    h: u32,
    live: vec4<bool>,
    q_lo: vec4<u32>,
    q_hi: vec4<u32>,
) -> RowWeights {
    let st0 = stat_tile[staged];
    let st1 = stat_tile[staged + 1u];
    let st2 = stat_tile[staged + 2u];
    let st3 = stat_tile[staged + 3u];
    let x0 = modify_scores(s.r0, vec4<u32>(m0 + i), cols, b, h);
    let x1 = modify_scores(s.r1, vec4<u32>(m0 + i + 1u), cols, b, h);
    let x2 = modify_scores(s.r2, vec4<u32>(m0 + i + 2u), cols, b, h);
    let x3 = modify_scores(s.r3, vec4<u32>(m0 + i + 3u), cols, b, h);
    let seen = QuadSeen(
        keys_seen(m0 + i, i < m_tile, x0, live, q_lo, q_hi),
        keys_seen(m0 + i + 1u, i + 1u < m_tile, x1, live, q_lo, q_hi),
        keys_seen(m0 + i + 2u, i + 2u < m_tile, x2, live, q_lo, q_hi),
        keys_seen(m0 + i + 3u, i + 3u < m_tile, x3, live, q_lo, q_hi),
    );
    let zero = vec4<f32>(0.0);
    let p = QuadLanes(
        select(zero, exp(x0 - st0.x), seen.r0),
        select(zero, exp(x1 - st1.x), seen.r1),
        select(zero, exp(x2 - st2.x), seen.r2),
        select(zero, exp(x3 - st3.x), seen.r3),
    );
    return RowWeights(p, seen, vec4<f32>(st0.y, st1.y, st2.y, st3.y));
}

// dS = p (dP - D) times the modifier's derivative at the raw scores s, zero where a row does not
// see a key.
fn score_gradients(w: RowWeights, s: QuadLanes, dp: QuadLanes) -> QuadLanes {
    let zero = vec4<f32>(0.0);
    return QuadLanes(
        select(zero, w.p.r0 * (dp.r0 - w.delta.x) * score_grad(s.r0), w.seen.r0),
        select(zero, w.p.r1 * (dp.r1 - w.delta.y) * score_grad(s.r1), w.seen.r1),
        select(zero, w.p.r2 * (dp.r2 - w.delta.z) * score_grad(s.r2), w.seen.r2),
        select(zero, w.p.r3 * (dp.r3 - w.delta.w) * score_grad(s.r3), w.seen.r3),
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
    let owned = key_block(group);
    let k_block = owned.block;
    let b = owned.b;
    let h_kv = owned.h_kv;
    let group_size = params.heads / params.kv_heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let col0 = k_block * WG * 4u;
    let cols = vec4<u32>(col0 + lid) + vec4<u32>(0u, 1u, 2u, 3u) * WG;

    var kt: array<vec4<f32>, MAX_D>;
    var vt: array<vec4<f32>, MAX_D>;
    var dk: array<vec4<f32>, MAX_D>;
    var dv: array<vec4<f32>, MAX_D>;
    for (var d = 0u; d < DK4P * 4u; d++) {
        kt[d] = vec4<f32>(0.0);
        dk[d] = vec4<f32>(0.0);
    }
    for (var d = 0u; d < DV4P * 4u; d++) {
        vt[d] = vec4<f32>(0.0);
        dv[d] = vec4<f32>(0.0);
    }
    // Key j is visible to query row i (< q_len) iff j < kv_len and query_start(j) <= i < query_end(j);
    // such a row has a visible key, so its lse is finite.
    let live = cols < vec4<u32>(kvlen);
    var q_lo = vec4<u32>(0u);
    var q_hi = vec4<u32>(0u);
    for (var r = 0u; r < 4u; r++) {
        let j = cols[r];
        q_lo[r] = query_start(j);
        q_hi[r] = query_end(j);
        if j < kvlen {
            let k_base = view_index(VIEW_K, b, j, h_kv);
            for (var d4 = 0u; d4 < DK4; d4++) {
                let x = k_row4(k_base + 4u * d4, DK - 4u * d4) * params.scale;
                for (var c = 0u; c < 4u; c++) {
                    kt[4u * d4 + c][r] = x[c];
                }
            }
            let v_base = view_index(VIEW_V, b, j, h_kv);
            for (var d4 = 0u; d4 < DV4; d4++) {
                let x = v_row4(v_base + 4u * d4, DV - 4u * d4);
                for (var c = 0u; c < 4u; c++) {
                    vt[4u * d4 + c][r] = x[c];
                }
            }
        }
    }

    let rows = key_block_rows(col0, WG * 4u, qlen, kvlen);
    for (var g = 0u; g < group_size; g++) {
        // This dispatch's rows of query head g: [lo, hi), uniform across the workgroup.
        let t0 = g * params.q_seq;
        if params.chunk_end <= t0 {
            break;
        }
        if params.chunk_begin >= t0 + params.q_seq {
            continue;
        }
        let lo = max(rows.x, max(params.chunk_begin, t0) - t0);
        let hi = min(rows.y, min(params.chunk_end, t0 + params.q_seq) - t0);
        let h = h_kv * group_size + g;
        for (var m0 = lo; m0 < hi; m0 += BLOCK_M) {
            let m_tile = min(BLOCK_M, hi - m0);
            workgroupBarrier();
            stage_tiles(lid, b, m0, m_tile, h);
            for (var t = lid; t < BLOCK_M; t += WG) {
                var st = vec2<f32>(0.0);
                if t < m_tile {
                    st = stats[(b * params.heads + h) * params.q_seq + m0 + t];
                }
                stat_tile[t] = st;
            }
            workgroupBarrier();

            // STEP_QUADS quads of query rows (i0 .. i0 + 4 STEP_QUADS - 1) per step: every private
            // k, v, dK, dV entry is read or updated once for them all, the private-memory traffic
            // that dominates on CPU drivers. Rows past m_tile are staged as zeros and masked; a
            // quad past the tile's end reads inside it (step_quad), masked all the same. The
            // gradients add the quads one after the other: the bits of one quad per step.
            for (var i0 = 0u; i0 < m_tile; i0 += 4u * STEP_QUADS) {
                let i1 = step_quad(i0, 1u);
                let i2 = step_quad(i0, 2u);
                let i3 = step_quad(i0, 3u);
                var s0 = QuadLanes();
                var s1 = QuadLanes();
                var s2 = QuadLanes();
                var s3 = QuadLanes();
                for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                    let d = d8 * 8u;
                    let x0 = kt[d];
                    let x1 = kt[d + 1u];
                    let x2 = kt[d + 2u];
                    let x3 = kt[d + 3u];
                    let x4 = kt[d + 4u];
                    let x5 = kt[d + 5u];
                    let x6 = kt[d + 6u];
                    let x7 = kt[d + 7u];
                    s0 = quad_dots(s0, qk_quad(i0, d8), x0, x1, x2, x3, x4, x5, x6, x7);
                    if STEP_QUADS == 4u {
                        s1 = quad_dots(s1, qk_quad(i1, d8), x0, x1, x2, x3, x4, x5, x6, x7);
                        s2 = quad_dots(s2, qk_quad(i2, d8), x0, x1, x2, x3, x4, x5, x6, x7);
                        s3 = quad_dots(s3, qk_quad(i3, d8), x0, x1, x2, x3, x4, x5, x6, x7);
                    }
                }
                let w0 = row_weights(s0, i0, i0, m_tile, m0, cols, b, h, live, q_lo, q_hi);
                var w1 = RowWeights();
                var w2 = RowWeights();
                var w3 = RowWeights();
                if STEP_QUADS == 4u {
                    w1 = row_weights(s1, i0 + 4u, i1, m_tile, m0, cols, b, h, live, q_lo, q_hi);
                    w2 = row_weights(s2, i0 + 8u, i2, m_tile, m0, cols, b, h, live, q_lo, q_hi);
                    w3 = row_weights(s3, i0 + 12u, i3, m_tile, m0, cols, b, h, live, q_lo, q_hi);
                }
                // dP and dV need the same dO rows and P is known: one pass over them serves both.
                // On lavapipe one masked loop ran faster than an unmasked path for the quads every
                // row sees (benchmarks/HISTORY.md).
                var dp0 = QuadLanes();
                var dp1 = QuadLanes();
                var dp2 = QuadLanes();
                var dp3 = QuadLanes();
                for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
                    let d = d8 * 8u;
                    let x0 = vt[d];
                    let x1 = vt[d + 1u];
                    let x2 = vt[d + 2u];
                    let x3 = vt[d + 3u];
                    let x4 = vt[d + 4u];
                    let x5 = vt[d + 5u];
                    let x6 = vt[d + 6u];
                    let x7 = vt[d + 7u];
                    let o0 = vo_quad(i0, d8);
                    var o1 = Quad();
                    var o2 = Quad();
                    var o3 = Quad();
                    dp0 = quad_dots(dp0, o0, x0, x1, x2, x3, x4, x5, x6, x7);
                    if STEP_QUADS == 4u {
                        o1 = vo_quad(i1, d8);
                        o2 = vo_quad(i2, d8);
                        o3 = vo_quad(i3, d8);
                        dp1 = quad_dots(dp1, o1, x0, x1, x2, x3, x4, x5, x6, x7);
                        dp2 = quad_dots(dp2, o2, x0, x1, x2, x3, x4, x5, x6, x7);
                        dp3 = quad_dots(dp3, o3, x0, x1, x2, x3, x4, x5, x6, x7);
                    }
                    for (var e = 0u; e < 8u; e++) {
                        var sum = dv[d + e] + column_products(w0.p, quad_column(o0, e), w0.seen);
                        if STEP_QUADS == 4u {
                            sum += column_products(w1.p, quad_column(o1, e), w1.seen);
                            sum += column_products(w2.p, quad_column(o2, e), w2.seen);
                            sum += column_products(w3.p, quad_column(o3, e), w3.seen);
                        }
                        dv[d + e] = sum;
                    }
                }
                let ds0 = score_gradients(w0, s0, dp0);
                var ds1 = QuadLanes();
                var ds2 = QuadLanes();
                var ds3 = QuadLanes();
                if STEP_QUADS == 4u {
                    ds1 = score_gradients(w1, s1, dp1);
                    ds2 = score_gradients(w2, s2, dp2);
                    ds3 = score_gradients(w3, s3, dp3);
                }
                for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                    let d = d8 * 8u;
                    let q0 = qk_quad(i0, d8);
                    var q1 = Quad();
                    var q2 = Quad();
                    var q3 = Quad();
                    if STEP_QUADS == 4u {
                        q1 = qk_quad(i1, d8);
                        q2 = qk_quad(i2, d8);
                        q3 = qk_quad(i3, d8);
                    }
                    for (var e = 0u; e < 8u; e++) {
                        var sum = dk[d + e] + column_products(ds0, quad_column(q0, e), w0.seen);
                        if STEP_QUADS == 4u {
                            sum += column_products(ds1, quad_column(q1, e), w1.seen);
                            sum += column_products(ds2, quad_column(q2, e), w2.seen);
                            sum += column_products(ds3, quad_column(q3, e), w3.seen);
                        }
                        dk[d + e] = sum;
                    }
                }
            }
        }
    }

    let accumulate = params.accumulate != 0u;
    for (var r = 0u; r < 4u; r++) {
        let j = cols[r];
        if row_stored(VIEW_DK, b, j) {
            let k_base = view_index(VIEW_DK, b, j, h_kv);
            for (var d = 0u; d < DK; d++) {
                var g = dk[d][r] * params.scale;
                if accumulate {
                    g += dk_buf[k_base + d];
                }
                dk_buf[k_base + d] = g;
            }
        }
        if !row_stored(VIEW_DV, b, j) {
            continue;
        }
        let v_base = view_index(VIEW_DV, b, j, h_kv);
        for (var d = 0u; d < DV; d++) {
            var g = dv[d][r];
            if accumulate {
                g += load_dv(v_base + d);
            }
            store_dv(v_base + d, g);
        }
    }
}
