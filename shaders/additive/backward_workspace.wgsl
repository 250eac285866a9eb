// The additive backward's workspace (its kernels take it instead of additive/score_params.wgsl): one storage buffer, so that each kernel binds 8, WebGPU's default limit. Laid out as
//   D [B, H, Lq] (padded to a multiple of 64 values) | dw shares [H, B, Lq, Da] | w [H, Da] |
//   bias [H, Da] | lse [B, H, Lq]
// additive/backward_pack.wgsl copies w, the bias and lse in; the query-side kernel writes D and the
// shares, which the key side and additive/param_grads.wgsl read.
@group(0) @binding(5) var<storage, read_write> workspace: array<f32>;

fn ws_rows() -> u32 {
    return params.batch * params.heads * params.q_seq;
}

fn ws_dw() -> u32 {
    return (ws_rows() + 63u) / 64u * 64u;
}

fn ws_w() -> u32 {
    return ws_dw() + ws_rows() * params.dk;
}

fn ws_bias() -> u32 {
    return ws_w() + params.heads * params.dk;
}

fn ws_lse() -> u32 {
    return ws_bias() + params.heads * params.dk;
}

fn additive_w(index: u32) -> f32 {
    return workspace[ws_w() + index];
}

fn additive_bias(index: u32) -> f32 {
    return workspace[ws_bias() + index];
}
