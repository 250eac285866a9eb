//! The benchmark's own kernels and timers: the FMA-throughput kernel computes what its CPU
//! recurrence says (so the ALU limit it reports is measured on real work), the copy kernel copies
//! every byte (so the bandwidth it reports is of a real copy), and both clocks time.

use crate::common;

use common::*;
use wgpu_attention::bench::copy::{copy_bandwidth, CopyBench};
use wgpu_attention::bench::fma::{fma_reference, fma_throughput};
use wgpu_attention::bench::{measure, Clock, Timer};
use wgpu_attention::GpuTensor;

#[test]
fn fma_kernel_matches_its_cpu_recurrence() {
    for_each_backend(|backend, ctx| {
        let timer = Timer::new(ctx, true);
        let (out, ms) = fma_throughput(ctx, &timer, 3).unwrap();
        assert!(ms > 0.0, "[{backend}] time {ms}");
        let out = out.to_vec(ctx).unwrap();
        assert_eq!(out.len(), 3 * 64);
        for (i, &g) in out.iter().enumerate() {
            let r = fma_reference(i as u32);
            assert!(
                (g - r).abs() <= 1e-5 * r.abs().max(1.0),
                "[{backend}] invocation {i}: gpu {g}, cpu {r}"
            );
        }
    });
}

#[test]
fn timers_measure_submitted_work() {
    for_each_backend(|backend, ctx| {
        for wall_clock in [true, false] {
            let timer = Timer::new(ctx, wall_clock);
            if !wall_clock && timer.clock() != Clock::Timestamps {
                continue; // the adapter has no timestamp queries
            }
            // The work times itself with a wall-clock timer of its own; `timer` brackets it.
            let samples = measure(ctx, &timer, 3, || {
                let t = Timer::new(ctx, true);
                fma_throughput(ctx, &t, 64).map(|_| ())
            })
            .unwrap();
            assert_eq!(samples.times_ms.len(), 3);
            assert!(
                samples.times_ms.iter().all(|&t| t.is_finite() && t > 0.0),
                "[{backend}] {:?}: {:?}",
                timer.clock(),
                samples.times_ms
            );
            assert!(samples.min() <= samples.median() && samples.median() <= samples.max());
        }
    });
}

#[test]
fn copy_kernel_copies_every_word_across_chunks() {
    for_each_backend(|backend, ctx| {
        // Three whole chunks of 4 KiB and a short fourth: the chunks' bindings, the grid-stride
        // rounds and the last round's bound all matter. Each chunk holds 256 vec4 words, a
        // workgroup's round of 4 x 256 covers it, so the grid is one workgroup a chunk.
        for (bytes, chunk) in [(3 * 4096 + 48, 4096), (1 << 16, 1 << 20)] {
            let bench = CopyBench::with_chunk_bytes(ctx, bytes, chunk).unwrap();
            let words = (bytes / 4) as usize;
            let data: Vec<f32> = (0..words).map(|i| i as f32 + 0.5).collect();
            ctx.queue()
                .write_buffer(bench.src(), 0, bytemuck::cast_slice(&data));
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            bench.record_kernel(&mut encoder);
            ctx.queue().submit([encoder.finish()]);
            let dst = GpuTensor::from_buffer(bench.dst().clone(), &[words]).unwrap();
            let copied = dst.to_vec(ctx).unwrap();
            let wrong = copied.iter().zip(&data).position(|(a, b)| a != b);
            assert_eq!(
                wrong, None,
                "[{backend}] {bytes} bytes in chunks of {chunk}"
            );
        }
        let timer = Timer::new(ctx, true);
        let bandwidth = copy_bandwidth(ctx, &timer, 1, 1 << 16).unwrap();
        assert!(
            bandwidth.kernel_gb_s > 0.0 && bandwidth.buffer_copy_gb_s > 0.0,
            "[{backend}] {bandwidth:?}"
        );
        assert!(CopyBench::new(ctx, 12).is_err(), "[{backend}] 12 bytes");
        assert!(CopyBench::new(ctx, 0).is_err(), "[{backend}] 0 bytes");
    });
}
