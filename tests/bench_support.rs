//! The benchmark's own kernels and timers: the FMA-throughput kernel computes what its CPU
//! recurrence says (so the ALU limit it reports is measured on real work), and both clocks time.

mod common;

use common::*;
use wgpu_attention::bench::fma::{fma_reference, fma_throughput};
use wgpu_attention::bench::{measure, Clock, Timer};

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
