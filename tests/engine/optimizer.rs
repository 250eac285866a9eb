//! AdamW (bias correction, decoupled weight decay, global-norm clipping) on the GPU vs the f64
//! reference over several steps: parameters, both moments and the gradient norm; typed errors.
//! Parameters packed in one arena (`wgpu-attention-transformer`'s `Params`) are tested with it.

use crate::common;

use common::*;
use wgpu_attention::kernels::loss_scale::{LossScaleState, LossScaling};
use wgpu_attention::kernels::optimizer::{AdamW, AdamWConfig};
use wgpu_attention::reference::optimizer as reference;
use wgpu_attention::tensor::TENSOR_ALIGN;
use wgpu_attention::{Error, GpuTensor};

#[test]
fn steps_match_reference_with_and_without_clipping() {
    for_each_backend(|backend, ctx| {
        for max_grad_norm in [None, Some(0.5)] {
            let config = AdamWConfig::default()
                .lr(0.01)
                .weight_decay(0.1)
                .max_grad_norm(max_grad_norm);
            let shapes = [vec![5], vec![7, 3], vec![2, 300]];
            let mut rng = rng(42);
            let mut host: Vec<Vec<f64>> = Vec::new();
            let mut params = Vec::new();
            for s in &shapes {
                let p = random(&mut rng, s.iter().product(), 1.0);
                host.push(to_f64(&p));
                params.push(GpuTensor::from_slice(ctx, &p, s).unwrap());
            }
            let refs: Vec<&GpuTensor> = params.iter().collect();
            let mut opt = AdamW::new(ctx, config, &refs).unwrap();
            let mut m: Vec<Vec<f64>> = host.iter().map(|p| vec![0.0; p.len()]).collect();
            let mut v = m.clone();
            for step in 1..=4u32 {
                let grads_host: Vec<Vec<f32>> = shapes
                    .iter()
                    .map(|s| random(&mut rng, s.iter().product(), 1.0))
                    .collect();
                let grads: Vec<GpuTensor> = grads_host
                    .iter()
                    .zip(&shapes)
                    .map(|(g, s)| GpuTensor::from_slice(ctx, g, s).unwrap())
                    .collect();
                let grad_refs: Vec<&GpuTensor> = grads.iter().collect();
                opt.step(ctx, &refs, &grad_refs).unwrap();
                let g64: Vec<Vec<f64>> = grads_host.iter().map(|g| to_f64(g)).collect();
                let (norm, scale) =
                    reference::adamw_step(&config, step, &mut host, &g64, &mut m, &mut v);
                let tag = format!("[{backend}] adamw clip {max_grad_norm:?} step {step}");
                assert_close(
                    &format!("{tag} norm"),
                    &opt.grad_norm().to_vec(ctx).unwrap(),
                    &[norm, scale],
                    FORWARD_ATOL,
                    FORWARD_RTOL,
                );
                let (gm, gv) = opt.moments();
                for k in 0..shapes.len() {
                    assert_close(
                        &format!("{tag} param {k}"),
                        &params[k].to_vec(ctx).unwrap(),
                        &host[k],
                        FORWARD_ATOL,
                        FORWARD_RTOL,
                    );
                    assert_close(
                        &format!("{tag} m {k}"),
                        &gm[k].to_vec(ctx).unwrap(),
                        &m[k],
                        FORWARD_ATOL,
                        FORWARD_RTOL,
                    );
                    assert_close(
                        &format!("{tag} v {k}"),
                        &gv[k].to_vec(ctx).unwrap(),
                        &v[k],
                        FORWARD_ATOL,
                        FORWARD_RTOL,
                    );
                }
                if max_grad_norm.is_some() {
                    assert!(scale < 1.0, "the test's gradients must be clipped");
                }
            }
            assert_eq!(opt.steps(), 4);
        }
    });
}

#[test]
fn mismatched_tensors_are_a_typed_error() {
    for_each_backend(|_, ctx| {
        let p = GpuTensor::zeros(ctx, &[4]).unwrap();
        let g = GpuTensor::zeros(ctx, &[5]).unwrap();
        let mut opt = AdamW::new(ctx, AdamWConfig::default(), &[&p]).unwrap();
        assert!(matches!(
            opt.step(ctx, &[&p], &[&g]),
            Err(Error::Shape {
                arg: "params/grads",
                ..
            })
        ));
        assert_eq!(opt.steps(), 0, "a rejected step is not counted");
        assert!(matches!(
            opt.step(ctx, &[&p], &[&p]),
            Err(Error::Shape { arg: "grads", .. })
        ));
        let bad = AdamWConfig::default().beta1(1.0);
        assert!(AdamW::new(ctx, bad, &[&p]).is_err());
    });
}

