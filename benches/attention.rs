//! Criterion benches of the attention kernels: fused and unfused, forward and backward, at B = 1,
//! H = 8, D = 64. Each iteration records, submits and waits for the device, so the time is the
//! kernels' (plus a submit), not just the recording.
//!
//!     cargo bench --bench attention
//!     WGPU_BACKEND=gl cargo bench --bench attention -- forward
//!
//! The validated table with GFLOP/s, memory and the ALU limit is `attention-bench` (README).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use wgpu_attention::{
    attention_backward_into, attention_backward_unfused, attention_backward_workspace,
    attention_forward_into, attention_forward_unfused, AttentionOptions, AttentionShape,
    BackwardViews, Context, ForwardViews, GpuTensor, HeadsView,
};

const LENGTHS: [usize; 2] = [256, 512];
const HEADS: usize = 8;
const HEAD_DIM: usize = 64;

fn random(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

fn inputs(ctx: &Context, l: usize) -> [HeadsView; 4] {
    let n = l * HEADS * HEAD_DIM;
    [1, 2, 3, 4].map(|seed| {
        GpuTensor::from_slice(ctx, &random(n, seed), &[1, l, HEADS, HEAD_DIM])
            .and_then(|t| t.heads())
            .expect("upload")
    })
}

fn attention(c: &mut Criterion) {
    let ctx = Context::from_env().expect("no adapter: see README (prerequisites)");
    eprintln!("adapter: {}", ctx.report().name);
    for causal in [false, true] {
        let opts = AttentionOptions::new().causal(causal);
        let mask = if causal { "causal" } else { "none" };
        let mut group = c.benchmark_group(format!("attention_forward/{mask}"));
        group.sample_size(10);
        for l in LENGTHS {
            let [q, k, v, _] = inputs(&ctx, l);
            let s = AttentionShape::of(&q, &k, &v).unwrap();
            let out = GpuTensor::zeros(&ctx, &[1, l, HEADS, HEAD_DIM]).unwrap();
            let lse = GpuTensor::zeros(&ctx, &[1, HEADS, l]).unwrap();
            group.bench_with_input(BenchmarkId::new("fused", l), &l, |b, _| {
                b.iter(|| {
                    let mut encoder = ctx.device().create_command_encoder(&Default::default());
                    attention_forward_into(
                        &ctx,
                        &mut encoder,
                        &ForwardViews {
                            q: &q,
                            k: &k,
                            v: &v,
                            out: &out.heads().unwrap(),
                            lse: &lse,
                        },
                        &opts,
                    )
                    .unwrap();
                    ctx.queue().submit([encoder.finish()]);
                    ctx.synchronize().unwrap();
                })
            });
            group.bench_with_input(BenchmarkId::new("unfused", l), &l, |b, _| {
                b.iter(|| {
                    attention_forward_unfused(&ctx, &q, &k, &v, &opts).unwrap();
                    ctx.synchronize().unwrap();
                })
            });
            let _ = s;
        }
        group.finish();

        let mut group = c.benchmark_group(format!("attention_backward/{mask}"));
        group.sample_size(10);
        for l in LENGTHS {
            let [q, k, v, d_out] = inputs(&ctx, l);
            let s = AttentionShape::of(&q, &k, &v).unwrap();
            let out = GpuTensor::zeros(&ctx, &[1, l, HEADS, HEAD_DIM]).unwrap();
            let lse = GpuTensor::zeros(&ctx, &[1, HEADS, l]).unwrap();
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            attention_forward_into(
                &ctx,
                &mut encoder,
                &ForwardViews {
                    q: &q,
                    k: &k,
                    v: &v,
                    out: &out.heads().unwrap(),
                    lse: &lse,
                },
                &opts,
            )
            .unwrap();
            ctx.queue().submit([encoder.finish()]);
            let grads: Vec<GpuTensor> = (0..3)
                .map(|_| GpuTensor::zeros(&ctx, &[1, l, HEADS, HEAD_DIM]).unwrap())
                .collect();
            let workspace = attention_backward_workspace(&ctx, &s).unwrap();
            group.bench_with_input(BenchmarkId::new("fused", l), &l, |b, _| {
                b.iter(|| {
                    let mut encoder = ctx.device().create_command_encoder(&Default::default());
                    attention_backward_into(
                        &ctx,
                        &mut encoder,
                        &BackwardViews {
                            q: &q,
                            k: &k,
                            v: &v,
                            out: &out.heads().unwrap(),
                            lse: &lse,
                            d_out: &d_out,
                            dq: &grads[0].heads().unwrap(),
                            dk: &grads[1].heads().unwrap(),
                            dv: &grads[2].heads().unwrap(),
                            workspace: &workspace,
                        },
                        &opts,
                    )
                    .unwrap();
                    ctx.queue().submit([encoder.finish()]);
                    ctx.synchronize().unwrap();
                })
            });
            group.bench_with_input(BenchmarkId::new("unfused", l), &l, |b, _| {
                b.iter(|| {
                    attention_backward_unfused(&ctx, &q, &k, &v, &d_out, &opts).unwrap();
                    ctx.synchronize().unwrap();
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, attention);
criterion_main!(benches);
