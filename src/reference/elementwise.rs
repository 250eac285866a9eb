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
            Activation::Silu => v / (1.0 + (-v).exp()),
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
                Activation::Silu => {
                    let s = 1.0 / (1.0 + (-v).exp());
                    s + v * s * (1.0 - s)
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

/// `act(gate) * up` per row of `gate_up [rows, 2 width]` (gate then up): `[rows, width]`.
pub fn gated_activation_forward(kind: Activation, gate_up: &[f64], width: usize) -> Vec<f64> {
    gate_up
        .chunks(2 * width)
        .flat_map(|row| {
            let (gate, up) = row.split_at(width);
            activation_forward(kind, gate)
                .into_iter()
                .zip(up)
                .map(|(a, u)| a * u)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The gradient at `gate_up` of [`gated_activation_forward`] for `dy [rows, width]`.
pub fn gated_activation_backward(
    kind: Activation,
    gate_up: &[f64],
    dy: &[f64],
    width: usize,
) -> Vec<f64> {
    gate_up
        .chunks(2 * width)
        .zip(dy.chunks(width))
        .flat_map(|(row, dyr)| {
            let (gate, up) = row.split_at(width);
            let dy_up: Vec<f64> = dyr.iter().zip(up).map(|(g, u)| g * u).collect();
            let d_gate = activation_backward(kind, gate, &dy_up);
            let act = activation_forward(kind, gate);
            let d_up = dyr.iter().zip(act).map(|(g, a)| g * a);
            d_gate.into_iter().chain(d_up).collect::<Vec<_>>()
        })
        .collect()
}