#[test]
fn a_non_finite_gradient_norm_skips_this_and_every_later_update() {
    for_each_backend(|backend, ctx| {
        let config = AdamWConfig::default().lr(0.01).max_grad_norm(Some(1.0));
        let start = [0.5f32, -1.0, 2.0, 0.25];
        let p = GpuTensor::from_slice(ctx, &start, &[4]).unwrap();
        let mut opt = AdamW::new(ctx, config, &[&p]).unwrap();
        let good = GpuTensor::from_slice(ctx, &[0.1, 0.2, -0.3, 0.4], &[4]).unwrap();
        opt.step(ctx, &[&p], &[&good]).unwrap();
        opt.check_finite(ctx).unwrap();
        let after_good = p.to_vec(ctx).unwrap();
        let (m, v) = opt.moments();
        let moments = (m[0].to_vec(ctx).unwrap(), v[0].to_vec(ctx).unwrap());

        // The reference skips the bad step too.
        let mut host = vec![to_f64(&after_good)];
        let (mut hm, mut hv) = (vec![to_f64(&moments.0)], vec![to_f64(&moments.1)]);
        let bad_grads = [0.1f32, f32::INFINITY, 0.0, 0.0];
        let (norm, _) = reference::adamw_step(
            &config,
            2,
            &mut host,
            &[to_f64(&bad_grads)],
            &mut hm,
            &mut hv,
        );
        assert!(!norm.is_finite());
        assert_eq!(host[0], to_f64(&after_good), "reference updated on Inf");

        for grads in [bad_grads, [f32::NAN, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]] {
            let g = GpuTensor::from_slice(ctx, &grads, &[4]).unwrap();
            opt.step(ctx, &[&p], &[&g]).unwrap();
        }
        let (m, v) = opt.moments();
        assert_eq!(
            (
                p.to_vec(ctx).unwrap(),
                m[0].to_vec(ctx).unwrap(),
                v[0].to_vec(ctx).unwrap()
            ),
            (after_good, moments.0, moments.1),
            "[{backend}] an update after the non-finite step"
        );
        let err = opt.check_finite(ctx).unwrap_err();
        assert!(
            matches!(
                err,
                Error::NonFinite {
                    step: 2,
                    last_good: 1,
                    what: "gradient norm"
                }
            ),
            "[{backend}] {err}"
        );
        opt.set_steps(ctx, 1).unwrap();
        opt.check_finite(ctx).unwrap();
    });
}

#[test]
fn tensors_inside_a_shared_buffer_are_checked_and_aliasing_refused() {
    for_each_backend(|_, ctx| {
        let (buffer, _) = {
            let t = GpuTensor::zeros(ctx, &[4 * TENSOR_ALIGN]).unwrap();
            (t.buffer().clone(), t)
        };
        let at = |offset, shape: &[usize]| GpuTensor::from_buffer_at(buffer.clone(), offset, shape);
        assert!(matches!(
            at(1, &[4]),
            Err(Error::Shape { arg: "offset", .. })
        ));
        assert!(matches!(
            at(3 * TENSOR_ALIGN, &[TENSOR_ALIGN + 1]),
            Err(Error::Shape { arg: "buffer", .. })
        ));
        let a = at(0, &[TENSOR_ALIGN]).unwrap();
        let b = at(TENSOR_ALIGN, &[2, TENSOR_ALIGN]).unwrap();
        let c = at(2 * TENSOR_ALIGN, &[TENSOR_ALIGN]).unwrap();
        assert!(!a.overlaps(&b) && b.overlaps(&c) && !a.overlaps(&c));
        // Writes and reads stay inside each tensor.
        let data: Vec<f32> = (0..2 * TENSOR_ALIGN).map(|i| i as f32).collect();
        b.write(ctx, &data).unwrap();
        assert_eq!(a.to_vec(ctx).unwrap(), vec![0.0; TENSOR_ALIGN]);
        assert_eq!(c.to_vec(ctx).unwrap(), data[TENSOR_ALIGN..]);
        assert_eq!(
            b.reshape(&[2 * TENSOR_ALIGN]).unwrap().to_vec(ctx).unwrap(),
            data
        );
        // The optimizer refuses overlapping parameters and gradients in the parameters' buffer.
        let mut opt = AdamW::new(ctx, AdamWConfig::default(), &[&b, &c]).unwrap();
        let grads = [
            GpuTensor::zeros(ctx, b.shape()).unwrap(),
            GpuTensor::zeros(ctx, c.shape()).unwrap(),
        ];
        assert!(matches!(
            opt.step(ctx, &[&b, &c], &[&grads[0], &grads[1]]),
            Err(Error::Shape { arg: "params", .. })
        ));
        let mut opt = AdamW::new(ctx, AdamWConfig::default(), &[&a]).unwrap();
        assert!(matches!(
            opt.step(ctx, &[&a], &[&c]),
            Err(Error::Shape { arg: "grads", .. })
        ));
        assert_eq!(opt.steps(), 0);
    });
}

