//! Benchmark support shared by the `attention-bench` binary and the criterion benches: GPU timing
//! (timestamp queries where the adapter has them, otherwise wall clock with the device synchronised)
//! and the adapter's measured FMA throughput ([`fma`]), the ALU limit each case is compared with,
//! and memory bandwidth ([`copy`]), the limit of the kernels that stream memory (decode attention).

pub mod copy;
pub mod fma;

use std::time::Instant;

use crate::device::{Context, ContextOptions};
use crate::error::{Error, Result};

/// `n` deterministic values in `[-scale, scale)` from `seed` (xorshift): benchmark inputs that are
/// the same in every run and on every machine.
pub fn uniform_values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// How a [`Timer`] measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// GPU timestamps written before and after the timed work.
    Timestamps,
    /// Host wall clock around the work, with the device synchronised before and after.
    WallClock,
}

impl Clock {
    /// How the clock is described in reports.
    pub fn name(self) -> &'static str {
        match self {
            Clock::Timestamps => "GPU timestamps",
            Clock::WallClock => "wall clock, device synchronised",
        }
    }
}

/// Times work submitted to a context's queue.
pub struct Timer {
    clock: Clock,
    timestamps: Option<Timestamps>,
}

struct Timestamps {
    query_set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    period_ns: f64,
}

impl Timer {
    /// Timestamps when the device has `TIMESTAMP_QUERY` (and `prefer_wall_clock` is false),
    /// otherwise the wall clock.
    pub fn new(ctx: &Context, prefer_wall_clock: bool) -> Self {
        let has = ctx
            .device()
            .features()
            .contains(wgpu::Features::TIMESTAMP_QUERY);
        if prefer_wall_clock || !has {
            return Self {
                clock: Clock::WallClock,
                timestamps: None,
            };
        }
        let device = ctx.device();
        let query_set = device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("bench timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolve = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("bench timestamps resolve"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("bench timestamps readback"),
            size: 16,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Self {
            clock: Clock::Timestamps,
            timestamps: Some(Timestamps {
                query_set,
                resolve,
                readback,
                period_ns: ctx.queue().get_timestamp_period() as f64,
            }),
        }
    }

    /// The clock this timer uses.
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// Milliseconds the device spends on what `work` submits. `work` may record and submit any
    /// number of command buffers; with timestamps, an empty pass before and after brackets them.
    pub fn time(&self, ctx: &Context, work: impl FnOnce() -> Result<()>) -> Result<f64> {
        ctx.synchronize()?;
        let Some(ts) = &self.timestamps else {
            let start = Instant::now();
            work()?;
            ctx.synchronize()?;
            return Ok(start.elapsed().as_secs_f64() * 1e3);
        };
        let mark = |index: u32, resolve: bool| {
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("bench timestamp"),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &ts.query_set,
                    beginning_of_pass_write_index: Some(index),
                    end_of_pass_write_index: None,
                }),
            });
            if resolve {
                encoder.resolve_query_set(&ts.query_set, 0..2, &ts.resolve, 0);
                encoder.copy_buffer_to_buffer(&ts.resolve, 0, &ts.readback, 0, 16);
            }
            ctx.queue().submit([encoder.finish()]);
        };
        mark(0, false);
        work()?;
        mark(1, true);

        let ticks: Vec<u64> = pollster::block_on(crate::device::read_mapped(ctx, &ts.readback))?;
        Ok(ticks[1].saturating_sub(ticks[0]) as f64 * ts.period_ns / 1e6)
    }
}

/// Repeated measurements of one case, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Samples {
    /// One time per repetition, in milliseconds, in the order measured.
    pub times_ms: Vec<f64>,
}

impl Samples {
    fn sorted(&self) -> Vec<f64> {
        let mut t = self.times_ms.clone();
        t.sort_by(f64::total_cmp);
        t
    }

    /// The median time (the mean of the two middle ones for an even count); 0 without samples.
    pub fn median(&self) -> f64 {
        let t = self.sorted();
        match t.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => t[n / 2],
            n => (t[n / 2 - 1] + t[n / 2]) / 2.0,
        }
    }

    /// The shortest time.
    pub fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    /// The longest time.
    pub fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }

    /// (max - min) / median: the relative spread of the runs.
    pub fn spread(&self) -> f64 {
        (self.max() - self.min()) / self.median()
    }
}

/// Host time spent warming up before the timed runs: real GPUs drop their clocks while the host
/// validates against the CPU reference, and short timed runs would then measure the ramp back up
/// (seen on an H100 as the same case timing 4 ms or 24 ms depending on what ran before it).
pub const WARM_UP: std::time::Duration = std::time::Duration::from_millis(300);

/// Runs `work` once (pipeline compilation, first-touch allocation, autotuning), then for at least
/// [`WARM_UP`] more to bring the GPU clocks up, then `reps` timed runs. The warm-up is counted from
/// the end of the first run: one that compiles or tunes for seconds leaves the GPU idle long enough
/// to drop its clocks (an H200 timed the tuned choice at L 1024 at 0.23-0.42x the same kernels'
/// speed when the warm-up counted the tuning).
pub fn measure(
    ctx: &Context,
    timer: &Timer,
    reps: usize,
    mut work: impl FnMut() -> Result<()>,
) -> Result<Samples> {
    timer.time(ctx, &mut work)?;
    let start = std::time::Instant::now();
    while start.elapsed() < WARM_UP {
        timer.time(ctx, &mut work)?;
    }
    let mut samples = Samples::default();
    for _ in 0..reps.max(1) {
        samples.times_ms.push(timer.time(ctx, &mut work)?);
    }
    Ok(samples)
}

/// The bench binaries' context options: the environment ([`ContextOptions::from_env`]) under the
/// command line's `--backend` and `--adapter`.
pub fn bench_options(
    backends: Option<wgpu::Backends>,
    adapter: Option<String>,
) -> Result<ContextOptions> {
    let mut options = ContextOptions::from_env()?;
    if backends.is_some() {
        options.backends = backends;
    }
    if adapter.is_some() {
        options.adapter_name = adapter;
    }
    Ok(options)
}

/// Writes a bench binary's report (JSON, SVG) to `path`.
pub fn write_report(path: &std::path::Path, text: &str) -> Result<()> {
    std::fs::write(path, text)
        .map_err(|e| Error::Device(format!("writing {}: {e}", path.display())))
}
