//! LayerNorm and RMSNorm forward and backward on the GPU vs the f64 reference (itself checked by finite
//! differences here), on every back end under test and both kernel families (a row per invocation,
//! a row per workgroup); the residual sum of the backward; the split column reduction; typed errors.

use crate::common;

use common::*;
use wgpu_attention::kernels::layer_norm::{
    layer_norm_backward, layer_norm_backward_add_into, layer_norm_forward,
    rms_norm_backward_add_into, rms_norm_forward_into,
};
use wgpu_attention::reference::layer_norm as reference;
use wgpu_attention::{Context, Error, GpuTensor};

const EPS: f32 = 1e-5;

struct Data {
    shape: Vec<usize>,
    x: Vec<f32>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
    dy: Vec<f32>,
}

fn data(shape: &[usize], offset: f32, seed: u64) -> Data {
    let mut rng = rng(seed);
    let n: usize = shape.iter().product();
    let cols = *shape.last().unwrap();
    Data {
        shape: shape.to_vec(),
        x: random(&mut rng, n, 1.0)
            .iter()
            .map(|v| v + offset)
            .collect(),
        gamma: random(&mut rng, cols, 1.0)
            .iter()
            .map(|v| v + 1.0)
            .collect(),
        beta: random(&mut rng, cols, 0.5),
        dy: random(&mut rng, n, 1.0),
    }
}

