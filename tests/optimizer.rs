//! AdamW (bias correction, decoupled weight decay, global-norm clipping) on the GPU vs the f64
//! reference over several steps: parameters, both moments and the gradient norm; typed errors.
//! Parameters packed in one arena are updated by one dispatch per kernel (arenas end at the device's
//! binding size), bitwise like tensors in buffers of their own.

mod common;

use common::*;
use wgpu_attention::device::BindingCache;
use wgpu_attention::kernels::optimizer::{AdamW, AdamWConfig};
use wgpu_attention::layers::params::{Init, Params};
use wgpu_attention::reference::optimizer as reference;
use wgpu_attention::tensor::TENSOR_ALIGN;
use wgpu_attention::{Error, GpuTensor};

#[test]
fn steps_match_reference_with_and_without_clipping() {
    for_each_backend(|backend, ctx| {
        for max_grad_norm in [None, Some(0.5)] {
            let config = AdamWConfig {
                lr: 0.01,
                weight_decay: 0.1,
                max_grad_norm,
                ..Default::default()
            };
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
        let bad = AdamWConfig {
            beta1: 1.0,
            ..Default::default()
        };
        assert!(AdamW::new(ctx, bad, &[&p]).is_err());
    });
}

#[test]
fn a_non_finite_gradient_norm_skips_this_and_every_later_update() {
    for_each_backend(|backend, ctx| {
        let config = AdamWConfig {
            lr: 0.01,
            max_grad_norm: Some(1.0),
            ..Default::default()
        };
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

/// Bits of every tensor, for bitwise comparisons.
fn bits(ctx: &wgpu_attention::Context, tensors: &[GpuTensor]) -> Vec<Vec<u32>> {
    tensors
        .iter()
        .map(|t| t.to_vec(ctx).unwrap().iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Writes `data` into `grads`, records one step (each dispatch takes one bind group from a fresh
/// cache), submits it and returns the number of dispatches.
fn step_counting_dispatches(
    ctx: &wgpu_attention::Context,
    opt: &mut AdamW,
    params: &[&GpuTensor],
    grads: &[&GpuTensor],
    data: &[Vec<f32>],
) -> u64 {
    for (g, data) in grads.iter().zip(data) {
        g.write(ctx, data).unwrap();
    }
    let mut cache = BindingCache::default();
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    ctx.with_binding_cache(&mut cache, || {
        opt.step_into(ctx, &mut encoder, params, grads)
    })
    .unwrap();
    ctx.queue().submit([encoder.finish()]);
    let (created, reused) = cache.counts();
    created + reused
}

#[test]
fn packed_parameters_take_one_dispatch_per_kernel_and_match_separate_tensors_bitwise() {
    for_each_backend(|backend, ctx| {
        // An empty tensor, one of a single element and ones spanning several partial sums
        // (256 elements each), at aligned offsets with padding between them.
        let shapes = [
            vec![5],
            vec![0],
            vec![7, 3],
            vec![2, 300],
            vec![64],
            vec![1],
        ];
        let n = shapes.len();
        let store = |ctx| {
            let mut params = Params::new(7);
            for (i, s) in shapes.iter().enumerate() {
                params
                    .add(ctx, format!("p{i}"), s, Init::Uniform(1.0))
                    .unwrap();
            }
            params.pack(ctx).unwrap();
            params
        };
        let packed = store(ctx);
        assert!(packed.is_packed());
        let arena = packed.values()[0].buffer();
        assert!(packed.values().iter().all(|t| t.buffer() == arena));
        assert!(packed
            .values()
            .iter()
            .all(|t| t.offset() % TENSOR_ALIGN == 0));
        let start = bits(ctx, packed.values());
        // The same values in buffers of their own, and a mix: tensor 3 on its own between two
        // runs of the arena (three groups).
        let separate: Vec<GpuTensor> = packed
            .values()
            .iter()
            .map(|t| GpuTensor::from_slice(ctx, &t.to_vec(ctx).unwrap(), t.shape()).unwrap())
            .collect();
        let mixed = store(ctx);
        assert_eq!(bits(ctx, mixed.values()), start, "same seed, same values");
        let lone = separate[3].clone();
        let lone = GpuTensor::from_slice(ctx, &lone.to_vec(ctx).unwrap(), lone.shape()).unwrap();
        let lone_grad = GpuTensor::zeros(ctx, lone.shape()).unwrap();
        let mixed_values: Vec<&GpuTensor> = (0..n)
            .map(|i| if i == 3 { &lone } else { &mixed.values()[i] })
            .collect();
        let mixed_grads: Vec<&GpuTensor> = (0..n)
            .map(|i| {
                if i == 3 {
                    &lone_grad
                } else {
                    &mixed.grads()[i]
                }
            })
            .collect();
        let separate_grads: Vec<GpuTensor> = shapes
            .iter()
            .map(|s| GpuTensor::zeros(ctx, s).unwrap())
            .collect();

        let config = AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            max_grad_norm: Some(0.5),
            ..Default::default()
        };
        fn refs(ts: &[GpuTensor]) -> Vec<&GpuTensor> {
            ts.iter().collect()
        }
        let runs: [(&str, Vec<&GpuTensor>, Vec<&GpuTensor>, u64); 3] = [
            ("packed", refs(packed.values()), refs(packed.grads()), 3),
            (
                "separate",
                refs(&separate),
                refs(&separate_grads),
                2 * n as u64 + 1,
            ),
            ("mixed", mixed_values, mixed_grads, 2 * 3 + 1),
        ];
        let mut optimizers: Vec<AdamW> = runs
            .iter()
            .map(|(_, params, _, _)| AdamW::new(ctx, config, params).unwrap())
            .collect();
        let mut rng = rng(11);
        for step in 1..=3 {
            let grads: Vec<Vec<f32>> = shapes
                .iter()
                .map(|s| random(&mut rng, s.iter().product(), 1.0))
                .collect();
            let mut results = Vec::new();
            for ((name, params, grad_tensors, dispatches), opt) in runs.iter().zip(&mut optimizers)
            {
                assert_eq!(
                    step_counting_dispatches(ctx, opt, params, grad_tensors, &grads),
                    *dispatches,
                    "[{backend}] {name}: dispatches of a step"
                );
                let values: Vec<GpuTensor> = params.iter().map(|&t| t.clone()).collect();
                let (m, v) = opt.moments();
                results.push((
                    *name,
                    [
                        bits(ctx, &values),
                        bits(ctx, m),
                        bits(ctx, v),
                        bits(ctx, std::slice::from_ref(opt.grad_norm())),
                    ],
                ));
            }
            assert_ne!(
                results[0].1[0], start,
                "[{backend}] the step changed nothing"
            );
            for (name, result) in &results[1..] {
                assert!(
                    *result == results[0].1,
                    "[{backend}] step {step}: {name} differs from packed"
                );
            }
        }
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

/// Arenas end where one would pass the device's storage binding size, and AdamW's groups with them:
/// on a device limited to 16 KiB bindings, four tensors land in two arenas (1000 + 3000 elements,
/// then 2000 + 50) and the optimizer takes two dispatches per kernel, bitwise like separate tensors.
#[test]
fn arenas_split_at_the_binding_limit_and_update_like_separate_tensors() {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN));
    let Some(adapter) = adapters.into_iter().next() else {
        eprintln!("no Vulkan adapter: skipped");
        return;
    };
    let limit = 16 * 1024;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        required_limits: wgpu::Limits {
            max_storage_buffer_binding_size: limit,
            ..adapter.limits()
        },
        ..Default::default()
    }))
    .unwrap();
    let ctx = &wgpu_attention::Context::from_device(device, queue).unwrap();
    let shapes = [vec![1000], vec![3000], vec![2000], vec![50]];
    let mut params = Params::new(5);
    for (i, s) in shapes.iter().enumerate() {
        params
            .add(ctx, format!("p{i}"), s, Init::Uniform(1.0))
            .unwrap();
    }
    params.pack(ctx).unwrap();
    let v = params.values();
    assert!(v[0].buffer() == v[1].buffer() && v[2].buffer() == v[3].buffer());
    assert!(
        v[1].buffer() != v[2].buffer(),
        "one arena would pass {limit} bytes"
    );
    assert!(v.iter().all(|t| t.buffer().size() <= limit));

    let separate: Vec<GpuTensor> = v
        .iter()
        .map(|t| GpuTensor::from_slice(ctx, &t.to_vec(ctx).unwrap(), t.shape()).unwrap())
        .collect();
    let separate_grads: Vec<GpuTensor> = shapes
        .iter()
        .map(|s| GpuTensor::zeros(ctx, s).unwrap())
        .collect();
    let config = AdamWConfig {
        lr: 0.01,
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let runs: [(Vec<&GpuTensor>, Vec<&GpuTensor>, u64); 2] = [
        (
            v.iter().collect(),
            params.grads().iter().collect(),
            2 * 2 + 1,
        ),
        (
            separate.iter().collect(),
            separate_grads.iter().collect(),
            2 * 4 + 1,
        ),
    ];
    let mut rng = rng(13);
    let steps: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|_| shapes.iter().map(|s| random(&mut rng, s[0], 1.0)).collect())
        .collect();
    let mut results = Vec::new();
    for (values, grads, dispatches) in &runs {
        let mut opt = AdamW::new(ctx, config, values).unwrap();
        for (step, grads_host) in steps.iter().enumerate() {
            assert_eq!(
                step_counting_dispatches(ctx, &mut opt, values, grads, grads_host),
                *dispatches,
                "dispatches of step {step}"
            );
        }
        let values: Vec<GpuTensor> = values.iter().map(|&t| t.clone()).collect();
        results.push((bits(ctx, &values), bits(ctx, opt.moments().0)));
    }
    assert!(
        results[0] == results[1],
        "arenas and separate tensors differ"
    );
}
