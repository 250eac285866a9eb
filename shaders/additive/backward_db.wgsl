// Fused additive attention backward, key side (after attention/common.wgsl and additive/common.wgsl):
// for each key j, over the query rows i that see it (recomputed: t = tanh(a_i + b_j + bias),
// e = scale w . t, p = exp(e - lse_i)),
//   dv_j += p dO_i,   ds_ij = p (dO_i . v_j - D_i),   db_j += ds_ij * scale w (1 - t^2)
// with D_i from additive/backward_da.wgsl (in the workspace, with lse). db_j is written to VIEW_DK, dv_j to VIEW_DV.
// LANES invocations per key (additive/backward_lanes.wgsl), ROWS keys of one (batch, head) per
// workgroup; query tiles of TILE rows (a + bias in pair_tile, dO in v_tile, lse, D and their visible
// key ranges) staged in workgroup memory. The query loop runs over [chunk_begin, chunk_end) and later
// dispatches (accumulate = 1) add to db and dv. scale * w multiplies the sum over queries once, at
// the end.

@group(0) @binding(6) var<storage, read> do_buf: array<f32>;
// db and dV (attention/output_pair.wgsl, appended, names them dk_buf and dv_buf).
@group(0) @binding(7) var<storage, read_write> dk_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> dv_buf: array<f32>;

