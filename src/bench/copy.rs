//! The adapter's memory bandwidth, measured (`shaders/copy_bandwidth.wgsl`): a compute kernel
//! copying vec4 words, and beside it a buffer-to-buffer copy (which a driver may hand to a DMA
//! engine: on an NVIDIA H200 that one topped out near 850 GB/s). Decode attention's bandwidth is
//! compared with the better of the two in the same run.

use super::{measure, Timer};
use crate::device::Context;
use crate::error::{Error, Result};

const SOURCE: &str = include_str!("../../shaders/copy_bandwidth.wgsl");
const WG: u64 = 256;
/// Bytes a kernel invocation copies per round (four vec4 words).
const ROUND_BYTES: u64 = 4 * 16;

/// Every shader of the benchmark, by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![("copy_bandwidth", SOURCE.to_string())]
}

/// Two buffers of the same size and what copies one into the other: the copy kernel's dispatches
/// (one per binding-sized chunk) and a buffer-to-buffer copy. Built once, recorded any number of
/// times.
pub struct CopyBench {
    src: wgpu::Buffer,
    dst: wgpu::Buffer,
    pipeline: std::sync::Arc<wgpu::ComputePipeline>,
    /// One bind group per chunk, with its workgroup count.
    chunks: Vec<(wgpu::BindGroup, u32)>,
}

impl CopyBench {
    /// Zeroed buffers of `bytes` each (a positive multiple of 16), copied by the kernel in chunks
    /// of at most `max_storage_buffer_binding_size`.
    pub fn new(ctx: &Context, bytes: u64) -> Result<Self> {
        let limit = ctx.limits().max_storage_buffer_binding_size;
        Self::with_chunk_bytes(ctx, bytes, limit)
    }

    /// [`CopyBench::new`] with the kernel's chunks at most `chunk_bytes` (at least 256, rounded
    /// down to the offset alignment and capped by the binding limit): what tests use to exercise
    /// the chunking on small buffers.
    pub fn with_chunk_bytes(ctx: &Context, bytes: u64, chunk_bytes: u64) -> Result<Self> {
        let limits = ctx.limits();
        if bytes == 0 || !bytes.is_multiple_of(16) || bytes > limits.max_buffer_size {
            return Err(Error::Unsupported {
                arg: "bytes",
                value: bytes,
                limit: limits.max_buffer_size,
                hint: " (a positive multiple of 16)",
            });
        }
        let align = (limits.min_storage_buffer_offset_alignment as u64).max(16);
        let chunk = chunk_bytes.min(limits.max_storage_buffer_binding_size) / align * align;
        if chunk == 0 {
            return Err(Error::Unsupported {
                arg: "chunk_bytes",
                value: chunk_bytes,
                limit: limits.max_storage_buffer_binding_size,
                hint: " (at least the storage offset alignment)",
            });
        }
        let buffer = |label| {
            ctx.device().create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let (src, dst) = (buffer("copy source"), buffer("copy destination"));
        let pipeline = ctx.pipeline(
            "copy_bandwidth",
            || SOURCE.to_string(),
            &[("WG", WG as u32)],
        );
        let layout = pipeline.get_bind_group_layout(0);
        let max_groups = limits.max_compute_workgroups_per_dimension as u64;
        let chunks = (0..bytes)
            .step_by(chunk as usize)
            .map(|offset| {
                let size = chunk.min(bytes - offset);
                let entry = |binding, buffer| wgpu::BindGroupEntry {
                    binding,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer,
                        offset,
                        size: wgpu::BufferSize::new(size),
                    }),
                };
                let entries = [entry(0, &src), entry(1, &dst)];
                let bind_group = ctx.device().create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("copy_bandwidth"),
                    layout: &layout,
                    entries: &entries,
                });
                // One round per invocation where the grid allows; grid-stride rounds beyond.
                let groups = size.div_ceil(WG * ROUND_BYTES).clamp(1, max_groups);
                (bind_group, groups as u32)
            })
            .collect();
        Ok(Self {
            src,
            dst,
            pipeline,
            chunks,
        })
    }

    /// The buffer copied from.
    pub fn src(&self) -> &wgpu::Buffer {
        &self.src
    }

    /// The buffer copied into.
    pub fn dst(&self) -> &wgpu::Buffer {
        &self.dst
    }

    /// Bytes each buffer holds.
    pub fn bytes(&self) -> u64 {
        self.src.size()
    }

    /// Records the copy kernel (one compute pass).
    pub fn record_kernel(&self, encoder: &mut wgpu::CommandEncoder) {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("copy_bandwidth"),
            timestamp_writes: None,
        });
        pass.set_pipeline(&self.pipeline);
        for (bind_group, groups) in &self.chunks {
            pass.set_bind_group(0, bind_group, &[]);
            pass.dispatch_workgroups(*groups, 1, 1);
        }
    }

    /// Records a buffer-to-buffer copy of the same bytes.
    pub fn record_buffer_copy(&self, encoder: &mut wgpu::CommandEncoder) {
        encoder.copy_buffer_to_buffer(&self.src, 0, &self.dst, 0, self.bytes());
    }
}

/// A copy's achieved bandwidth, bytes read plus bytes written per second, in GB/s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopyBandwidth {
    /// The copy kernel's (median of the timed runs).
    pub kernel_gb_s: f64,
    /// The buffer-to-buffer copy's (median of the timed runs).
    pub buffer_copy_gb_s: f64,
}

impl CopyBandwidth {
    /// The better of the two: the bandwidth a kernel is compared with.
    pub fn best(&self) -> f64 {
        self.kernel_gb_s.max(self.buffer_copy_gb_s)
    }
}

/// Times both copies of `bytes` (a positive multiple of 16), `reps` timed runs each after
/// [`measure`]'s warm-up.
pub fn copy_bandwidth(
    ctx: &Context,
    timer: &Timer,
    reps: usize,
    bytes: u64,
) -> Result<CopyBandwidth> {
    let bench = CopyBench::new(ctx, bytes)?;
    let gb_s = |record: &dyn Fn(&mut wgpu::CommandEncoder)| -> Result<f64> {
        let samples = measure(ctx, timer, reps, || {
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            record(&mut encoder);
            ctx.queue().submit([encoder.finish()]);
            Ok(())
        })?;
        // Each byte is read once and written once.
        Ok(2.0 * bytes as f64 / (samples.median() * 1e6))
    };
    Ok(CopyBandwidth {
        kernel_gb_s: gb_s(&|e| bench.record_kernel(e))?,
        buffer_copy_gb_s: gb_s(&|e| bench.record_buffer_copy(e))?,
    })
}
