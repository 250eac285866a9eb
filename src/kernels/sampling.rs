//! Token sampling on the GPU (`shaders/sampling.wgsl`): greedy, or a draw from the softmax of the
//! logits at a temperature, restricted by top-k and top-p, with a seed; one workgroup per row, only
//! the chosen ids written. CPU reference: [`crate::reference::sampling`] (the same uniform draws,
//! the distribution in f64).

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::check_binding;
use crate::kernels::dispatch::Bindable;
use crate::tensor::GpuTensor;

const SAMPLING: &str = include_str!("../../shaders/sampling.wgsl");

/// Most invocations per row (`WG` in the shader; a power of two for its tree reductions); small
/// vocabularies get fewer (at least 32), so no lane idles through the reductions.
const MAX_WG: usize = 256;

/// The sampling shader by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![("sampling", SAMPLING.to_string())]
}

pub use crate::spec::Sampling;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SamplingParams {
    batch: u32,
    vocab: u32,
    draw_lo: u32,
    draw_hi: u32,
    grid_x: u32,
    pad: [u32; 3],
    /// The whole batch's settings (unread with per-row settings).
    row: RowSampling,
}

/// One row's settings as the shader reads them.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RowSampling {
    greedy: u32,
    top_k: u32,
    top_p: f32,
    inv_temperature: f32,
    seed_lo: u32,
    seed_hi: u32,
    pad: [u32; 2],
}

impl RowSampling {
    fn of(sampling: &Sampling) -> Self {
        Self {
            greedy: sampling.is_greedy() as u32,
            top_k: sampling
                .top_k
                .map_or(u32::MAX, |k| k.min(u32::MAX as usize) as u32),
            top_p: sampling.top_p.unwrap_or(1.0),
            inv_temperature: if sampling.is_greedy() {
                0.0
            } else {
                1.0 / sampling.temperature
            },
            seed_lo: sampling.seed as u32,
            seed_hi: (sampling.seed >> 32) as u32,
            pad: [0; 2],
        }
    }
}

/// Per-row sampling settings on the GPU, for [`sample_rows_into`]: a serving batch whose
/// requests each choose their tokens their own way. Allocated once for `rows` rows; written
/// before each use.
pub struct SamplingRows {
    buffer: wgpu::Buffer,
    rows: usize,
}

impl SamplingRows {
    /// Room for `rows` rows' settings (greedy at first).
    pub fn new(ctx: &Context, rows: usize) -> Result<Self> {
        if rows == 0 {
            return Err(Error::shape("rows", "is 0; it must be at least 1"));
        }
        let buffer = ctx.create_uncounted_buffer(
            "per-row sampling settings",
            (rows * std::mem::size_of::<RowSampling>()) as u64,
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        )?;
        let mut out = Self { buffer, rows };
        out.write(ctx, &vec![Sampling::greedy(); rows])?;
        Ok(out)
    }

    /// Sets every row's settings (each checked first: on error nothing is written).
    pub fn write(&mut self, ctx: &Context, samplings: &[Sampling]) -> Result<()> {
        if samplings.len() != self.rows {
            return Err(Error::shape(
                "samplings",
                format!("has {} entries for {} rows", samplings.len(), self.rows),
            ));
        }
        for s in samplings {
            s.check()?;
        }
        let rows: Vec<RowSampling> = samplings.iter().map(RowSampling::of).collect();
        ctx.queue()
            .write_buffer(&self.buffer, 0, bytemuck::cast_slice(&rows));
        Ok(())
    }
}

/// Records the choice of one id per row of `logits [B, V]` into `ids` (a buffer of at least `B`
/// u32, with `STORAGE` usage), using the random numbers of draw number `draw`. Nothing is recorded
/// if the input is rejected.
pub fn sample_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    logits: &GpuTensor,
    sampling: &Sampling,
    draw: u64,
    ids: &wgpu::Buffer,
) -> Result<()> {
    sampling.check()?;
    record(ctx, encoder, logits, sampling, None, draw, ids)
}

/// [`sample_into`] with each row's settings from `rows` (one per row of `logits`): row `b` draws
/// exactly what [`sample_into`] with `rows`' setting `b` draws for it.
pub fn sample_rows_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    logits: &GpuTensor,
    rows: &SamplingRows,
    draw: u64,
    ids: &wgpu::Buffer,
) -> Result<()> {
    let batch = logits.shape().first().copied().unwrap_or(0);
    if rows.rows != batch {
        return Err(Error::shape(
            "rows",
            format!(
                "has settings for {} rows; the logits have {batch}",
                rows.rows
            ),
        ));
    }
    record(
        ctx,
        encoder,
        logits,
        &Sampling::greedy(),
        Some(rows),
        draw,
        ids,
    )
}

fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    logits: &GpuTensor,
    sampling: &Sampling,
    per_row: Option<&SamplingRows>,
    draw: u64,
    ids: &wgpu::Buffer,
) -> Result<()> {
    crate::kernels::arguments::check_call(
        ctx,
        &[("ids", crate::tensor::Region::whole(ids))],
        &[("logits", logits.region())],
    )?;
    let &[batch, vocab] = logits.shape() else {
        return Err(Error::shape(
            "logits",
            format!("has shape {:?}; expected [batch, vocab]", logits.shape()),
        ));
    };
    if batch == 0 || vocab == 0 || vocab > u32::MAX as usize / 2 {
        return Err(Error::shape(
            "logits",
            format!(
                "has shape {:?}; batch and vocab must be positive",
                logits.shape()
            ),
        ));
    }
    if ids.size() < 4 * batch as u64 || !ids.usage().contains(wgpu::BufferUsages::STORAGE) {
        return Err(Error::shape(
            "ids",
            format!("needs STORAGE usage and room for {batch} u32"),
        ));
    }
    check_binding(ctx, "logits", logits.size_bytes())?;
    let (gx, gy) = ctx.grid_2d_for(
        batch as u64,
        "logits' rows (a workgroup each)",
        "; sample fewer rows at once",
    )?;
    let params = SamplingParams {
        batch: batch as u32,
        vocab: vocab as u32,
        draw_lo: draw as u32,
        draw_hi: (draw >> 32) as u32,
        grid_x: gx,
        pad: [0; 3],
        row: RowSampling::of(sampling),
    };
    let wg = vocab.next_power_of_two().clamp(32, MAX_WG) as u32;
    let constants = [("WG", wg), ("PER_ROW", per_row.is_some() as u32)];
    let pipeline = ctx.pipeline("sampling", || SAMPLING.to_string(), &constants);
    // Without per-row settings the logits stand where they would be (the shader does not read them).
    let rows_region = match per_row {
        Some(r) => crate::tensor::Region::whole(&r.buffer),
        None => logits.bound_region(),
    };
    let storage = [
        logits.bound_region().bind(1),
        crate::tensor::Region::whole(ids).bind(2),
        rows_region.bind(3),
    ];
    let bind_group = ctx.bind_group(&pipeline, "sampling", bytemuck::bytes_of(&params), &storage);
    let mut pass = ctx.begin_pass(encoder, "sampling");
    pass.set_pipeline(&pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(gx, gy, 1);
    Ok(())
}

/// Samples one id per row of `logits [B, V]` (draw number `draw`), submitted and read back.
pub fn sample(
    ctx: &Context,
    logits: &GpuTensor,
    sampling: &Sampling,
    draw: u64,
) -> Result<Vec<u32>> {
    crate::device::block_on("sample", sample_async(ctx, logits, sampling, draw))
}

/// Async form of [`sample`] (what a browser must use).
pub async fn sample_async(
    ctx: &Context,
    logits: &GpuTensor,
    sampling: &Sampling,
    draw: u64,
) -> Result<Vec<u32>> {
    let batch = logits.shape().first().copied().unwrap_or(0);
    let bytes = 4 * batch.max(1) as u64;
    let ids = ctx.create_uncounted_buffer(
        "sampled ids",
        bytes,
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
    )?;
    let staging = ctx.create_uncounted_buffer(
        "sampled ids readback",
        bytes,
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
    )?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    sample_into(ctx, &mut encoder, logits, sampling, draw, &ids)?;
    encoder.copy_buffer_to_buffer(&ids, 0, &staging, 0, bytes);
    ctx.submit(encoder)?;
    let mut out = crate::device::read_mapped::<u32>(ctx, &staging).await?;
    out.truncate(batch);
    Ok(out)
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    vec![
        uniform_layout!(
            "sampling",
            "Params",
            SamplingParams { batch, vocab, draw_lo, draw_hi, grid_x, pad }
            nested { row }
        ),
        uniform_layout!(
            "sampling",
            "RowSampling",
            RowSampling {
                greedy,
                top_k,
                top_p,
                inv_temperature,
                seed_lo,
                seed_hi,
                pad
            }
        ),
    ]
}
