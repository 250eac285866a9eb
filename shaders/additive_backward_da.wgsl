// Fused additive attention backward, query side (after attention_common.wgsl and
// additive_common.wgsl): for each query row i, with D_i = dO_i . O_i and, over its visible keys j
// (recomputed: t = tanh(a_i + b_j + bias), e = scale w . t, p = exp(e - lse_i)),
//   ds_ij = p (dO_i . v_j - D_i),   da_i += ds_ij * scale w (1 - t^2),   dw_i += ds_ij * scale t
// da_i is written to VIEW_DQ; the per-row shares dw_i to dw_rows [H, B, Lq, Da] and D_i to
// d_rows [B, H, Lq] (the key-side kernel reads D; additive_param_grads sums the shares, and da for the
// bias, in a fixed order). One invocation per query row, key tiles staged as in the forward; the key
// loop runs over [chunk_begin, chunk_end) and later dispatches (accumulate = 1) add to da and dw_rows.

@group(0) @binding(7) var<storage, read> o_buf: array<f32>;
@group(0) @binding(8) var<storage, read> do_buf: array<f32>;
@group(0) @binding(9) var<storage, read> lse_buf: array<f32>;
@group(0) @binding(10) var<storage, read_write> da_buf: array<f32>;
@group(0) @binding(11) var<storage, read_write> dw_rows: array<f32>;
@group(0) @binding(12) var<storage, read_write> d_rows: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    let block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let row0 = block * WG;
    let i = row0 + lid;
    let live = i < qlen;
    let row = (b * params.heads + h) * params.q_seq + i;

    var own: array<f32, MAX_DA>;
    var g: array<f32, MAX_DV>;
    var da: array<f32, MAX_DA>;
    var dw: array<f32, MAX_DA>;
    var d_row = 0.0;
    var lse = neg_inf();
    for (var c = 0u; c < DA; c++) {
        own[c] = 0.0;
        da[c] = 0.0;
        dw[c] = 0.0;
    }
    if live {
        for (var c = 0u; c < DA; c++) {
            own[c] = a_rows[view_index(VIEW_Q, b, i, h) + c] + bias_buf[h * DA + c];
        }
        for (var d = 0u; d < DV; d++) {
            g[d] = do_buf[view_index(VIEW_DO, b, i, h) + d];
            d_row += g[d] * o_buf[view_index(VIEW_O, b, i, h) + d];
        }
        lse = lse_buf[row];
    }
    stage_w(h, lid);
    var start = 0u;
    var end = 0u;
    if live && lse > NEG_BIG {
        start = key_start(i);
        end = key_end(i, kvlen);
    }

    let rows_hi = min(row0 + WG, qlen);
    var kv_hi = 0u;
    if rows_hi > row0 {
        kv_hi = min(key_end(rows_hi - 1u, kvlen), params.chunk_end);
    }
    let n_begin = max(params.chunk_begin, key_start(row0) / TILE * TILE);
    for (var n0 = n_begin; n0 < kv_hi; n0 += TILE) {
        workgroupBarrier();
        stage_keys(n0, kv_hi, b, h, lid);
        workgroupBarrier();
        // Four keys at a time: each own[c], w[c], da[c] and dw[c] access serves all four.
        for (var jj = 0u; jj < TILE; jj += 4u) {
            let j = vec4<u32>(n0 + jj) + vec4<u32>(0u, 1u, 2u, 3u);
            let seen = (j >= vec4<u32>(start)) & (j < vec4<u32>(end)) & (j < vec4<u32>(kv_hi));
            if !any(seen) {
                continue;
            }
            // Each tanh once: kept for the derivative pass below.
            var t_row: array<vec4<f32>, MAX_DA>;
            var e = vec4<f32>(0.0);
            for (var c = 0u; c < DA; c++) {
                let t = tanh4(own[c], jj, c);
                t_row[c] = t;
                e += w_tile[c] * t;
            }
            var dp = vec4<f32>(0.0);
            for (var d = 0u; d < DV; d++) {
                let at = jj * DV + d;
                let v = vec4<f32>(v_tile[at], v_tile[at + DV], v_tile[at + 2u * DV], v_tile[at + 3u * DV]);
                dp += g[d] * v;
            }
            // Masked keys (and rows that saw none, lse = -inf) contribute nothing.
            let ds = select(vec4<f32>(0.0), exp(e - lse) * (dp - d_row), seen);
            for (var c = 0u; c < DA; c++) {
                let t = t_row[c];
                da[c] += dot(ds, w_tile[c] * (1.0 - t * t));
                dw[c] += params.scale * dot(ds, t);
            }
        }
    }

    // Padded rows get zero gradients (the bias and score vector sums read every row).
    if i >= params.q_seq {
        return;
    }
    let base = view_index(VIEW_DQ, b, i, h);
    let rows_base = ((h * params.batch + b) * params.q_seq + i) * DA;
    for (var c = 0u; c < DA; c++) {
        if params.accumulate != 0u {
            da[c] += da_buf[base + c];
            dw[c] += dw_rows[rows_base + c];
        }
        da_buf[base + c] = da[c];
        dw_rows[rows_base + c] = dw[c];
    }
    d_rows[row] = d_row;
}
