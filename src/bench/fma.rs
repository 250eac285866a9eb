//! The adapter's ALU limit, measured (`shaders/fma_throughput.wgsl`): independent vec4 FMA chains on
//! register data. Its output is checked against [`fma_reference`], the same recurrence on the CPU.

use super::Timer;
use crate::device::Context;
use crate::error::{Error, Result};
use crate::tensor::GpuTensor;

const SOURCE: &str = include_str!("../../shaders/fma_throughput.wgsl");
const WG: u32 = 64;
/// FMA rounds per invocation (`ITERATIONS` in the shader); 8 vec4 FMAs, 64 FLOP, per round.
pub const ITERATIONS: u32 = 512;
const FLOP_PER_INVOCATION: f64 = ITERATIONS as f64 * 64.0;

/// Every shader of the benchmark, by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![("fma_throughput", SOURCE.to_string())]
}

/// Runs the FMA kernel over `workgroups` workgroups of 64 invocations and returns one value per
/// invocation, timing it with `timer`: (values, milliseconds).
pub fn fma_throughput(ctx: &Context, timer: &Timer, workgroups: u32) -> Result<(GpuTensor, f64)> {
    // Rows of at most the device's workgroups per dimension; the shader linearises (y, x) with
    // num_workgroups.x, so a count over one row must fill whole rows.
    let max = ctx.limits().max_compute_workgroups_per_dimension.max(1);
    let limit = (max as u64 * max as u64).min(u32::MAX as u64);
    if workgroups == 0 || workgroups as u64 > limit {
        return Err(Error::Unsupported {
            arg: "workgroups",
            value: workgroups as u64,
            limit,
            hint: " (max_compute_workgroups_per_dimension squared)",
        });
    }
    let (gx, gy) = match workgroups <= max {
        true => (workgroups, 1),
        false if workgroups.is_multiple_of(max) => (max, workgroups / max),
        false => {
            return Err(Error::Unsupported {
                arg: "workgroups",
                value: workgroups as u64,
                limit: max as u64,
                hint: " (or a multiple of max_compute_workgroups_per_dimension)",
            })
        }
    };
    let out = GpuTensor::uninit(ctx, "fma out", &[(workgroups * WG) as usize])?;
    let pipeline = ctx.pipeline(
        "fma_throughput",
        || SOURCE.to_string(),
        &[("WG", WG), ("ITERATIONS", ITERATIONS)],
    );
    let bind_group = ctx.device().create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("fma_throughput"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: out.buffer().as_entire_binding(),
        }],
    });
    let ms = timer.time(ctx, || {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(gx, gy, 1);
        }
        ctx.queue().submit([encoder.finish()]);
        Ok(())
    })?;
    Ok((out, ms))
}

/// What invocation `index` of the FMA kernel stores, computed on the CPU in f32 with fused
/// multiply-adds (a GPU that does not fuse differs in the last bits).
pub fn fma_reference(index: u32) -> f32 {
    let seed = (index % 64) as f32 * (1.0 / 64.0);
    let a = [0.5f32, 0.25, -0.5, 0.125];
    let b = [seed, 0.5, 0.25, -0.125];
    let starts = [0.0f32, 0.125, 0.25, 0.375, -0.125, -0.25, -0.375, 0.5];
    let mut s = [0.0f32; 4];
    for start in starts {
        for c in 0..4 {
            let mut x = seed + start;
            for _ in 0..ITERATIONS {
                x = x.mul_add(a[c], b[c]);
            }
            s[c] += x;
        }
    }
    s.iter().sum()
}

/// The adapter's measured FMA throughput in GFLOP/s: the best of a few runs, each sized to take at
/// least ~20 ms (more workgroups until it does).
pub fn fma_peak_gflops(ctx: &Context, timer: &Timer) -> Result<f64> {
    // One row of workgroups, within the device's limit per dimension.
    let max = ctx.limits().max_compute_workgroups_per_dimension.max(1);
    let mut workgroups = 1024u32.min(max);
    fma_throughput(ctx, timer, workgroups)?; // compile and warm up
    let mut best = 0.0f64;
    let mut runs = 0;
    while runs < 3 {
        let (_, ms) = fma_throughput(ctx, timer, workgroups)?;
        if ms < 20.0 && workgroups < max {
            workgroups = (workgroups * 4).min(max);
            continue;
        }
        let flop = workgroups as f64 * WG as f64 * FLOP_PER_INVOCATION;
        best = best.max(flop / (ms * 1e-3) / 1e9);
        runs += 1;
    }
    Ok(best)
}
