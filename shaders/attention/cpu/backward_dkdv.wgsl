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
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
// Staged row strides in vec4s: whole quads (eight dims), the padding zero.
override DK4P: u32 = DK4 + (DK4 & 1u);
override DV4P: u32 = DV4 + (DV4 & 1u);
override Q_TILE: u32 = BLOCK_M * DK4P;
override DO_TILE: u32 = BLOCK_M * DV4P;

// The per-invocation arrays' sizes, declared by the pipeline's key (private arrays need constant
// lengths; src/kernels/attention/variant.rs): MAX_D: the head dims rounded up to whole quads.

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> dk_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> dv_buf: array<f32>;

// Q and dO.
var<workgroup> tile_qk: array<vec4<f32>, Q_TILE>;
var<workgroup> tile_vo: array<vec4<f32>, DO_TILE>;
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
    let k_block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.kv_heads;
    let h_kv = bh % params.kv_heads;
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
            for (var d = 0u; d < DK; d++) {
                kt[d][r] = k_buf[k_base + d] * params.scale;
            }
            let v_base = view_index(VIEW_V, b, j, h_kv);
            for (var d = 0u; d < DV; d++) {
                vt[d][r] = v_buf[v_base + d];
            }
        }
    }

    // Query rows that can see any key of the block: from the first key's start to the last valid
    // key's end.
    var m_lo = query_start(col0);
    var m_hi = qlen;
    if col0 >= kvlen {
        m_lo = qlen;
    } else {
        m_hi = min(qlen, query_end(min(col0 + WG * 4u, kvlen) - 1u));
    }

    for (var g = 0u; g < group_size; g++) {
        // This dispatch's rows of query head g: [lo, hi), all uniform across the workgroup.
        let t0 = g * params.q_seq;
        if params.chunk_end <= t0 {
            break;
        }
        if params.chunk_begin >= t0 + params.q_seq {
            continue;
        }
        let lo = max(m_lo, max(params.chunk_begin, t0) - t0);
        let hi = min(m_hi, min(params.chunk_end, t0 + params.q_seq) - t0);
        let h = h_kv * group_size + g;
        for (var m0 = lo; m0 < hi; m0 += BLOCK_M) {
            let m_tile = min(BLOCK_M, hi - m0);
            workgroupBarrier();
            for (var t = lid; t < Q_TILE; t += WG) {
                let ii = t / DK4P;
                let c4 = t % DK4P;
                var x = vec4<f32>(0.0);
                if ii < m_tile {
                    let base = view_index(VIEW_Q, b, m0 + ii, h) + c4 * 4u;
                    for (var c = 0u; c < 4u; c++) {
                        if c4 * 4u + c < DK {
                            x[c] = q_buf[base + c];
                        }
                    }
                }
                tile_qk[t] = x;
            }
            for (var t = lid; t < DO_TILE; t += WG) {
                let ii = t / DV4P;
                let c4 = t % DV4P;
                var x = vec4<f32>(0.0);
                if ii < m_tile {
                    let base = view_index(VIEW_DO, b, m0 + ii, h) + c4 * 4u;
                    for (var c = 0u; c < 4u; c++) {
                        if c4 * 4u + c < DV {
                            x[c] = do_buf[base + c];
                        }
                    }
                }
                tile_vo[t] = x;
            }
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
                var s0 = vec4<f32>(0.0);
                var s1 = vec4<f32>(0.0);
                var s2 = vec4<f32>(0.0);
                var s3 = vec4<f32>(0.0);
                for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                    let q = qk_quad(i0, d8);
                    let d = d8 * 8u;
                    let k0 = kt[d];
                    let k1 = kt[d + 1u];
                    let k2 = kt[d + 2u];
                    let k3 = kt[d + 3u];
                    let k4 = kt[d + 4u];
                    let k5 = kt[d + 5u];
                    let k6 = kt[d + 6u];
                    let k7 = kt[d + 7u];
                    s0 = quad_row_dot(s0, k0, k1, k2, k3, k4, k5, k6, k7, q.a0, q.b0);
                    s1 = quad_row_dot(s1, k0, k1, k2, k3, k4, k5, k6, k7, q.a1, q.b1);
                    s2 = quad_row_dot(s2, k0, k1, k2, k3, k4, k5, k6, k7, q.a2, q.b2);
                    s3 = quad_row_dot(s3, k0, k1, k2, k3, k4, k5, k6, k7, q.a3, q.b3);
                }
                let st0 = stat_tile[i0];
                let st1 = stat_tile[i0 + 1u];
                let st2 = stat_tile[i0 + 2u];
                let st3 = stat_tile[i0 + 3u];
                let x0 = modify_scores(s0, vec4<u32>(m0 + i0), cols, b, h);
                let x1 = modify_scores(s1, vec4<u32>(m0 + i0 + 1u), cols, b, h);
                let x2 = modify_scores(s2, vec4<u32>(m0 + i0 + 2u), cols, b, h);
                let x3 = modify_scores(s3, vec4<u32>(m0 + i0 + 3u), cols, b, h);
                let seen0 = keys_seen(m0 + i0, i0 < m_tile, x0, live, q_lo, q_hi);
                let seen1 = keys_seen(m0 + i0 + 1u, i0 + 1u < m_tile, x1, live, q_lo, q_hi);
                let seen2 = keys_seen(m0 + i0 + 2u, i0 + 2u < m_tile, x2, live, q_lo, q_hi);
                let seen3 = keys_seen(m0 + i0 + 3u, i0 + 3u < m_tile, x3, live, q_lo, q_hi);
                let zero = vec4<f32>(0.0);
                let p0 = select(zero, exp(x0 - st0.x), seen0);
                let p1 = select(zero, exp(x1 - st1.x), seen1);
                let p2 = select(zero, exp(x2 - st2.x), seen2);
                let p3 = select(zero, exp(x3 - st3.x), seen3);
                // dP and dV need the same dO rows and P is known: one pass over them serves both.
                // Keys a row masks skip its dO and Q rows (a NaN there is not theirs): masked
                // products throughout; on lavapipe one masked loop ran faster than an unmasked path
                // for the quads every row sees (benchmarks/HISTORY.md).
                var dp0 = vec4<f32>(0.0);
                var dp1 = vec4<f32>(0.0);
                var dp2 = vec4<f32>(0.0);
                var dp3 = vec4<f32>(0.0);
                for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
                    let o = vo_quad(i0, d8);
                    let d = d8 * 8u;
                    let v0 = vt[d];
                    let v1 = vt[d + 1u];
                    let v2 = vt[d + 2u];
                    let v3 = vt[d + 3u];
                    let v4 = vt[d + 4u];
                    let v5 = vt[d + 5u];
                    let v6 = vt[d + 6u];
                    let v7 = vt[d + 7u];
                    dp0 = quad_row_dot(dp0, v0, v1, v2, v3, v4, v5, v6, v7, o.a0, o.b0);
                    dp1 = quad_row_dot(dp1, v0, v1, v2, v3, v4, v5, v6, v7, o.a1, o.b1);
                    dp2 = quad_row_dot(dp2, v0, v1, v2, v3, v4, v5, v6, v7, o.a2, o.b2);
                    dp3 = quad_row_dot(dp3, v0, v1, v2, v3, v4, v5, v6, v7, o.a3, o.b3);
                    dv[d] += masked_products4(p0, p1, p2, p3, o.a0.x, o.a1.x, o.a2.x, o.a3.x, seen0, seen1, seen2, seen3);
                    dv[d + 1u] += masked_products4(p0, p1, p2, p3, o.a0.y, o.a1.y, o.a2.y, o.a3.y, seen0, seen1, seen2, seen3);
                    dv[d + 2u] += masked_products4(p0, p1, p2, p3, o.a0.z, o.a1.z, o.a2.z, o.a3.z, seen0, seen1, seen2, seen3);
                    dv[d + 3u] += masked_products4(p0, p1, p2, p3, o.a0.w, o.a1.w, o.a2.w, o.a3.w, seen0, seen1, seen2, seen3);
                    dv[d + 4u] += masked_products4(p0, p1, p2, p3, o.b0.x, o.b1.x, o.b2.x, o.b3.x, seen0, seen1, seen2, seen3);
                    dv[d + 5u] += masked_products4(p0, p1, p2, p3, o.b0.y, o.b1.y, o.b2.y, o.b3.y, seen0, seen1, seen2, seen3);
                    dv[d + 6u] += masked_products4(p0, p1, p2, p3, o.b0.z, o.b1.z, o.b2.z, o.b3.z, seen0, seen1, seen2, seen3);
                    dv[d + 7u] += masked_products4(p0, p1, p2, p3, o.b0.w, o.b1.w, o.b2.w, o.b3.w, seen0, seen1, seen2, seen3);
                }
                let ds0 = select(zero, p0 * (dp0 - st0.y) * score_grad(s0), seen0);
                let ds1 = select(zero, p1 * (dp1 - st1.y) * score_grad(s1), seen1);
                let ds2 = select(zero, p2 * (dp2 - st2.y) * score_grad(s2), seen2);
                let ds3 = select(zero, p3 * (dp3 - st3.y) * score_grad(s3), seen3);
                for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                    let q = qk_quad(i0, d8);
                    let d = d8 * 8u;
                    dk[d] += masked_products4(ds0, ds1, ds2, ds3, q.a0.x, q.a1.x, q.a2.x, q.a3.x, seen0, seen1, seen2, seen3);
                    dk[d + 1u] += masked_products4(ds0, ds1, ds2, ds3, q.a0.y, q.a1.y, q.a2.y, q.a3.y, seen0, seen1, seen2, seen3);
                    dk[d + 2u] += masked_products4(ds0, ds1, ds2, ds3, q.a0.z, q.a1.z, q.a2.z, q.a3.z, seen0, seen1, seen2, seen3);
                    dk[d + 3u] += masked_products4(ds0, ds1, ds2, ds3, q.a0.w, q.a1.w, q.a2.w, q.a3.w, seen0, seen1, seen2, seen3);
                    dk[d + 4u] += masked_products4(ds0, ds1, ds2, ds3, q.b0.x, q.b1.x, q.b2.x, q.b3.x, seen0, seen1, seen2, seen3);
                    dk[d + 5u] += masked_products4(ds0, ds1, ds2, ds3, q.b0.y, q.b1.y, q.b2.y, q.b3.y, seen0, seen1, seen2, seen3);
                    dk[d + 6u] += masked_products4(ds0, ds1, ds2, ds3, q.b0.z, q.b1.z, q.b2.z, q.b3.z, seen0, seen1, seen2, seen3);
                    dk[d + 7u] += masked_products4(ds0, ds1, ds2, ds3, q.b0.w, q.b1.w, q.b2.w, q.b3.w, seen0, seen1, seen2, seen3);
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