/// Mixed precision's loss scaling: gradients scaled by the loss scale step like unscaled ones; a
/// step with an overflowed (infinite) gradient changes nothing, halves the scale and is not
/// latched; the scale doubles after `growth_interval` clean steps; the bias corrections count the
/// steps taken, so the step after a skip equals an unscaled optimizer's next step.
#[test]
fn loss_scaling_unscales_skips_and_grows() {
    for_each_backend(|backend, ctx| {
        let config = AdamWConfig::default().lr(0.01).max_grad_norm(Some(2.0));
        let shapes = [vec![7, 3], vec![300]];
        let mut rng = rng(7);
        let values: Vec<Vec<f32>> = shapes
            .iter()
            .map(|s| random(&mut rng, s.iter().product(), 1.0))
            .collect();
        let make = || -> Vec<GpuTensor> {
            values
                .iter()
                .zip(&shapes)
                .map(|(v, s)| GpuTensor::from_slice(ctx, v, s).unwrap())
                .collect()
        };
        let (plain, scaled) = (make(), make());
        let plain_refs: Vec<&GpuTensor> = plain.iter().collect();
        let scaled_refs: Vec<&GpuTensor> = scaled.iter().collect();
        let mut unscaled_opt = AdamW::new(ctx, config, &plain_refs).unwrap();
        let mut opt = AdamW::new(ctx, config, &scaled_refs).unwrap();
        let scaling = LossScaling::default()
            .initial_scale(1024.0)
            .growth_interval(2);
        opt.enable_loss_scaling(ctx, scaling).unwrap();
        let grads_times = |grads: &[Vec<f32>], factor: f32| -> Vec<GpuTensor> {
            grads
                .iter()
                .zip(&shapes)
                .map(|(g, s)| {
                    let g: Vec<f32> = g.iter().map(|x| x * factor).collect();
                    GpuTensor::from_slice(ctx, &g, s).unwrap()
                })
                .collect()
        };
        let state = |opt: &AdamW| opt.loss_scale().unwrap().state(ctx).unwrap();
        let expect = |scale: f32, clean: u32, skipped: u32, last: bool| LossScaleState {
            scale,
            clean_steps: clean,
            skipped_steps: skipped,
            last_step_skipped: last,
        };
        // (scale the gradients are multiplied by, overflow injected, state after the step)
        let plan = [
            (1024.0, false, expect(1024.0, 1, 0, false)),
            (1024.0, false, expect(2048.0, 0, 0, false)),
            (2048.0, true, expect(1024.0, 0, 1, true)),
            (1024.0, false, expect(1024.0, 1, 1, false)),
        ];
        for (step, (scale, overflow, after)) in plan.into_iter().enumerate() {
            let tag = format!("[{backend}] loss scaling step {}", step + 1);
            let grads: Vec<Vec<f32>> = shapes
                .iter()
                .map(|s| random(&mut rng, s.iter().product(), 1.0))
                .collect();
            let mut scaled_grads = grads_times(&grads, scale);
            if overflow {
                let mut g = grads[1].clone();
                g[17] = f32::INFINITY;
                scaled_grads[1] = GpuTensor::from_slice(ctx, &g, &shapes[1]).unwrap();
            }
            let before: Vec<Vec<f32>> = scaled.iter().map(|p| p.to_vec(ctx).unwrap()).collect();
            let refs: Vec<&GpuTensor> = scaled_grads.iter().collect();
            opt.step(ctx, &scaled_refs, &refs).unwrap();
            assert_eq!(state(&opt), after, "{tag}");
            opt.check_finite(ctx).unwrap();
            if overflow {
                for (k, p) in scaled.iter().enumerate() {
                    assert_eq!(
                        p.to_vec(ctx).unwrap(),
                        before[k],
                        "{tag}: param {k} changed"
                    );
                }
                continue;
            }
            let plain_grads = grads_times(&grads, 1.0);
            let refs: Vec<&GpuTensor> = plain_grads.iter().collect();
            unscaled_opt.step(ctx, &plain_refs, &refs).unwrap();
            assert_close(
                &format!("{tag} norm"),
                &opt.grad_norm().to_vec(ctx).unwrap()[..1],
                &to_f64(&unscaled_opt.grad_norm().to_vec(ctx).unwrap()[..1]),
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
            for (k, (p, q)) in scaled.iter().zip(&plain).enumerate() {
                assert_close(
                    &format!("{tag} param {k}"),
                    &p.to_vec(ctx).unwrap(),
                    &to_f64(&q.to_vec(ctx).unwrap()),
                    FORWARD_ATOL,
                    FORWARD_RTOL,
                );
            }
        }
        // A scale that is not a power of two in [1, 2^24] is refused.
        for bad in [3.0, 0.5, f32::INFINITY, 2.0f32.powi(25)] {
            let e = opt
                .enable_loss_scaling(ctx, LossScaling::default().initial_scale(bad))
                .unwrap_err();
            assert!(e.to_string().contains("initial_scale"), "{e}");
        }
        let e = opt
            .enable_loss_scaling(ctx, LossScaling::default().growth_interval(0))
            .unwrap_err();
        assert!(e.to_string().contains("growth_interval"), "{e}");
    });
}
