// Additive attention backward, first kernel (after attention/common.wgsl and
// additive/backward_workspace.wgsl): copies w, the bias and lse into the workspace, where the
// gradient kernels read them. Copies rather than bindings: each of those kernels then binds 8 storage
// buffers, WebGPU's default limit. One invocation per element.

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read> w_src: array<f32>;
@group(0) @binding(3) var<storage, read> bias_src: array<f32>;
@group(0) @binding(4) var<storage, read> lse_src: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let index = linear_group(wg) * WG + lid;
    if index < params.heads * params.dk {
        workspace[ws_w() + index] = w_src[index];
        workspace[ws_bias() + index] = bias_src[index];
    }
    if index < ws_rows() {
        workspace[ws_lse() + index] = lse_src[index];
    }
}
