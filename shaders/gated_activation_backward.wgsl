// Gated activation backward (SPEC.md): for y = f(gate) * up (gated_activation_forward.wgsl),
//   d_gate = dy * up * f'(gate),   d_up = dy * f(gate),
// written into `d_gate_up [rows, 2 F]` laid out as `gate_up`. One invocation per (row, j).

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
@group(0) @binding(2) var<storage, read> dy: array<f32>;
@group(0) @binding(3) var<storage, read_write> d_gate_up: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.rows * params.width {
        return;
    }
    let gate = (i / params.width) * 2u * params.width + i % params.width;
    let g = gate_up[gate];
    let up = gate_up[gate + params.width];
    d_gate_up[gate] = dy[i] * up * activation_derivative(ACTIVATION, g);
    d_gate_up[gate + params.width] = dy[i] * activation_value(ACTIVATION, g);
}
