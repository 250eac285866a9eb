// Gated activation forward (SPEC.md), the middle of a gated feed-forward block (SwiGLU, GeGLU):
// each row of `gate_up [rows, 2 F]` holds the gate projection then the up projection, and
//   y[r, j] = f(gate[r, j]) * up[r, j],   y [rows, F],
// f from activation_common.wgsl (prepended by the host), ACTIVATION one of its codes.

struct Params {
    rows: u32,
    width: u32,
    grid_x: u32,
    pad: u32,
}

override WG: u32 = 64u;
override ACTIVATION: u32 = ACT_SILU;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> gate_up: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.rows * params.width {
        return;
    }
    let gate = (i / params.width) * 2u * params.width + i % params.width;
    y[i] = activation_value(ACTIVATION, gate_up[gate]) * gate_up[gate + params.width];
}
