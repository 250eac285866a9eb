// Pointwise nonlinearities (SPEC.md), shared by the elementwise activation kernels and the GEMM
// epilogues. Codes: ACT_NONE 0, ACT_RELU 1, ACT_GELU 2 (GELU in its tanh form,
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3),
//   gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),  t = tanh(u)).
// ACT_SILU 3 (silu(x) = x s, s = sigmoid(x); silu'(x) = s (1 + x (1 - s))).
// ReLU'(0) = 0.

const ACT_NONE: u32 = 0u;
const ACT_RELU: u32 = 1u;
const ACT_GELU: u32 = 2u;
const ACT_SILU: u32 = 3u;
const SQRT_2_OVER_PI: f32 = 0.7978845608028654;

// tanh through exp of a non-positive argument: no overflow for large |u| on any back end.
fn tanh_stable(u: f32) -> f32 {
    let e = exp(-2.0 * abs(u));
    return sign(u) * (1.0 - e) / (1.0 + e);
}

// sigmoid through exp of a non-positive argument, as tanh_stable.
fn sigmoid_stable(v: f32) -> f32 {
    let e = exp(-abs(v));
    return select(e / (1.0 + e), 1.0 / (1.0 + e), v >= 0.0);
}

fn activation_value(code: u32, v: f32) -> f32 {
    if code == ACT_RELU {
        return max(v, 0.0);
    }
    if code == ACT_GELU {
        return 0.5 * v * (1.0 + tanh_stable(SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)));
    }
    if code == ACT_SILU {
        return v * sigmoid_stable(v);
    }
    return v;
}

fn activation_derivative(code: u32, v: f32) -> f32 {
    if code == ACT_RELU {
        return select(0.0, 1.0, v > 0.0);
    }
    if code == ACT_GELU {
        let t = tanh_stable(SQRT_2_OVER_PI * (v + 0.044715 * v * v * v));
        return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * v * v);
    }
    if code == ACT_SILU {
        let s = sigmoid_stable(v);
        return s * (1.0 + v * (1.0 - s));
    }
    return 1.0;
}
