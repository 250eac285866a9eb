//! Softmax cross-entropy with an ignore index on the GPU vs the f64 reference (itself checked by
//! finite differences): mean loss, counted rows and d logits; large logits; all rows ignored; the
//! loss-scaled gradient of mixed precision; errors.

use crate::common;

use common::*;
use wgpu_attention::kernels::cross_entropy::{
    cross_entropy_backward, cross_entropy_forward, LossGradient,
};
use wgpu_attention::kernels::loss_scale::{LossScale, LossScaling};
use wgpu_attention::reference::cross_entropy as reference;
use wgpu_attention::{Context, Error, GpuTensor, GpuTokens};

fn run(backend: &str, ctx: &Context, rows: usize, classes: usize, magnitude: f32, targets: &[u32]) {
    let ignore = Some(classes as u32 + 7);
    let mut rng = rng((rows * 31 + classes) as u64);
    let logits = random(&mut rng, rows * classes, magnitude);
    let lt = GpuTensor::from_slice(ctx, &logits, &[rows, classes]).unwrap();
    let tt = GpuTokens::from_slice(ctx, targets, &[rows]).unwrap();
    let fwd = cross_entropy_forward(ctx, &lt, &tt, ignore).unwrap();
    let grad = cross_entropy_backward(ctx, &lt, &tt, ignore, &fwd).unwrap();
    let (loss, counted, rgrad) =
        reference::cross_entropy(&to_f64(&logits), targets, classes, ignore);
    let tag = format!("[{backend}] cross_entropy {rows}x{classes} |logit| {magnitude}");
    assert_close(
        &format!("{tag} loss"),
        &fwd.loss.to_vec(ctx).unwrap(),
        &[loss, counted as f64],
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    assert_close(
        &format!("{tag} d_logits"),
        &grad.to_vec(ctx).unwrap(),
        &rgrad,
        BACKWARD_ATOL,
        BACKWARD_RTOL,
    );
}

#[test]
fn matches_reference_with_padding_rows() {
    for_each_backend(|backend, ctx| {
        for (rows, classes) in [(1, 1), (7, 5), (65, 33), (130, 200)] {
            let ignore = classes as u32 + 7;
            let targets: Vec<u32> = (0..rows)
                .map(|r| {
                    if r % 5 == 3 {
                        ignore
                    } else {
                        ((r * 7) % classes) as u32
                    }
                })
                .collect();
            run(backend, ctx, rows, classes, 3.0, &targets);
        }
        // Large logits: the max-shifted lse stays finite.
        run(backend, ctx, 9, 17, 150.0, &[0, 1, 2, 3, 4, 5, 6, 7, 16]);
        // Every row ignored: loss 0, count 0, zero gradients, no NaN.
        run(backend, ctx, 4, 6, 1.0, &[13, 13, 13, 13]);
    });
}

#[test]
fn targets_out_of_range_are_a_typed_error() {
    for_each_backend(|_, ctx| {
        let logits = GpuTensor::zeros(ctx, &[3, 4]).unwrap();
        let bad = GpuTokens::from_slice(ctx, &[0, 4, 1], &[3]).unwrap();
        assert!(matches!(
            cross_entropy_forward(ctx, &logits, &bad, None),
            Err(Error::Shape { arg: "targets", .. })
        ));
        let short = GpuTokens::from_slice(ctx, &[0, 1], &[2]).unwrap();
        assert!(matches!(
            cross_entropy_forward(ctx, &logits, &short, None),
            Err(Error::Shape { arg: "targets", .. })
        ));
        let ignored = GpuTokens::from_slice(ctx, &[0, 99, 1], &[3]).unwrap();
        assert!(cross_entropy_forward(ctx, &logits, &ignored, Some(99)).is_ok());
    });
}

#[test]
fn reference_gradient_matches_finite_differences() {
    let (rows, classes) = (4, 5);
    let logits: Vec<f64> = (0..rows * classes)
        .map(|i| ((i * 37) % 11) as f64 * 0.3 - 1.2)
        .collect();
    let targets = [1, 9, 4, 0];
    let (_, _, grad) = reference::cross_entropy(&logits, &targets, classes, Some(9));
    let h = 1e-6;
    for i in 0..logits.len() {
        let (mut p, mut m) = (logits.clone(), logits.clone());
        p[i] += h;
        m[i] -= h;
        let fd = (reference::cross_entropy(&p, &targets, classes, Some(9)).0
            - reference::cross_entropy(&m, &targets, classes, Some(9)).0)
            / (2.0 * h);
        assert!(
            (fd - grad[i]).abs() < 1e-8,
            "logit {i}: fd {fd}, analytic {}",
            grad[i]
        );
    }
}

/// Mixed precision's scaled loss gradient: `S` times the unscaled one, bit for bit (S a power of
/// two), with the scale read from the GPU state when the kernel runs.
#[test]
fn scaled_gradient_is_the_scale_times_the_gradient() {
    for_each_backend(|backend, ctx| {
        let (rows, classes) = (9, 13);
        let targets: Vec<u32> = (0..rows).map(|r| (r * 5 % classes) as u32).collect();
        let logits = random(&mut rng(3), rows * classes, 2.0);
        let lt = GpuTensor::from_slice(ctx, &logits, &[rows, classes]).unwrap();
        let tt = GpuTokens::from_slice(ctx, &targets, &[rows]).unwrap();
        let fwd = cross_entropy_forward(ctx, &lt, &tt, None).unwrap();
        let plain = cross_entropy_backward(ctx, &lt, &tt, None, &fwd)
            .unwrap()
            .to_vec(ctx)
            .unwrap();
        let scale = LossScale::new(ctx, LossScaling::default().initial_scale(4096.0)).unwrap();
        let scaled = GpuTensor::zeros(ctx, &[rows, classes]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        LossGradient::new(&lt, &tt, None, &fwd)
            .scaled(Some(&scale))
            .record(ctx, &mut encoder, &scaled)
            .unwrap();
        ctx.submit(encoder).unwrap();
        let want: Vec<u32> = plain.iter().map(|g| (g * 4096.0).to_bits()).collect();
        let got: Vec<u32> = scaled
            .to_vec(ctx)
            .unwrap()
            .iter()
            .map(|g| g.to_bits())
            .collect();
        assert_eq!(got, want, "[{backend}]");
    });
}
