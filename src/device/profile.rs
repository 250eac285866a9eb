//! Submissions and compute passes: counted for the benchmarks, and timestamped per pass while
//! profiling is on.

use super::*;

/// See [`Context::recorded_counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordedCounts {
    pub passes: u64,
    pub submissions: u64,
}

/// Timestamps around every compute pass the kernels record, while profiling is on.
pub(super) struct PassProfiler {
    query_set: Arc<wgpu::QuerySet>,
    capacity: u32,
    labels: Vec<&'static str>,
}

/// Most passes one profile records (two timestamps each; wgpu allows 4096 queries per set).
pub const MAX_PROFILED_PASSES: u32 = 2048;

impl Context {
    /// Submits `encoder`, or refuses with [`Error::DeviceLost`] once the device is lost. Input is
    /// validated before anything is recorded, so a well-formed call raises no device error.
    pub(crate) fn submit(&self, encoder: wgpu::CommandEncoder) -> Result<()> {
        self.check_lost()?;
        self.queue.submit([encoder.finish()]);
        self.submissions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Compute passes the kernels have begun and command buffers this crate has submitted through
    /// this context so far (an embedder's own submissions of encoders it recorded into are not
    /// counted): differences around a call tell how it records.
    pub fn recorded_counts(&self) -> RecordedCounts {
        use std::sync::atomic::Ordering::Relaxed;
        RecordedCounts {
            passes: self.recorded_passes.load(Relaxed),
            submissions: self.submissions.load(Relaxed),
        }
    }

    /// Begins a compute pass labelled `label`, with timestamps around it while profiling.
    pub(crate) fn begin_pass<'e>(
        &self,
        encoder: &'e mut wgpu::CommandEncoder,
        label: &'static str,
    ) -> wgpu::ComputePass<'e> {
        self.recorded_passes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let slot = {
            let mut profiler = self.profiler.lock().unwrap_or_else(|e| e.into_inner());
            profiler.as_mut().and_then(|p| {
                let index = p.labels.len() as u32;
                (index < p.capacity).then(|| {
                    p.labels.push(label);
                    (p.query_set.clone(), 2 * index)
                })
            })
        };
        let writes = slot
            .as_ref()
            .map(|(query_set, index)| wgpu::ComputePassTimestampWrites {
                query_set,
                beginning_of_pass_write_index: Some(*index),
                end_of_pass_write_index: Some(index + 1),
            });
        encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(label),
            timestamp_writes: writes,
        })
    }

    /// Starts timing every compute pass the kernels record (up to [`MAX_PROFILED_PASSES`]), for a
    /// per-kernel breakdown of what is submitted until [`Context::finish_profiling`]. Needs the
    /// `TIMESTAMP_QUERY` feature.
    pub fn start_profiling(&self) -> Result<()> {
        if !self
            .device
            .features()
            .contains(wgpu::Features::TIMESTAMP_QUERY)
        {
            return Err(Error::Unsupported {
                arg: "profiling (TIMESTAMP_QUERY feature)",
                value: 0,
                limit: 0,
                hint: "; this adapter has no timestamp queries: time whole submissions on the host",
            });
        }
        let query_set = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("pass profiler"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * MAX_PROFILED_PASSES,
        });
        *self.profiler.lock().unwrap_or_else(|e| e.into_inner()) = Some(PassProfiler {
            query_set: Arc::new(query_set),
            capacity: MAX_PROFILED_PASSES,
            labels: Vec::new(),
        });
        Ok(())
    }

    /// Stops profiling and returns each recorded pass's label and GPU milliseconds, in recording
    /// order (after waiting for the submitted work). Passes beyond the capacity are not timed.
    pub fn finish_profiling(&self) -> Result<Vec<(&'static str, f64)>> {
        let Some(p) = self
            .profiler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return Ok(Vec::new());
        };
        let n = p.labels.len() as u32;
        if n == 0 {
            return Ok(Vec::new());
        }
        let bytes = u64::from(2 * n) * 8;
        let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass profiler resolve"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass profiler readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.resolve_query_set(&p.query_set, 0..2 * n, &resolve, 0);
        encoder.copy_buffer_to_buffer(&resolve, 0, &readback, 0, bytes);
        self.queue.submit([encoder.finish()]);
        let ticks: Vec<u64> = pollster::block_on(crate::tensor::read_mapped(self, &readback))?;
        let period_ns = f64::from(self.queue.get_timestamp_period());
        Ok(p.labels
            .iter()
            .zip(ticks.chunks_exact(2))
            .map(|(&label, t)| (label, t[1].saturating_sub(t[0]) as f64 * period_ns / 1e6))
            .collect())
    }
}
