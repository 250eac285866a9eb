// Unfused attention baseline, backward through the row softmax, in place on dP [B, H, Lq, Lk]:
//   dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik)
// (the row sum equals D_i = dO_i . O_i). Masked entries have P = 0 and so dS = 0.
// One workgroup per row; a tree reduction for the row sum.

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read> probs: array<f32>;
@group(0) @binding(3) var<storage, read_write> dprobs: array<f32>;

var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wg);
    if row >= params.total_groups {
        return;
    }
    let base = row * params.kv_seq;
    var sum = 0.0;
    for (var j = lid; j < params.kv_seq; j += WG) {
        sum += probs[base + j] * dprobs[base + j];
    }
    red[lid] = sum;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if lid < s {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let delta = red[0];
    for (var j = lid; j < params.kv_seq; j += WG) {
        dprobs[base + j] = probs[base + j] * (dprobs[base + j] - delta);
    }
}
