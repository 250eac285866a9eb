// Fused additive attention backward, query side (after attention/common.wgsl and
// additive/common.wgsl): for each query row i, with D_i = dO_i . O_i and, over its visible keys j
// (recomputed: t = tanh(a_i + b_j + bias), e = scale w . t, p = exp(e - lse_i)),
//   ds_ij = p (dO_i . v_j - D_i),   da_i += ds_ij * scale w (1 - t^2),   dw_i += ds_ij * scale t
// da_i is written to VIEW_DQ; the per-row shares dw_i and D_i to the workspace
// (additive/backward_workspace.wgsl, which also holds w, the bias and lse): the key-side kernel reads
// D, additive_param_grads sums the shares, and da for the bias, in a fixed order. LANES invocations
// per query row (additive/backward_lanes.wgsl), ROWS rows per workgroup, key tiles staged as in the
// forward; the key loop runs over [chunk_begin, chunk_end) and later dispatches (accumulate = 1) add
// to da and the shares. scale * w (da) and scale (dw) multiply the sums over keys once, at the end.

@group(0) @binding(6) var<storage, read> o_buf: array<f32>;
@group(0) @binding(7) var<storage, read> do_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> da_buf: array<f32>;

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
    let row0 = block * ROWS;
    let i = row0 + lid / LANES;
    let live = i < qlen;
    let row = (b * params.heads + h) * params.q_seq + i;

    // This lane's share of the row: a + bias and the score sums at vec4s lane + LANES k, dO at value
    // dims lane + LANES k.
    var own: array<vec4<f32>, MAX_LANE_DA4>;
    var g: array<f32, MAX_LANE_DV>;
    // sum_j ds_ij (1 - t^2) and sum_j ds_ij t: times scale * w and scale at the end.
    var da: array<vec4<f32>, MAX_LANE_DA4>;
    var dw: array<vec4<f32>, MAX_LANE_DA4>;
    var d_part = 0.0;
    var lse = neg_inf();
    for (var k = 0u; k < LANE_DA4; k++) {
        own[k] = vec4<f32>(0.0);
        da[k] = vec4<f32>(0.0);
        dw[k] = vec4<f32>(0.0);
        if live {
            own[k] = a_plus_bias4(b, i, h, lane + LANES * k);
        }
    }
    for (var k = 0u; k < LANE_DV; k++) {
        g[k] = 0.0;
        let d = lane + LANES * k;
        if live && d < DV {
            g[k] = do_buf[view_index(VIEW_DO, b, i, h) + d];
            d_part += g[k] * o_buf[view_index(VIEW_O, b, i, h) + d];
        }
    }
    if live {
        lse = workspace[ws_lse() + row];
    }
    stage_w(h, lid);
    // D_i = dO_i . O_i over the row's lanes (half 1: the key loop's first step writes half 0).
    let d_row = row_sum(vec4<f32>(d_part, 0.0, 0.0, 0.0), 1u, lid).x;
    var start = 0u;
    var end = 0u;
    if live && not_masked(lse) {
        start = key_start(i);
        end = key_end(i, kvlen);
    }

    let keys = query_block_keys(aligned(0u), row0, ROWS, qlen, kvlen);
    let kv_hi = min(keys.y, params.chunk_end);
    let n_begin = max(params.chunk_begin, keys.x / TILE * TILE);
    for (var n0 = n_begin; n0 < kv_hi; n0 += TILE) {
        workgroupBarrier();
        stage_keys(n0, kv_hi, b, h, lid);
        workgroupBarrier();
        // Four keys per step (additive/common.wgsl).
        for (var q = 0u; q < TILE / 4u; q++) {
            let j = vec4<u32>(n0 + 4u * q) + vec4<u32>(0u, 1u, 2u, 3u);
            let seen = (j >= vec4<u32>(start)) & (j < vec4<u32>(end)) & (j < vec4<u32>(kv_hi));
            // Rows that see none of the four skip the work, not the barriers of row_sum.
            let any_seen = any(seen);
            // Each tanh once: kept from the scores for the derivatives.
            var t_row: array<mat4x4<f32>, MAX_LANE_DA4>;
            var e = vec4<f32>(0.0);
            var dp = vec4<f32>(0.0);
            if any_seen {
                let all_seen = all(seen);
                for (var k = 0u; k < LANE_DA4; k++) {
                    let c4 = lane + LANES * k;
                    var t = tanh_rows(own[k], 4u * q, c4);
                    if !all_seen {
                        t = mask_pairs(t, seen);
                    }
                    t_row[k] = t;
                    e += w_tile[c4] * t;
                }
                for (var k = 0u; k < LANE_DV; k++) {
                    dp += g[k] * v_tile[q * DVS + lane + LANES * k];
                }
            }
            e = row_sum(e, 0u, lid);
            dp = row_sum(dp, 1u, lid);
            if any_seen {
                // Masked keys (and rows that saw none, lse = -inf) contribute nothing.
                let ds = select(vec4<f32>(0.0), exp(e - lse) * (dp - d_row), seen);
                for (var k = 0u; k < LANE_DA4; k++) {
                    let t = t_row[k];
                    da[k] += dtanh_rows(t, ds);
                    dw[k] += t * ds;
                }
            }
        }
    }

    // Padded rows get zero gradients (the bias and score vector sums read every row).
    if i >= params.q_seq {
        return;
    }
    let base = view_index(VIEW_DQ, b, i, h);
    let rows_base = ws_dw() + ((h * params.batch + b) * params.q_seq + i) * DA;
    for (var k = 0u; k < LANE_DA4; k++) {
        let c4 = lane + LANES * k;
        let da4 = w_tile[c4] * da[k];
        let dw4 = params.scale * dw[k];
        for (var kk = 0u; kk < 4u; kk++) {
            let c = 4u * c4 + kk;
            if c < DA {
                var x = da4[kk];
                var y = dw4[kk];
                if params.accumulate != 0u {
                    x += da_buf[base + c];
                    y += workspace[rows_base + c];
                }
                da_buf[base + c] = x;
                workspace[rows_base + c] = y;
            }
        }
    }
    if lane == 0u {
        workspace[row] = d_row;
    }
}
