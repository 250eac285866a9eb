//! Submissions and compute passes: counted for the benchmarks, and timestamped per pass while
//! profiling is on.

use super::ordered_writes::record_ordered_writes;
use super::Context;
use crate::error::{Error, Result};
use std::sync::Arc;

/// See [`Context::recorded_counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordedCounts {
    /// Compute passes begun.
    pub passes: u64,
    /// Command buffers submitted.
    pub submissions: u64,
}

/// Timestamps around every compute pass the kernels record, while profiling is on.
pub(super) struct PassProfiler {
    query_set: Arc<wgpu::QuerySet>,
    capacity: u32,
    labels: Vec<&'static str>,
}

/// The pass of a [`Context::with_one_pass`] scope, begun by its first kernel.
pub(super) struct SharedPass {
    encoder: usize,
    label: &'static str,
    pass: Option<wgpu::ComputePass<'static>>,
}

/// An encoder's identity while a scope borrows it (its address cannot change meanwhile).
fn encoder_key(encoder: &wgpu::CommandEncoder) -> usize {
    encoder as *const wgpu::CommandEncoder as usize
}

/// A compute pass the kernels record into: their own, or their scope's shared one (held locked
/// while a kernel records). Borrows the encoder like the pass it stands for.
pub(crate) struct Pass<'a> {
    inner: PassInner<'a>,
    _encoder: std::marker::PhantomData<&'a mut wgpu::CommandEncoder>,
}

// Lives on the stack while a kernel records; boxing the pass would allocate once per kernel.
#[allow(clippy::large_enum_variant)]
enum PassInner<'a> {
    Own(wgpu::ComputePass<'static>),
    Shared(std::sync::MutexGuard<'a, Vec<SharedPass>>, usize),
}

impl std::ops::Deref for Pass<'_> {
    type Target = wgpu::ComputePass<'static>;

    fn deref(&self) -> &Self::Target {
        match &self.inner {
            PassInner::Own(pass) => pass,
            PassInner::Shared(shared, index) => shared[*index].pass.as_ref().expect("begun"),
        }
    }
}

impl std::ops::DerefMut for Pass<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match &mut self.inner {
            PassInner::Own(pass) => pass,
            PassInner::Shared(shared, index) => shared[*index].pass.as_mut().expect("begun"),
        }
    }
}

/// Most passes one profile records (two timestamps each; wgpu allows 4096 queries per set).
pub const MAX_PROFILED_PASSES: u32 = 2048;

