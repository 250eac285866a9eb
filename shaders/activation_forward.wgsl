// Elementwise activation forward (SPEC.md): ACTIVATION 0 = ReLU, 1 = GELU in its tanh form,
//   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

struct Params {
    len: u32,
    grid_x: u32,
}

override WG: u32 = 64u;
override ACTIVATION: u32 = 0u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

const SQRT_2_OVER_PI: f32 = 0.7978845608028654;

// tanh through exp of a non-positive argument: no overflow for large |u| on any back end.
fn tanh_stable(u: f32) -> f32 {
    let e = exp(-2.0 * abs(u));
    return sign(u) * (1.0 - e) / (1.0 + e);
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.len {
        return;
    }
    let v = x[i];
    if ACTIVATION == 0u {
        y[i] = max(v, 0.0);
    } else {
        let u = SQRT_2_OVER_PI * (v + 0.044715 * v * v * v);
        y[i] = 0.5 * v * (1.0 + tanh_stable(u));
    }
}
