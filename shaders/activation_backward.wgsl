// Elementwise activation backward (SPEC.md): dx = dy * f'(x), f' from activation_common.wgsl
// (prepended by the host), ACTIVATION one of its codes.

struct Params {
    len: u32,
    grid_x: u32,
}

override WG: u32 = 64u;
override ACTIVATION: u32 = ACT_RELU;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> dy: array<f32>;
@group(0) @binding(3) var<storage, read_write> dx: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.len {
        return;
    }
    dx[i] = dy[i] * activation_derivative(ACTIVATION, x[i]);
}