var<workgroup> lse_tile: array<f32, TILE>;
var<workgroup> d_tile: array<f32, TILE>;
var<workgroup> start_tile: array<u32, TILE>;
var<workgroup> end_tile: array<u32, TILE>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier below in uniform control flow.
    if group >= params.total_groups {
        return;
    }
    let block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let lane = lid % LANES;
    let key0 = block * ROWS;
    let j = key0 + lid / LANES;
    let live = j < kvlen;

    // This lane's share of the key: b and the db sum at vec4s lane + LANES k, v and dv at value dims
    // lane + LANES k.
    var own: array<vec4<f32>, MAX_LANE_DA4>;
    var vj: array<f32, MAX_LANE_DV>;
    // sum_i ds_ij (1 - t^2): times scale * w at the end.
    var db: array<vec4<f32>, MAX_LANE_DA4>;
    var dv: array<f32, MAX_LANE_DV>;
    for (var k = 0u; k < LANE_DA4; k++) {
        own[k] = vec4<f32>(0.0);
        db[k] = vec4<f32>(0.0);
        if live {
            own[k] = b_key4(b, j, h, lane + LANES * k);
        }
    }
    for (var k = 0u; k < LANE_DV; k++) {
        vj[k] = 0.0;
        dv[k] = 0.0;
        let d = lane + LANES * k;
        if live && d < DV {
            vj[k] = v_keys[view_index(VIEW_V, b, j, h) + d];
        }
    }
    stage_w(h, lid);

    // The query rows that see any key of the block, within this dispatch's chunk.
    let rows = key_block_rows(key0, ROWS, qlen, kvlen);
    let m_begin = max(params.chunk_begin, rows.x);
    let m_end = min(rows.y, params.chunk_end);
    for (var m0 = m_begin; m0 < m_end; m0 += TILE) {
        workgroupBarrier();
        for (var t = lid; t < PAIR_TILE; t += WG) {
            let i = m0 + t / DA4;
            var x = vec4<f32>(0.0);
            if i < m_end {
                x = a_plus_bias4(b, i, h, t % DA4);
            }
            pair_tile[t] = x;
        }
        // dO rows, packed by fours of rows like V in the query-side kernels.
        for (var t = lid; t < TILE * DVS; t += WG) {
            let ii = t / DVS;
            let d = t % DVS;
            var x = 0.0;
            if m0 + ii < m_end && d < DV {
                x = do_buf[view_index(VIEW_DO, b, m0 + ii, h) + d];
            }
            v_tile[ii / 4u * DVS + d][ii % 4u] = x;
        }
        for (var t = lid; t < TILE; t += WG) {
            let i = m0 + t;
            var lse = neg_inf();
            var dr = 0.0;
            var s = 1u;
            var e = 0u;
            if i < m_end {
                let row = (b * params.heads + h) * params.q_seq + i;
                lse = workspace[ws_lse() + row];
                dr = workspace[row];
                s = key_start(i);
                e = key_end(i, kvlen);
            }
            lse_tile[t] = lse;
            d_tile[t] = dr;
            start_tile[t] = s;
            end_tile[t] = e;
        }
        workgroupBarrier();
        // Four query rows per step (additive/common.wgsl).
        for (var q = 0u; q < TILE / 4u; q++) {
            let ii = 4u * q;
            let lse = vec4<f32>(lse_tile[ii], lse_tile[ii + 1u], lse_tile[ii + 2u], lse_tile[ii + 3u]);
            let starts = vec4<u32>(start_tile[ii], start_tile[ii + 1u], start_tile[ii + 2u], start_tile[ii + 3u]);
            let ends = vec4<u32>(end_tile[ii], end_tile[ii + 1u], end_tile[ii + 2u], end_tile[ii + 3u]);
            let jv = vec4<u32>(j);
            let seen = vec4<bool>(live) & (jv >= starts) & (jv < ends) & score_visible(lse);
            // Keys that none of the four see skip the work, not the barriers of row_sum.
            let any_seen = any(seen);
            // Each tanh once: kept from the scores for the derivatives.
            var t_row: array<mat4x4<f32>, MAX_LANE_DA4>;
            var e = vec4<f32>(0.0);
            if any_seen {
                let all_seen = all(seen);
                for (var k = 0u; k < LANE_DA4; k++) {
                    let c4 = lane + LANES * k;
                    var t = tanh_rows(own[k], ii, c4);
                    if !all_seen {
                        t = mask_pairs(t, seen);
                    }
                    t_row[k] = t;
                    e += w_tile[c4] * t;
                }
            }
            e = row_sum(e, 0u, lid);
            // Rows that do not see this key (or saw none, lse = -inf) contribute nothing.
            let p = select(vec4<f32>(0.0), exp(e - lse), seen);
            var dp = vec4<f32>(0.0);
            if any_seen {
                for (var k = 0u; k < LANE_DV; k++) {
                    // dO of rows that do not see this key is not read (a NaN there is not theirs).
                    let g = select(vec4<f32>(0.0), v_tile[q * DVS + lane + LANES * k], seen);
                    dp += g * vj[k];
                    dv[k] += dot(p, g);
                }
            }
            dp = row_sum(dp, 1u, lid);
            if any_seen {
                let d_row = vec4<f32>(d_tile[ii], d_tile[ii + 1u], d_tile[ii + 2u], d_tile[ii + 3u]);
                let ds = select(vec4<f32>(0.0), p * (dp - d_row), seen);
                for (var k = 0u; k < LANE_DA4; k++) {
                    db[k] += dtanh_rows(t_row[k], ds);
                }
            }
        }
    }

    // Padded keys get zero gradients.
    if j >= params.kv_seq {
        return;
    }
    let b_base = view_index(VIEW_DK, b, j, h);
    for (var k = 0u; k < LANE_DA4; k++) {
        let c4 = lane + LANES * k;
        let db4 = w_tile[c4] * db[k];
        for (var kk = 0u; kk < 4u; kk++) {
            let c = 4u * c4 + kk;
            if c < DA {
                var x = db4[kk];
                if params.accumulate != 0u {
                    x += dk_buf[b_base + c];
                }
                dk_buf[b_base + c] = x;
            }
        }
    }
    let v_base = view_index(VIEW_DV, b, j, h);
    for (var k = 0u; k < LANE_DV; k++) {
        let d = lane + LANES * k;
        if d < DV {
            var x = dv[k];
            if params.accumulate != 0u {
                x += load_dv(v_base + d);
            }
            store_dv(v_base + d, x);
        }
    }
}
