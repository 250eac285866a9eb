// Attention backward, step 2 (SPEC.md): for each key j, with p_ij recomputed from the saved lse,
//   dV_j = sum_i p_ij dO_i,   dK_j = scale * sum_i dS_ij q_i,   dS_ij = p_ij (dO_i . v_j - D_i),
// summed over every query head that shares kv head h_kv (grouped/multi-query attention), in a fixed
// order: deterministic, no atomics. A workgroup owns BLOCK_N = 4 * WG keys of one (batch, kv head);
// each invocation owns four keys, one per vec4 lane (k, v transposed, dK, dV accumulators in
// registers), and the workgroup stages Q, dO and (lse, D) tiles of BLOCK_M query rows. Under the
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
override Q_TILE: u32 = BLOCK_M * DK4;
override DO_TILE: u32 = BLOCK_M * DV4;

const MAX_D: u32 = 256u;

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> dk_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> dv_buf: array<f32>;


var<workgroup> q_tile: array<vec4<f32>, Q_TILE>;
var<workgroup> do_tile: array<vec4<f32>, DO_TILE>;
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
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    for (var d = 0u; d < DK4 * 4u; d++) {
        kt[d] = vec4<f32>(0.0);
        dk[d] = vec4<f32>(0.0);
    }
    for (var d = 0u; d < DV4 * 4u; d++) {
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
                let ii = t / DK4;
                let c4 = t % DK4;
                var x = vec4<f32>(0.0);
                if ii < m_tile {
                    let base = view_index(VIEW_Q, b, m0 + ii, h) + c4 * 4u;
                    for (var c = 0u; c < 4u; c++) {
                        if c4 * 4u + c < DK {
                            x[c] = q_buf[base + c];
                        }
                    }
                }
                q_tile[t] = x;
            }
            for (var t = lid; t < DO_TILE; t += WG) {
                let ii = t / DV4;
                let c4 = t % DV4;
                var x = vec4<f32>(0.0);
                if ii < m_tile {
                    let base = view_index(VIEW_DO, b, m0 + ii, h) + c4 * 4u;
                    for (var c = 0u; c < 4u; c++) {
                        if c4 * 4u + c < DV {
                            x[c] = do_buf[base + c];
                        }
                    }
                }
                do_tile[t] = x;
            }
            for (var t = lid; t < BLOCK_M; t += WG) {
                var st = vec2<f32>(0.0);
                if t < m_tile {
                    st = stats[(b * params.heads + h) * params.q_seq + m0 + t];
                }
                stat_tile[t] = st;
            }
            workgroupBarrier();

            // Four query rows (i0 .. i0 + 3) per step: every private k, v, dK, dV entry is read or
            // updated once for the four, the private-memory traffic that dominates on CPU drivers.
            // BLOCK_M is a multiple of 4 and rows past m_tile are staged as zeros and masked.
            for (var i0 = 0u; i0 < m_tile; i0 += 4u) {
                var s0 = vec4<f32>(0.0);
                var s1 = vec4<f32>(0.0);
                var s2 = vec4<f32>(0.0);
                var s3 = vec4<f32>(0.0);
                for (var d4 = 0u; d4 < DK4; d4++) {
                    let q0 = q_tile[i0 * DK4 + d4];
                    let q1 = q_tile[(i0 + 1u) * DK4 + d4];
                    let q2 = q_tile[(i0 + 2u) * DK4 + d4];
                    let q3 = q_tile[(i0 + 3u) * DK4 + d4];
                    let d = d4 * 4u;
                    let k0 = kt[d];
                    let k1 = kt[d + 1u];
                    let k2 = kt[d + 2u];
                    let k3 = kt[d + 3u];
                    s0 += k0 * q0.x + k1 * q0.y + k2 * q0.z + k3 * q0.w;
                    s1 += k0 * q1.x + k1 * q1.y + k2 * q1.z + k3 * q1.w;
                    s2 += k0 * q2.x + k1 * q2.y + k2 * q2.z + k3 * q2.w;
                    s3 += k0 * q3.x + k1 * q3.y + k2 * q3.z + k3 * q3.w;
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
                // Keys a row masks skip its dO and Q rows (a NaN there is not theirs).
                let all_seen = all(seen0 & seen1 & seen2 & seen3);
                var dp0 = vec4<f32>(0.0);
                var dp1 = vec4<f32>(0.0);
                var dp2 = vec4<f32>(0.0);
                var dp3 = vec4<f32>(0.0);
                if all_seen {
                    for (var d4 = 0u; d4 < DV4; d4++) {
                        let o0 = do_tile[i0 * DV4 + d4];
                        let o1 = do_tile[(i0 + 1u) * DV4 + d4];
                        let o2 = do_tile[(i0 + 2u) * DV4 + d4];
                        let o3 = do_tile[(i0 + 3u) * DV4 + d4];
                        let d = d4 * 4u;
                        let v0 = vt[d];
                        let v1 = vt[d + 1u];
                        let v2 = vt[d + 2u];
                        let v3 = vt[d + 3u];
                        dp0 += v0 * o0.x + v1 * o0.y + v2 * o0.z + v3 * o0.w;
                        dp1 += v0 * o1.x + v1 * o1.y + v2 * o1.z + v3 * o1.w;
                        dp2 += v0 * o2.x + v1 * o2.y + v2 * o2.z + v3 * o2.w;
                        dp3 += v0 * o3.x + v1 * o3.y + v2 * o3.z + v3 * o3.w;
                        dv[d] += (p0 * o0.x + p1 * o1.x) + (p2 * o2.x + p3 * o3.x);
                        dv[d + 1u] += (p0 * o0.y + p1 * o1.y) + (p2 * o2.y + p3 * o3.y);
                        dv[d + 2u] += (p0 * o0.z + p1 * o1.z) + (p2 * o2.z + p3 * o3.z);
                        dv[d + 3u] += (p0 * o0.w + p1 * o1.w) + (p2 * o2.w + p3 * o3.w);
                    }
                } else {
                    for (var d4 = 0u; d4 < DV4; d4++) {
                        let o0 = do_tile[i0 * DV4 + d4];
                        let o1 = do_tile[(i0 + 1u) * DV4 + d4];
                        let o2 = do_tile[(i0 + 2u) * DV4 + d4];
                        let o3 = do_tile[(i0 + 3u) * DV4 + d4];
                        let d = d4 * 4u;
                        let v0 = vt[d];
                        let v1 = vt[d + 1u];
                        let v2 = vt[d + 2u];
                        let v3 = vt[d + 3u];
                        dp0 += v0 * o0.x + v1 * o0.y + v2 * o0.z + v3 * o0.w;
                        dp1 += v0 * o1.x + v1 * o1.y + v2 * o1.z + v3 * o1.w;
                        dp2 += v0 * o2.x + v1 * o2.y + v2 * o2.z + v3 * o2.w;
                        dp3 += v0 * o3.x + v1 * o3.y + v2 * o3.z + v3 * o3.w;
                        dv[d] += masked_products4(p0, p1, p2, p3, o0.x, o1.x, o2.x, o3.x, seen0, seen1, seen2, seen3);
                        dv[d + 1u] += masked_products4(p0, p1, p2, p3, o0.y, o1.y, o2.y, o3.y, seen0, seen1, seen2, seen3);
                        dv[d + 2u] += masked_products4(p0, p1, p2, p3, o0.z, o1.z, o2.z, o3.z, seen0, seen1, seen2, seen3);
                        dv[d + 3u] += masked_products4(p0, p1, p2, p3, o0.w, o1.w, o2.w, o3.w, seen0, seen1, seen2, seen3);
                    }
                }
                let ds0 = select(zero, p0 * (dp0 - st0.y) * score_grad(s0), seen0);
                let ds1 = select(zero, p1 * (dp1 - st1.y) * score_grad(s1), seen1);
                let ds2 = select(zero, p2 * (dp2 - st2.y) * score_grad(s2), seen2);
                let ds3 = select(zero, p3 * (dp3 - st3.y) * score_grad(s3), seen3);
                if all_seen {
                    for (var d4 = 0u; d4 < DK4; d4++) {
                        let q0 = q_tile[i0 * DK4 + d4];
                        let q1 = q_tile[(i0 + 1u) * DK4 + d4];
                        let q2 = q_tile[(i0 + 2u) * DK4 + d4];
                        let q3 = q_tile[(i0 + 3u) * DK4 + d4];
                        let d = d4 * 4u;
                        dk[d] += (ds0 * q0.x + ds1 * q1.x) + (ds2 * q2.x + ds3 * q3.x);
                        dk[d + 1u] += (ds0 * q0.y + ds1 * q1.y) + (ds2 * q2.y + ds3 * q3.y);
                        dk[d + 2u] += (ds0 * q0.z + ds1 * q1.z) + (ds2 * q2.z + ds3 * q3.z);
                        dk[d + 3u] += (ds0 * q0.w + ds1 * q1.w) + (ds2 * q2.w + ds3 * q3.w);
                    }
                } else if any(seen0 | seen1 | seen2 | seen3) {
                    for (var d4 = 0u; d4 < DK4; d4++) {
                        let q0 = q_tile[i0 * DK4 + d4];
                        let q1 = q_tile[(i0 + 1u) * DK4 + d4];
                        let q2 = q_tile[(i0 + 2u) * DK4 + d4];
                        let q3 = q_tile[(i0 + 3u) * DK4 + d4];
                        let d = d4 * 4u;
                        dk[d] += masked_products4(ds0, ds1, ds2, ds3, q0.x, q1.x, q2.x, q3.x, seen0, seen1, seen2, seen3);
                        dk[d + 1u] += masked_products4(ds0, ds1, ds2, ds3, q0.y, q1.y, q2.y, q3.y, seen0, seen1, seen2, seen3);
                        dk[d + 2u] += masked_products4(ds0, ds1, ds2, ds3, q0.z, q1.z, q2.z, q3.z, seen0, seen1, seen2, seen3);
                        dk[d + 3u] += masked_products4(ds0, ds1, ds2, ds3, q0.w, q1.w, q2.w, q3.w, seen0, seen1, seen2, seen3);
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
