//! Linear layer `y = x W^T + b` on the GPU vs the f64 reference (checked by finite differences):
//! forward with and without bias, dx, dW, db over odd sizes and a 3-D input; split bias sums; errors.

mod common;

use common::*;
use wgpu_attention::kernels::linear::{linear_backward, linear_forward};
use wgpu_attention::reference::linear as reference;
use wgpu_attention::{Context, Error, GpuTensor};

fn check(backend: &str, ctx: &Context, x_shape: &[usize], out_f: usize, with_bias: bool) {
    let in_f = *x_shape.last().unwrap();
    let rows: usize = x_shape[..x_shape.len() - 1].iter().product();
    let mut rng = rng((rows * 1000 + in_f * 10 + out_f) as u64);
    let x = random(&mut rng, rows * in_f, 1.0);
    let w = random(&mut rng, out_f * in_f, 0.5);
    let b = random(&mut rng, out_f, 0.5);
    let dy = random(&mut rng, rows * out_f, 1.0);
    let mut y_shape = x_shape.to_vec();
    *y_shape.last_mut().unwrap() = out_f;
    let xt = GpuTensor::from_slice(ctx, &x, x_shape).unwrap();
    let wt = GpuTensor::from_slice(ctx, &w, &[out_f, in_f]).unwrap();
    let bt = GpuTensor::from_slice(ctx, &b, &[out_f]).unwrap();
    let dyt = GpuTensor::from_slice(ctx, &dy, &y_shape).unwrap();
    let bias = with_bias.then_some(&bt);
    let y = linear_forward(ctx, &xt, &wt, bias).unwrap();
    assert_eq!(y.shape(), &y_shape[..]);
    let g = linear_backward(ctx, &xt, &wt, &dyt, with_bias).unwrap();
    let b64 = to_f64(&b);
    let ry = reference::linear_forward(
        &to_f64(&x),
        &to_f64(&w),
        with_bias.then_some(&b64[..]),
        in_f,
    );
    let (rdx, rdw, rdb) = reference::linear_backward(&to_f64(&x), &to_f64(&w), &to_f64(&dy), in_f);
    let tag = format!("[{backend}] linear {x_shape:?} -> {out_f} bias {with_bias}");
    assert_close(
        &format!("{tag} y"),
        &y.to_vec(ctx).unwrap(),
        &ry,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    assert_close(
        &format!("{tag} dx"),
        &g.dx.to_vec(ctx).unwrap(),
        &rdx,
        BACKWARD_ATOL,
        BACKWARD_RTOL,
    );
    assert_close(
        &format!("{tag} d_weight"),
        &g.d_weight.to_vec(ctx).unwrap(),
        &rdw,
        BACKWARD_ATOL,
        BACKWARD_RTOL,
    );
    match &g.d_bias {
        Some(db) => {
            assert_close(
                &format!("{tag} d_bias"),
                &db.to_vec(ctx).unwrap(),
                &rdb,
                BACKWARD_ATOL,
                BACKWARD_RTOL,
            );
        }
        None => assert!(!with_bias),
    }
}

#[test]
fn matches_reference_over_odd_sizes() {
    for_each_backend(|backend, ctx| {
        for (x_shape, out_f) in [
            (vec![1, 1], 1),
            (vec![7, 5], 3),
            (vec![33, 64], 17),
            (vec![2, 9, 40], 24),
            (vec![130, 32], 96),
            // A few rows (the SKINNY path), more than 256 elements of the output.
            (vec![3, 40], 300),
        ] {
            for with_bias in [true, false] {
                check(backend, ctx, &x_shape, out_f, with_bias);
            }
        }
    });
}

#[test]
fn long_reductions_split_into_accumulated_dispatches() {
    for_each_backend_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        // 2000 rows > the budget's rows per dispatch: the bias sums and the dW product (k = rows)
        // are both split into accumulating dispatches.
        check(backend, ctx, &[2000, 5], 3, true);
    });
}

#[test]
fn bad_shapes_are_typed_errors() {
    for_each_backend(|_, ctx| {
        let x = GpuTensor::zeros(ctx, &[4, 8]).unwrap();
        let w = GpuTensor::zeros(ctx, &[3, 7]).unwrap();
        assert!(matches!(
            linear_forward(ctx, &x, &w, None),
            Err(Error::Shape { arg: "x", .. })
        ));
        let w = GpuTensor::zeros(ctx, &[3, 8]).unwrap();
        let b = GpuTensor::zeros(ctx, &[4]).unwrap();
        assert!(matches!(
            linear_forward(ctx, &x, &w, Some(&b)),
            Err(Error::Shape { arg: "bias", .. })
        ));
    });
}

#[test]
fn reference_backward_matches_finite_differences() {
    let (rows, in_f, out_f) = (3, 4, 2);
    let x: Vec<f64> = (0..rows * in_f).map(|i| (i as f64 * 0.37).sin()).collect();
    let w: Vec<f64> = (0..out_f * in_f).map(|i| (i as f64 * 0.71).cos()).collect();
    let b = vec![0.1, -0.2];
    let dy: Vec<f64> = (0..rows * out_f).map(|i| (i as f64 * 1.3).sin()).collect();
    let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
        reference::linear_forward(x, w, Some(b), in_f)
            .iter()
            .zip(&dy)
            .map(|(a, g)| a * g)
            .sum()
    };
    let (dx, dw, db) = reference::linear_backward(&x, &w, &dy, in_f);
    let h = 1e-6;
    let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
    for i in 0..x.len() {
        let d = fd(&|e| {
            let mut x2 = x.clone();
            x2[i] += e;
            loss(&x2, &w, &b)
        });
        assert!((d - dx[i]).abs() < 1e-8, "dx[{i}]");
    }
    for i in 0..w.len() {
        let d = fd(&|e| {
            let mut w2 = w.clone();
            w2[i] += e;
            loss(&x, &w2, &b)
        });
        assert!((d - dw[i]).abs() < 1e-8, "dw[{i}]");
    }
    for i in 0..b.len() {
        let d = fd(&|e| {
            let mut b2 = b.clone();
            b2[i] += e;
            loss(&x, &w, &b2)
        });
        assert!((d - db[i]).abs() < 1e-8, "db[{i}]");
    }
}
