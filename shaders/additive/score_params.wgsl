// The score vector w and the bias, [H, Da] each, of the forward kernels. The backward's kernels
// take their workspace instead, which holds copies of both (additive/backward_workspace.wgsl): one
// binding for the two, so that each of them binds 8 storage buffers, WebGPU's default limit.
@group(0) @binding(5) var<storage, read> w_buf: array<f32>;
@group(0) @binding(6) var<storage, read> bias_buf: array<f32>;

fn additive_w(index: u32) -> f32 {
    return w_buf[index];
}

fn additive_bias(index: u32) -> f32 {
    return bias_buf[index];
}
