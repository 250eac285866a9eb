//! Activations (ReLU, tanh-GELU, SiLU), gated activations (SwiGLU, GeGLU) forward and backward and
//! the residual sum on the GPU vs the f64 reference, whose derivatives are checked by finite
//! differences.

use crate::common;

use common::*;
use wgpu_attention::kernels::elementwise::{
    activation_backward, activation_forward, add, gated_activation_backward_into,
    gated_activation_forward_into, Activation,
};
use wgpu_attention::reference::elementwise as reference;
use wgpu_attention::{Error, GpuTensor};

fn inputs(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = rng(seed);
    let mut x = random(&mut rng, n, 6.0);
    // Exact zeros and values where tanh saturates.
    x[0] = 0.0;
    if n > 2 {
        x[1] = 40.0;
        x[2] = -40.0;
    }
    (x, random(&mut rng, n, 1.0))
}

const ACTIVATIONS: [Activation; 3] = [Activation::Relu, Activation::Gelu, Activation::Silu];

#[test]
fn activations_match_reference() {
    for_each_backend(|backend, ctx| {
        for kind in ACTIVATIONS {
            for (i, shape) in [vec![1], vec![7, 9], vec![3, 65, 33]].iter().enumerate() {
                let n = shape.iter().product();
                let (x, dy) = inputs(n, i as u64);
                let xt = GpuTensor::from_slice(ctx, &x, shape).unwrap();
                let dyt = GpuTensor::from_slice(ctx, &dy, shape).unwrap();
                let y = activation_forward(ctx, kind, &xt).unwrap();
                let dx = activation_backward(ctx, kind, &xt, &dyt).unwrap();
                let tag = format!("[{backend}] {kind:?} {shape:?}");
                assert_close(
                    &format!("{tag} y"),
                    &y.to_vec(ctx).unwrap(),
                    &reference::activation_forward(kind, &to_f64(&x)),
                    FORWARD_ATOL,
                    FORWARD_RTOL,
                );
                assert_close(
                    &format!("{tag} dx"),
                    &dx.to_vec(ctx).unwrap(),
                    &reference::activation_backward(kind, &to_f64(&x), &to_f64(&dy)),
                    BACKWARD_ATOL,
                    BACKWARD_RTOL,
                );
            }
        }
    });
}

#[test]
fn residual_sum_matches_reference() {
    for_each_backend(|backend, ctx| {
        let (a, b) = inputs(1000, 3);
        let at = GpuTensor::from_slice(ctx, &a, &[10, 100]).unwrap();
        let bt = GpuTensor::from_slice(ctx, &b, &[10, 100]).unwrap();
        let out = add(ctx, &at, &bt).unwrap();
        assert_close(
            &format!("[{backend}] add"),
            &out.to_vec(ctx).unwrap(),
            &reference::add(&to_f64(&a), &to_f64(&b)),
            0.0,
            1e-7,
        );
        let wrong = GpuTensor::from_slice(ctx, &a, &[1000]).unwrap();
        assert!(matches!(
            add(ctx, &at, &wrong),
            Err(Error::Shape { arg: "b", .. })
        ));
    });
}

#[test]
fn reference_derivatives_match_finite_differences() {
    let x: Vec<f64> = (-40..=40).map(|i| i as f64 * 0.173 + 0.01).collect();
    let ones = vec![1.0; x.len()];
    for kind in ACTIVATIONS {
        let d = reference::activation_backward(kind, &x, &ones);
        let h = 1e-6;
        for (i, &v) in x.iter().enumerate() {
            let f = |v: f64| reference::activation_forward(kind, &[v])[0];
            let fd = (f(v + h) - f(v - h)) / (2.0 * h);
            assert!(
                (fd - d[i]).abs() < 1e-7,
                "{kind:?} at {v}: fd {fd}, analytic {}",
                d[i]
            );
        }
    }
}

/// `act(gate) * up` over rows of `[gate | up]`, and its gradient at both halves.
#[test]
fn gated_activations_match_reference() {
    for_each_backend(|backend, ctx| {
        for kind in [Activation::Silu, Activation::Gelu] {
            for (i, (rows, width)) in [(1, 1), (5, 7), (33, 48)].into_iter().enumerate() {
                let (gate_up, _) = inputs(rows * 2 * width, 10 + i as u64);
                let (dy, _) = inputs(rows * width, 20 + i as u64);
                let gu = GpuTensor::from_slice(ctx, &gate_up, &[rows, 2 * width]).unwrap();
                let dyt = GpuTensor::from_slice(ctx, &dy, &[rows, width]).unwrap();
                let y = GpuTensor::zeros(ctx, &[rows, width]).unwrap();
                let dgu = GpuTensor::zeros(ctx, &[rows, 2 * width]).unwrap();
                let mut encoder = ctx.device().create_command_encoder(&Default::default());
                gated_activation_forward_into(ctx, &mut encoder, kind, &gu, &y).unwrap();
                gated_activation_backward_into(ctx, &mut encoder, kind, &gu, &dyt, &dgu).unwrap();
                ctx.queue().submit([encoder.finish()]);
                let tag = format!("[{backend}] gated {kind:?} [{rows}, 2 x {width}]");
                let (g64, dy64) = (to_f64(&gate_up), to_f64(&dy));
                assert_close(
                    &format!("{tag} y"),
                    &y.to_vec(ctx).unwrap(),
                    &reference::gated_activation_forward(kind, &g64, width),
                    FORWARD_ATOL,
                    FORWARD_RTOL,
                );
                assert_close(
                    &format!("{tag} d_gate_up"),
                    &dgu.to_vec(ctx).unwrap(),
                    &reference::gated_activation_backward(kind, &g64, &dy64, width),
                    BACKWARD_ATOL,
                    BACKWARD_RTOL,
                );
            }
        }
        // An odd last dim has no gate/up split; a y of the wrong width is refused.
        let odd = GpuTensor::zeros(ctx, &[2, 5]).unwrap();
        let y = GpuTensor::zeros(ctx, &[2, 2]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let err = gated_activation_forward_into(ctx, &mut encoder, Activation::Silu, &odd, &y);
        assert!(
            matches!(err, Err(Error::Shape { arg: "gate_up", .. })),
            "{err:?}"
        );
        let gu = GpuTensor::zeros(ctx, &[2, 6]).unwrap();
        let err = gated_activation_forward_into(ctx, &mut encoder, Activation::Silu, &gu, &y);
        assert!(matches!(err, Err(Error::Shape { arg: "y", .. })), "{err:?}");
    });
}

#[test]
fn reference_gated_backward_matches_finite_differences() {
    let width = 3;
    let gu: Vec<f64> = (0..2 * 2 * width).map(|i| i as f64 * 0.37 - 2.0).collect();
    let dy: Vec<f64> = (0..2 * width).map(|i| 1.0 - i as f64 * 0.21).collect();
    for kind in [Activation::Silu, Activation::Gelu] {
        let g = reference::gated_activation_backward(kind, &gu, &dy, width);
        let loss = |v: &[f64]| -> f64 {
            reference::gated_activation_forward(kind, v, width)
                .iter()
                .zip(&dy)
                .map(|(a, b)| a * b)
                .sum()
        };
        for i in 0..gu.len() {
            let h = 1e-6;
            let (mut p, mut m) = (gu.clone(), gu.clone());
            p[i] += h;
            m[i] -= h;
            let fd = (loss(&p) - loss(&m)) / (2.0 * h);
            assert!(
                (fd - g[i]).abs() < 1e-7,
                "{kind:?} [{i}]: fd {fd}, analytic {}",
                g[i]
            );
        }
    }
}
