// The unfused additive attention baseline's scores: every
//   e_ij = scale * sum_c w[h, c] tanh(a[b, i, h, c] + b[b, j, h, c] + bias[h, c])
// materialised as [B, H, Lq, Lk] (masks are left to attention_softmax.wgsl). One invocation per score.

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read> a_buf: array<f32>;
@group(0) @binding(3) var<storage, read> b_buf: array<f32>;
@group(0) @binding(4) var<storage, read> w_buf: array<f32>;
@group(0) @binding(5) var<storage, read> bias_buf: array<f32>;
@group(0) @binding(6) var<storage, read_write> scores: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let index = linear_group(wg) * WG + lid;
    if index >= params.batch * params.heads * params.q_seq * params.kv_seq {
        return;
    }
    let j = index % params.kv_seq;
    let i = (index / params.kv_seq) % params.q_seq;
    let bh = index / (params.kv_seq * params.q_seq);
    let b = bh / params.heads;
    let h = bh % params.heads;
    let ai = view_index(VIEW_Q, b, i, h);
    let bj = view_index(VIEW_K, b, j, h);
    var e = 0.0;
    for (var c = 0u; c < params.dk; c++) {
        let x = a_buf[ai + c] + b_buf[bj + c] + bias_buf[h * params.dk + c];
        e += w_buf[h * params.dk + c] * tanh(clamp(x, -15.0, 15.0));
    }
    scores[index] = params.scale * e;
}
