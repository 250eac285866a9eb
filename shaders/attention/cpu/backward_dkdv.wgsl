// Attention backward, step 2 (SPEC.md): for each key j, with p_ij recomputed from the saved lse,
//   dV_j = sum_i p_ij dO_i,   dK_j = scale * sum_i dS_ij q_i,   dS_ij = p_ij (dO_i . v_j - D_i),
// summed over every query head that shares kv head h_kv (grouped/multi-query attention), in a fixed
// order: deterministic, no atomics. A workgroup owns BLOCK_N = 4 * WG keys of one (batch, kv head);
// each invocation owns four keys, one per vec4 lane (k, v transposed, dK, dV accumulators in
// registers), and the workgroup stages Q, dO and (lse, D) tiles of BLOCK_M query rows, read a quad
// (four rows by eight dims, attention/cpu/quads.wgsl) at a time. Under the
// causal mask, query tiles that see none of the block's keys are skipped.
//
// The loop over (query head g of the group, query row i), flattened as g * Lq + i, runs over
// [chunk_begin, chunk_end); later chunks add to dK and dV.

override WG: u32 = 64u;
override BLOCK_M: u32 = 32u;

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

            // A quad of query rows (i0 .. i0 + 3) per step: every private k, v, dK, dV entry is read
            // or updated once for the four, the private-memory traffic that dominates on CPU
            // drivers. BLOCK_M is a multiple of 4 and rows past m_tile are staged as zeros and
            // masked.
            for (var i0 = 0u; i0 < m_tile; i0 += 4u) {
                var s = QuadLanes();
                for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                    let d = d8 * 8u;
                    s = quad_dots(
                        s,
                        qk_quad(i0, d8),
                        kt[d], kt[d + 1u], kt[d + 2u], kt[d + 3u],
                        kt[d + 4u], kt[d + 5u], kt[d + 6u], kt[d + 7u],
                    );
                }
                let st0 = stat_tile[i0];
                let st1 = stat_tile[i0 + 1u];
                let st2 = stat_tile[i0 + 2u];
                let st3 = stat_tile[i0 + 3u];
                let x0 = modify_scores(s.r0, vec4<u32>(m0 + i0), cols, b, h);
                let x1 = modify_scores(s.r1, vec4<u32>(m0 + i0 + 1u), cols, b, h);
                let x2 = modify_scores(s.r2, vec4<u32>(m0 + i0 + 2u), cols, b, h);
                let x3 = modify_scores(s.r3, vec4<u32>(m0 + i0 + 3u), cols, b, h);
                let seen0 = keys_seen(m0 + i0, i0 < m_tile, x0, live, q_lo, q_hi);
                let seen1 = keys_seen(m0 + i0 + 1u, i0 + 1u < m_tile, x1, live, q_lo, q_hi);
                let seen2 = keys_seen(m0 + i0 + 2u, i0 + 2u < m_tile, x2, live, q_lo, q_hi);
                let seen3 = keys_seen(m0 + i0 + 3u, i0 + 3u < m_tile, x3, live, q_lo, q_hi);
                let zero = vec4<f32>(0.0);
                let p = QuadLanes(
                    select(zero, exp(x0 - st0.x), seen0),
                    select(zero, exp(x1 - st1.x), seen1),
                    select(zero, exp(x2 - st2.x), seen2),
                    select(zero, exp(x3 - st3.x), seen3),
                );
                let seen = QuadSeen(seen0, seen1, seen2, seen3);
                // dP and dV need the same dO rows and P is known: one pass over them serves both.
                // On lavapipe one masked loop ran faster than an unmasked path for the quads every
                // row sees (benchmarks/HISTORY.md).
                var dp = QuadLanes();
                for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
                    let o = vo_quad(i0, d8);
                    let d = d8 * 8u;
                    dp = quad_dots(
                        dp,
                        o,
                        vt[d], vt[d + 1u], vt[d + 2u], vt[d + 3u],
                        vt[d + 4u], vt[d + 5u], vt[d + 6u], vt[d + 7u],
                    );
                    for (var e = 0u; e < 8u; e++) {
                        dv[d8 * 8u + e] += column_products(p, quad_column(o, e), seen);
                    }
                }
                let ds = QuadLanes(
                    select(zero, p.r0 * (dp.r0 - st0.y) * score_grad(s.r0), seen0),
                    select(zero, p.r1 * (dp.r1 - st1.y) * score_grad(s.r1), seen1),
                    select(zero, p.r2 * (dp.r2 - st2.y) * score_grad(s.r2), seen2),
                    select(zero, p.r3 * (dp.r3 - st3.y) * score_grad(s.r3), seen3),
                );
                for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                    let q = qk_quad(i0, d8);
                    for (var e = 0u; e < 8u; e++) {
                        dk[d8 * 8u + e] += column_products(ds, quad_column(q, e), seen);
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
