// Elementwise activation backward (SPEC.md): dx = dy * f'(x). ReLU'(0) = 0. For the tanh GELU,
//   f'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),  t = tanh(u).

struct Params {
    len: u32,
    grid_x: u32,
}

override WG: u32 = 64u;
override ACTIVATION: u32 = 0u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> dy: array<f32>;
@group(0) @binding(3) var<storage, read_write> dx: array<f32>;

const SQRT_2_OVER_PI: f32 = 0.7978845608028654;

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
    var d = 0.0;
    if ACTIVATION == 0u {
        d = select(0.0, 1.0, v > 0.0);
    } else {
        let t = tanh_stable(SQRT_2_OVER_PI * (v + 0.044715 * v * v * v));
        d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * v * v);
    }
    dx[i] = dy[i] * d;
}
