//! Elementwise ops (SPEC.md), f64: activations and their derivatives, the residual sum. Ground truth
//! of `shaders/activation_*.wgsl` and `shaders/add.wgsl`.

use crate::spec::Activation;

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// `act(x)` elementwise.
pub fn activation_forward(kind: Activation, x: &[f64]) -> Vec<f64> {
    x.iter()
        .map(|&v| match kind {
            Activation::Relu => v.max(0.0),
            Activation::Gelu => {
                0.5 * v * (1.0 + (SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)).tanh())
            }
        })
        .collect()
}

/// `act'(x) * dy` elementwise.
pub fn activation_backward(kind: Activation, x: &[f64], dy: &[f64]) -> Vec<f64> {
    x.iter()
        .zip(dy)
        .map(|(&v, &g)| {
            let d = match kind {
                Activation::Relu => {
                    if v > 0.0 {
                        1.0
                    } else {
                        0.0
                    }
                }
                Activation::Gelu => {
                    let t = (SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)).tanh();
                    0.5 * (1.0 + t)
                        + 0.5 * v * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * v * v)
                }
            };
            g * d
        })
        .collect()
}

/// `a + b` elementwise.
pub fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}
