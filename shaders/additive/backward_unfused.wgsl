// Unfused additive attention backward, its last step (after attention/common.wgsl): from the
// materialised dS = dL/de [B, H, Lq, Lk] (attention/unfused/softmax_backward.wgsl over P and dP = dO V^T),
// the projections' gradients, each t = tanh(a_i + b_j + bias) recomputed per pair (with the clamp of
// attention/common.wgsl's capped_tanh):
//   QUERY_SIDE:  da_ic = scale w_c sum_j dS_ij (1 - t_ijc^2),   dw_rows[h, b, i, c] = scale sum_j dS_ij t_ijc
//   key side:    db_jc = scale w_c sum_i dS_ij (1 - t_ijc^2)
// Masked pairs have dS = 0 (P = 0 there), so no mask is applied here. One invocation per
// (b, row, h, c); its loop runs over the other side's rows [chunk_begin, chunk_end), and later
// dispatches (accumulate = 1) add to what earlier ones wrote.

override WG: u32 = 64u;
override QUERY_SIDE: bool = true;

@group(0) @binding(2) var<storage, read> a_buf: array<f32>;
@group(0) @binding(3) var<storage, read> b_buf: array<f32>;
@group(0) @binding(4) var<storage, read> w_buf: array<f32>;
@group(0) @binding(5) var<storage, read> bias_buf: array<f32>;
@group(0) @binding(6) var<storage, read> ds_buf: array<f32>;
// da (VIEW_DQ) on the query side, db (VIEW_DK) on the key side.
@group(0) @binding(7) var<storage, read_write> grad_buf: array<f32>;
// [H, B, Lq, Da] (query side; a dummy on the key side).
@group(0) @binding(8) var<storage, read_write> dw_rows: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let da = params.dk;
    var rows = params.kv_seq;
    if QUERY_SIDE {
        rows = params.q_seq;
    }
    let index = linear_group(wg) * WG + lid;
    if index >= params.batch * rows * params.heads * da {
        return;
    }
    let c = index % da;
    let h = (index / da) % params.heads;
    let r = (index / (da * params.heads)) % rows;
    let b = index / (da * params.heads * rows);
    let bias = bias_buf[h * da + c];
    var x = 0.0;
    if QUERY_SIDE {
        x = a_buf[view_index(VIEW_Q, b, r, h) + c] + bias;
    } else {
        x = b_buf[view_index(VIEW_K, b, r, h) + c];
    }
    let ds_base = (b * params.heads + h) * params.q_seq * params.kv_seq;
    var g = 0.0;
    var gt = 0.0;
    for (var o = params.chunk_begin; o < params.chunk_end; o++) {
        var y = 0.0;
        var d = 0.0;
        if QUERY_SIDE {
            y = b_buf[view_index(VIEW_K, b, o, h) + c];
            d = ds_buf[ds_base + r * params.kv_seq + o];
        } else {
            y = a_buf[view_index(VIEW_Q, b, o, h) + c] + bias;
            d = ds_buf[ds_base + o * params.kv_seq + r];
        }
        let t = tanh(clamp(x + y, -15.0, 15.0));
        g += d * (1.0 - t * t);
        gt += d * t;
    }
    g *= params.scale * w_buf[h * da + c];
    var at = 0u;
    if QUERY_SIDE {
        at = view_index(VIEW_DQ, b, r, h) + c;
        let share = ((h * params.batch + b) * params.q_seq + r) * da + c;
        gt *= params.scale;
        if params.accumulate != 0u {
            gt += dw_rows[share];
        }
        dw_rows[share] = gt;
    } else {
        at = view_index(VIEW_DK, b, r, h) + c;
    }
    if params.accumulate != 0u {
        g += grad_buf[at];
    }
    grad_buf[at] = g;
}
