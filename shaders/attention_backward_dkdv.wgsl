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

            // Two query rows (a, b = a + 1) per step: every private k, v, dK, dV entry is read or
            // updated once for both, halving the private-memory traffic that dominates on CPU drivers.
            // BLOCK_M is even and rows past m_tile are staged as zeros; row b is masked there.
            for (var ia = 0u; ia < m_tile; ia += 2u) {
                let ib = ia + 1u;
                var s_a = vec4<f32>(0.0);
                var s_b = vec4<f32>(0.0);
                for (var d4 = 0u; d4 < DK4; d4++) {
                    let qa = q_tile[ia * DK4 + d4];
                    let qb = q_tile[ib * DK4 + d4];
                    let d = d4 * 4u;
                    let k0 = kt[d];
                    let k1 = kt[d + 1u];
                    let k2 = kt[d + 2u];
                    let k3 = kt[d + 3u];
                    s_a += k0 * qa.x + k1 * qa.y + k2 * qa.z + k3 * qa.w;
                    s_b += k0 * qb.x + k1 * qb.y + k2 * qb.z + k3 * qb.w;
                }
                let st_a = stat_tile[ia];
                let st_b = stat_tile[ib];
                let x_a = modify_scores(s_a, vec4<u32>(m0 + ia), cols, b, h);
                let x_b = modify_scores(s_b, vec4<u32>(m0 + ib), cols, b, h);
                let row_a = live & (vec4<u32>(m0 + ia) >= q_lo) & (vec4<u32>(m0 + ia) < q_hi)
                    & score_visible(x_a);
                let p_a = select(vec4<f32>(0.0), exp(x_a - st_a.x), row_a);
                let row_b = live & (vec4<u32>(m0 + ib) >= q_lo) & (vec4<u32>(m0 + ib) < q_hi)
                    & vec4<bool>(ib < m_tile) & score_visible(x_b);
                let p_b = select(vec4<f32>(0.0), exp(x_b - st_b.x), row_b);
                // dP and dV need the same dO rows and P is known: one pass over them serves both.
                // Keys a row masks skip its dO and Q rows (a NaN there is not theirs).
                let all_seen = all(row_a & row_b);
                var dp_a = vec4<f32>(0.0);
                var dp_b = vec4<f32>(0.0);
                if all_seen {
                    for (var d4 = 0u; d4 < DV4; d4++) {
                        let oa = do_tile[ia * DV4 + d4];
                        let ob = do_tile[ib * DV4 + d4];
                        let d = d4 * 4u;
                        let v0 = vt[d];
                        let v1 = vt[d + 1u];
                        let v2 = vt[d + 2u];
                        let v3 = vt[d + 3u];
                        dp_a += v0 * oa.x + v1 * oa.y + v2 * oa.z + v3 * oa.w;
                        dp_b += v0 * ob.x + v1 * ob.y + v2 * ob.z + v3 * ob.w;
                        dv[d] += p_a * oa.x + p_b * ob.x;
                        dv[d + 1u] += p_a * oa.y + p_b * ob.y;
                        dv[d + 2u] += p_a * oa.z + p_b * ob.z;
                        dv[d + 3u] += p_a * oa.w + p_b * ob.w;
                    }
                } else {
                    for (var d4 = 0u; d4 < DV4; d4++) {
                        let oa = do_tile[ia * DV4 + d4];
                        let ob = do_tile[ib * DV4 + d4];
                        let d = d4 * 4u;
                        let v0 = vt[d];
                        let v1 = vt[d + 1u];
                        let v2 = vt[d + 2u];
                        let v3 = vt[d + 3u];
                        dp_a += v0 * oa.x + v1 * oa.y + v2 * oa.z + v3 * oa.w;
                        dp_b += v0 * ob.x + v1 * ob.y + v2 * ob.z + v3 * ob.w;
                        dv[d] += masked_product(p_a, oa.x, row_a) + masked_product(p_b, ob.x, row_b);
                        dv[d + 1u] += masked_product(p_a, oa.y, row_a) + masked_product(p_b, ob.y, row_b);
                        dv[d + 2u] += masked_product(p_a, oa.z, row_a) + masked_product(p_b, ob.z, row_b);
                        dv[d + 3u] += masked_product(p_a, oa.w, row_a) + masked_product(p_b, ob.w, row_b);
                    }
                }
                let zero = vec4<f32>(0.0);
                let ds_a = select(zero, p_a * (dp_a - st_a.y) * score_grad(s_a), row_a);
                let ds_b = select(zero, p_b * (dp_b - st_b.y) * score_grad(s_b), row_b);
                if all_seen {
                    for (var d4 = 0u; d4 < DK4; d4++) {
                        let qa = q_tile[ia * DK4 + d4];
                        let qb = q_tile[ib * DK4 + d4];
                        let d = d4 * 4u;
                        dk[d] += ds_a * qa.x + ds_b * qb.x;
                        dk[d + 1u] += ds_a * qa.y + ds_b * qb.y;
                        dk[d + 2u] += ds_a * qa.z + ds_b * qb.z;
                        dk[d + 3u] += ds_a * qa.w + ds_b * qb.w;
                    }
                } else if any(row_a | row_b) {
                    for (var d4 = 0u; d4 < DK4; d4++) {
                        let qa = q_tile[ia * DK4 + d4];
                        let qb = q_tile[ib * DK4 + d4];
                        let d = d4 * 4u;
                        dk[d] += masked_product(ds_a, qa.x, row_a) + masked_product(ds_b, qb.x, row_b);
                        dk[d + 1u] += masked_product(ds_a, qa.y, row_a) + masked_product(ds_b, qb.y, row_b);
                        dk[d + 2u] += masked_product(ds_a, qa.z, row_a) + masked_product(ds_b, qb.z, row_b);
                        dk[d + 3u] += masked_product(ds_a, qa.w, row_a) + masked_product(ds_b, qb.w, row_b);
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
