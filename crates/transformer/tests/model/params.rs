//! A model's parameters packed in arenas (`Params::pack`) under AdamW: one dispatch per kernel per
//! arena (arenas end at the device's binding size), bitwise like tensors in buffers of their own.

use crate::common;

use common::*;
use wgpu_attention::device::BindingCache;
use wgpu_attention::kernels::optimizer::{AdamW, AdamWConfig};
use wgpu_attention::tensor::TENSOR_ALIGN;
use wgpu_attention::GpuTensor;
use wgpu_attention_transformer::layers::params::{Init, Params};

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

        let config = AdamWConfig::default()
            .lr(0.01)
            .weight_decay(0.1)
            .max_grad_norm(Some(0.5));
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
    let config = AdamWConfig::default().lr(0.01).max_grad_norm(Some(1.0));
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