fn check(backend: &str, ctx: &Context, d: &Data) {
    let cols = *d.shape.last().unwrap();
    let up = |v: &[f32], shape: &[usize]| GpuTensor::from_slice(ctx, v, shape).unwrap();
    let (x, gamma, beta, dy) = (
        up(&d.x, &d.shape),
        up(&d.gamma, &[cols]),
        up(&d.beta, &[cols]),
        up(&d.dy, &d.shape),
    );
    let fwd = layer_norm_forward(ctx, &x, &gamma, &beta, EPS).unwrap();
    let grads = layer_norm_backward(ctx, &x, &gamma, &fwd.stats, &dy).unwrap();
    // Deterministic: a second run gives the same bits (both families sum in a fixed order).
    let again = layer_norm_backward(ctx, &x, &gamma, &fwd.stats, &dy).unwrap();
    for (name, a, b) in [
        ("dx", &grads.dx, &again.dx),
        ("d_gamma", &grads.d_gamma, &again.d_gamma),
        ("d_beta", &grads.d_beta, &again.d_beta),
    ] {
        let bits = |t: &GpuTensor| -> Vec<u32> {
            t.to_vec(ctx).unwrap().iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(
            bits(a),
            bits(b),
            "[{backend}] {name} of {:?} not deterministic",
            d.shape
        );
    }
    let (ry, rstats) = reference::layer_norm_forward(
        &to_f64(&d.x),
        &to_f64(&d.gamma),
        &to_f64(&d.beta),
        cols,
        EPS as f64,
    );
    let rg = reference::layer_norm_backward(
        &to_f64(&d.x),
        &to_f64(&d.gamma),
        &to_f64(&d.dy),
        cols,
        EPS as f64,
    );
    let tag = format!("[{backend}] layer_norm {:?}", d.shape);
    let flat_stats: Vec<f64> = rstats.iter().flat_map(|&(m, r)| [m, r]).collect();
    assert_close(
        &format!("{tag} y"),
        &fwd.y.to_vec(ctx).unwrap(),
        &ry,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    assert_close(
        &format!("{tag} stats"),
        &fwd.stats.to_vec(ctx).unwrap(),
        &flat_stats,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    // dx + residual in the same kernel: the residual is dy itself here, as in a pre-LN block.
    let dx_add = GpuTensor::zeros(ctx, &d.shape).unwrap();
    let (dg, db) = (
        GpuTensor::zeros(ctx, &[cols]).unwrap(),
        GpuTensor::zeros(ctx, &[cols]).unwrap(),
    );
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    let stats = &fwd.stats;
    let outs = [&dx_add, &dg, &db];
    layer_norm_backward_add_into(ctx, &mut encoder, &x, &gamma, stats, (&dy, Some(&dy)), outs)
        .unwrap();
    ctx.queue().submit([encoder.finish()]);
    let rdx_add: Vec<f64> = rg
        .dx
        .iter()
        .zip(&d.dy)
        .map(|(a, &b)| a + b as f64)
        .collect();
    for (name, gpu, r) in [
        ("dx", &grads.dx, &rg.dx),
        ("d_gamma", &grads.d_gamma, &rg.d_gamma),
        ("d_beta", &grads.d_beta, &rg.d_beta),
        ("dx + residual", &dx_add, &rdx_add),
    ] {
        assert_close(
            &format!("{tag} {name}"),
            &gpu.to_vec(ctx).unwrap(),
            r,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
    }
}

fn shapes() -> Vec<Vec<usize>> {
    vec![
        vec![1, 1],
        vec![7, 5],
        vec![33, 32],
        vec![3, 17, 100],
        vec![130, 64],
        vec![2, 3, 257],
    ]
}

#[test]
fn matches_reference_over_odd_shapes() {
    for_each_family(|backend, ctx| {
        for (i, shape) in shapes().iter().enumerate() {
            check(backend, ctx, &data(shape, 0.0, i as u64));
        }
    });
}

#[test]
fn large_mean_small_variance_is_exact() {
    // The centred two-pass variance keeps full precision where E[x^2] - mean^2 would cancel.
    for_each_family(|backend, ctx| {
        check(backend, ctx, &data(&[9, 48], 100.0, 7));
    });
}

#[test]
fn column_sums_split_into_accumulated_dispatches() {
    // 200 rows: 25 dispatches of 8 rows in the CPU-driver family, 7 blocks of partial sums added in
    // two dispatches in the GPU family.
    for_each_family_with_loop_budget(24, |backend, ctx| {
        check(backend, ctx, &data(&[200, 5], 0.0, 11));
    });
}

#[test]
fn reference_backward_matches_finite_differences() {
    let d = data(&[3, 6], 0.3, 5);
    let cols = 6;
    let (x, gamma, beta, dy) = (
        to_f64(&d.x),
        to_f64(&d.gamma),
        to_f64(&d.beta),
        to_f64(&d.dy),
    );
    let loss = |x: &[f64], gamma: &[f64], beta: &[f64]| {
        let (y, _) = reference::layer_norm_forward(x, gamma, beta, cols, 1e-5);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>()
    };
    let g = reference::layer_norm_backward(&x, &gamma, &dy, cols, 1e-5);
    let h = 1e-6;
    let mut worst = 0.0f64;
    for which in 0..3 {
        let n = [x.len(), cols, cols][which];
        for i in 0..n {
            let (mut xp, mut gp, mut bp) = (x.clone(), gamma.clone(), beta.clone());
            let (mut xm, mut gm, mut bm) = (x.clone(), gamma.clone(), beta.clone());
            match which {
                0 => (xp[i] += h, xm[i] -= h),
                1 => (gp[i] += h, gm[i] -= h),
                _ => (bp[i] += h, bm[i] -= h),
            };
            let fd = (loss(&xp, &gp, &bp) - loss(&xm, &gm, &bm)) / (2.0 * h);
            let analytic = [&g.dx, &g.d_gamma, &g.d_beta][which][i];
            let err = (fd - analytic).abs();
            worst = worst.max(err);
            assert!(
                err < 1e-6,
                "component {which} index {i}: fd {fd}, analytic {analytic}"
            );
        }
    }
    eprintln!("layer_norm reference vs finite differences: worst {worst:.2e}");
}

#[test]
fn bad_input_is_a_typed_error() {
    for_each_backend(|_, ctx| {
        let x = GpuTensor::zeros(ctx, &[4, 8]).unwrap();
        let gamma = GpuTensor::zeros(ctx, &[8]).unwrap();
        let wrong = GpuTensor::zeros(ctx, &[7]).unwrap();
        let empty = GpuTensor::zeros(ctx, &[4, 0]).unwrap_or_else(|_| x.clone());
        assert!(matches!(
            layer_norm_forward(ctx, &x, &wrong, &gamma, EPS),
            Err(Error::Shape { arg: "gamma", .. })
        ));
        assert!(matches!(
            layer_norm_forward(ctx, &x, &gamma, &gamma, f32::NAN),
            Err(Error::Shape { arg: "eps", .. })
        ));
        if empty.is_empty() {
            assert!(matches!(
                layer_norm_forward(ctx, &empty, &gamma, &gamma, EPS),
                Err(Error::Shape { arg: "x", .. })
            ));
        }
        let fwd = layer_norm_forward(ctx, &x, &gamma, &gamma, EPS).unwrap();
        assert!(matches!(
            layer_norm_backward(ctx, &x, &gamma, &fwd.stats, &wrong),
            Err(Error::Shape { arg: "dy", .. })
        ));
    });
}

/// RMSNorm (the same kernels, uncentred): y, the saved (0, rstd), dx with and without the residual,
/// and d_gamma, over odd shapes and an offset input (which RMSNorm does not remove).
#[test]
fn rms_norm_matches_reference() {
    for_each_family(|backend, ctx| {
        for (i, shape) in shapes().into_iter().enumerate() {
            let d = data(&shape, if i % 2 == 0 { 0.0 } else { 3.0 }, 40 + i as u64);
            let cols = *shape.last().unwrap();
            let rows = d.x.len() / cols;
            let up = |v: &[f32], shape: &[usize]| GpuTensor::from_slice(ctx, v, shape).unwrap();
            let (x, gamma, dy) = (up(&d.x, &shape), up(&d.gamma, &[cols]), up(&d.dy, &shape));
            let y = GpuTensor::zeros(ctx, &shape).unwrap();
            let stats = GpuTensor::zeros(ctx, &[rows, 2]).unwrap();
            let (dx, dx_add, dg) = (
                GpuTensor::zeros(ctx, &shape).unwrap(),
                GpuTensor::zeros(ctx, &shape).unwrap(),
                GpuTensor::zeros(ctx, &[cols]).unwrap(),
            );
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            rms_norm_forward_into(ctx, &mut encoder, &x, &gamma, EPS, [&y, &stats]).unwrap();
            rms_norm_backward_add_into(
                ctx,
                &mut encoder,
                &x,
                &gamma,
                &stats,
                (&dy, None),
                [&dx, &dg],
            )
            .unwrap();
            let dg2 = GpuTensor::zeros(ctx, &[cols]).unwrap();
            rms_norm_backward_add_into(
                ctx,
                &mut encoder,
                &x,
                &gamma,
                &stats,
                (&dy, Some(&dy)),
                [&dx_add, &dg2],
            )
            .unwrap();
            ctx.queue().submit([encoder.finish()]);
            let (x64, g64, dy64) = (to_f64(&d.x), to_f64(&d.gamma), to_f64(&d.dy));
            let ry = reference::rms_norm_forward(&x64, &g64, cols, EPS as f64);
            let (rdx, rdg) = reference::rms_norm_backward(&x64, &g64, &dy64, cols, EPS as f64);
            let rdx_add: Vec<f64> = rdx.iter().zip(&dy64).map(|(a, b)| a + b).collect();
            let tag = format!("[{backend}] rms_norm {shape:?}");
            let y_gpu = y.to_vec(ctx).unwrap();
            assert_close(&format!("{tag} y"), &y_gpu, &ry, FORWARD_ATOL, FORWARD_RTOL);
            let means: Vec<f32> = stats
                .to_vec(ctx)
                .unwrap()
                .iter()
                .step_by(2)
                .copied()
                .collect();
            assert!(
                means.iter().all(|&m| m == 0.0),
                "{tag}: RMSNorm saves mean 0"
            );
            for (name, gpu, r) in [
                ("dx", &dx, &rdx),
                ("dx + residual", &dx_add, &rdx_add),
                ("d_gamma", &dg, &rdg),
                ("d_gamma (second call)", &dg2, &rdg),
            ] {
                let got = gpu.to_vec(ctx).unwrap();
                assert_close(
                    &format!("{tag} {name}"),
                    &got,
                    r,
                    BACKWARD_ATOL,
                    BACKWARD_RTOL,
                );
            }
        }
    });
}

#[test]
fn reference_rms_norm_backward_matches_finite_differences() {
    let cols = 5;
    let d = data(&[3, cols], 0.7, 9);
    let (x, gamma, dy) = (to_f64(&d.x), to_f64(&d.gamma), to_f64(&d.dy));
    let loss = |x: &[f64], gamma: &[f64]| -> f64 {
        let y = reference::rms_norm_forward(x, gamma, cols, 1e-5);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum()
    };
    let (dx, dg) = reference::rms_norm_backward(&x, &gamma, &dy, cols, 1e-5);
    let h = 1e-6;
    for i in 0..x.len() {
        let (mut p, mut m) = (x.clone(), x.clone());
        p[i] += h;
        m[i] -= h;
        let fd = (loss(&p, &gamma) - loss(&m, &gamma)) / (2.0 * h);
        assert!(
            (fd - dx[i]).abs() < 1e-7,
            "dx[{i}]: fd {fd}, analytic {}",
            dx[i]
        );
    }
    for i in 0..cols {
        let (mut p, mut m) = (gamma.clone(), gamma.clone());
        p[i] += h;
        m[i] -= h;
        let fd = (loss(&x, &p) - loss(&x, &m)) / (2.0 * h);
        assert!(
            (fd - dg[i]).abs() < 1e-7,
            "d_gamma[{i}]: fd {fd}, analytic {}",
            dg[i]
        );
    }
}