impl Context {
    /// Submits `encoder`, or refuses with [`Error::DeviceLost`] once the device is lost. Input is
    /// validated before anything is recorded, so a well-formed call raises no device error.
    pub fn submit(&self, encoder: wgpu::CommandEncoder) -> Result<()> {
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

    /// Begins a compute pass labelled `label`, with timestamps around it while profiling; inside
    /// [`Context::with_one_pass`] on the same encoder, continues that scope's pass instead. Writes
    /// made in recording order since the last pass are copied in first (`ordered_writes`).
    pub(crate) fn begin_pass<'a>(
        &'a self,
        encoder: &'a mut wgpu::CommandEncoder,
        label: &'static str,
    ) -> Pass<'a> {
        let key = encoder_key(encoder);
        // The autotuner's own encoders: the caller's ordered writes, shared passes and profile
        // are not theirs.
        let tuning = self.is_tuning_thread();
        let writes = match tuning {
            true => Vec::new(),
            false => self.take_ordered_writes(),
        };
        let mut shared = self.shared_passes.lock().unwrap_or_else(|e| e.into_inner());
        let scope = shared.iter().position(|s| s.encoder == key);
        if let Some(index) = scope.filter(|_| !tuning) {
            if !writes.is_empty() {
                // Copies cannot be recorded inside a pass: end the scope's pass (the next kernel
                // continues in a new one).
                shared[index].pass = None;
                record_ordered_writes(encoder, &writes);
            }
            if shared[index].pass.is_none() {
                self.recorded_passes
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(shared[index].label),
                    timestamp_writes: None,
                });
                shared[index].pass = Some(pass.forget_lifetime());
            }
            return Pass {
                inner: PassInner::Shared(shared, index),
                _encoder: std::marker::PhantomData,
            };
        }
        drop(shared);
        record_ordered_writes(encoder, &writes);
        self.recorded_passes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let slot = match tuning {
            true => None,
            false => {
                let mut profiler = self.profiler.lock().unwrap_or_else(|e| e.into_inner());
                profiler.as_mut().and_then(|p| {
                    let index = p.labels.len() as u32;
                    (index < p.capacity).then(|| {
                        p.labels.push(label);
                        (p.query_set.clone(), 2 * index)
                    })
                })
            }
        };
        let writes = slot
            .as_ref()
            .map(|(query_set, index)| wgpu::ComputePassTimestampWrites {
                query_set,
                beginning_of_pass_write_index: Some(*index),
                end_of_pass_write_index: Some(index + 1),
            });
        let pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(label),
            timestamp_writes: writes,
        });
        Pass {
            inner: PassInner::Own(pass.forget_lifetime()),
            _encoder: std::marker::PhantomData,
        }
    }

    /// Runs `record` with every kernel it records into `encoder` sharing one compute pass, named
    /// `label`: a pass boundary orders nothing that wgpu does not already order between the
    /// dispatches of a pass (it places a barrier wherever a dispatch uses what an earlier one
    /// wrote), while each pass costs a GPU and wgpu's recording a fixed price. While profiling, or
    /// with [`Context::pass_per_kernel`], kernels keep passes of their own. `record` may not record
    /// commands other than this crate's kernels into `encoder` (copies, clears, passes of your
    /// own): wgpu refuses them while the pass is open, and reports it as a validation error. Nested
    /// calls on one encoder join the outer pass. `wgpu_attention_transformer::Transformer`'s forward and
    /// backward and `wgpu_attention_transformer::Trainer::step` record this way.
    ///
    /// ```no_run
    /// # fn f(ctx: &wgpu_attention::Context, q: &wgpu_attention::HeadsView,
    /// #      out: &wgpu_attention::HeadsView, lse: &wgpu_attention::GpuTensor)
    /// #      -> wgpu_attention::Result<()> {
    /// use wgpu_attention::{attention_forward_into, AttentionOptions, ForwardViews};
    /// let mut encoder = ctx.device().create_command_encoder(&Default::default());
    /// ctx.with_one_pass(&mut encoder, "my layers", |encoder| {
    ///     // Every kernel recorded here shares one compute pass.
    ///     let views = ForwardViews { q, k: q, v: q, out, lse };
    ///     attention_forward_into(ctx, encoder, &views, &AttentionOptions::new())
    /// })?;
    /// ctx.queue().submit([encoder.finish()]);
    /// # Ok(()) }
    /// ```
    pub fn with_one_pass<R>(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        label: &'static str,
        record: impl FnOnce(&mut wgpu::CommandEncoder) -> R,
    ) -> R {
        let key = encoder_key(encoder);
        let profiling = self
            .profiler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        let mut shared = self.shared_passes.lock().unwrap_or_else(|e| e.into_inner());
        if profiling || self.pass_per_kernel || shared.iter().any(|s| s.encoder == key) {
            drop(shared);
            return record(encoder);
        }
        shared.push(SharedPass {
            encoder: key,
            label,
            pass: None,
        });
        drop(shared);
        // Ends the pass (unlocking the encoder) however `record` returns, unwinding included.
        struct EndPass<'c>(&'c Context, usize);
        impl Drop for EndPass<'_> {
            fn drop(&mut self) {
                let mut shared = self
                    .0
                    .shared_passes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                shared.retain(|s| s.encoder != self.1);
            }
        }
        let _end = EndPass(self, key);
        record(encoder)
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
        super::wait::block_on("Context::finish_profiling", self.finish_profiling_async())
    }

    /// Async form of [`Context::finish_profiling`] (what a browser must use).
    pub async fn finish_profiling_async(&self) -> Result<Vec<(&'static str, f64)>> {
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
        let ticks: Vec<u64> = crate::device::read_mapped(self, &readback).await?;
        let period_ns = f64::from(self.queue.get_timestamp_period());
        Ok(p.labels
            .iter()
            .zip(ticks.chunks_exact(2))
            .map(|(&label, t)| (label, t[1].saturating_sub(t[0]) as f64 * period_ns / 1e6))
            .collect())
    }
}
