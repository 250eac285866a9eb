//! Activations (ReLU, tanh-GELU) forward and backward and the residual sum on the GPU vs the f64
//! reference, whose derivatives are checked by finite differences.

mod common;

use common::*;
use wgpu_attention::kernels::elementwise::{
    activation_backward, activation_forward, add, Activation,
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

#[test]
fn activations_match_reference() {
    for_each_backend(|backend, ctx| {
        for kind in [Activation::Relu, Activation::Gelu] {
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
    for kind in [Activation::Relu, Activation::Gelu] {
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
