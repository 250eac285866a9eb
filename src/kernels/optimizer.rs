//! AdamW with bias correction and optional global-norm gradient clipping (SPEC.md):
//! `shaders/grad_norm_{partial,finalize}.wgsl` compute the norm of all gradients and the clip scale
//! on the GPU in a fixed order; `shaders/adamw.wgsl` updates each parameter with its moments.
//! CPU reference: [`crate::reference::optimizer`].
//!
//! Both the partial sums and the update run over a parameter table (`shaders/optimizer_common.wgsl`):
//! one dispatch covers every consecutive tensor whose parameters share a buffer and whose gradients
//! share another, so a model packed by `wgpu_attention_transformer::layers::params::Params::pack` is updated by one dispatch
//! per kernel, and tensors in buffers of their own by one each.
//!
//! Non-finite guard: the first step whose gradient norm (or the loss, with
//! [`AdamW::step_into_guarded`]) is Inf or NaN is latched on the GPU, and from it on every update
//! is skipped, so the parameters stay those of the last good step without a readback per step;
//! [`AdamW::check_finite`] reports it.
//!
//! Mixed precision: with [`AdamW::enable_loss_scaling`] the gradients are taken to be scaled by the
//! [`LossScale`] the loss gradient applied; the norm kernel unscales, skips steps whose gradients
//! overflowed and adjusts the scale, and the update unscales (`crate::kernels::loss_scale`).

use crate::device::{Allocation, Context};
use crate::error::{Error, Result};
use crate::kernels::dispatch::{encode, encode_in, grid_x, SimpleKernel};
use crate::kernels::loss_scale::{LossScale, LossScaling};
use crate::tensor::{zeros_in_arenas, GpuTensor, Region};

const NORM_PARTIAL: &str = concat!(
    include_str!("../../shaders/optimizer_common.wgsl"),
    include_str!("../../shaders/grad_norm_partial.wgsl")
);
const NORM_FINALIZE: &str = include_str!("../../shaders/grad_norm_finalize.wgsl");
const ADAMW: &str = concat!(
    include_str!("../../shaders/optimizer_common.wgsl"),
    include_str!("../../shaders/adamw.wgsl")
);
/// Elements each invocation of the partial-norm kernel sums (`CHUNK` in the shader).
const CHUNK: usize = 256;
/// Elements each invocation of the update kernel steps (`RUN` in the shader): one table search
/// serves them all.
const RUN: usize = 4;

/// The optimizer shaders by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![
        ("grad_norm_partial", NORM_PARTIAL.to_string()),
        ("grad_norm_finalize", NORM_FINALIZE.to_string()),
        ("adamw", ADAMW.to_string()),
    ]
}

pub use crate::spec::AdamWConfig;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct PartialParams {
    first: u32,
    count: u32,
    partials: u32,
    partial_base: u32,
    grid_x: u32,
    pad: [u32; 3],
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct FinalizeParams {
    partials: u32,
    clip: u32,
    max_norm: f32,
    step: u32,
    watched: u32,
    growth_interval: u32,
    pad: [u32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AdamParams {
    first: u32,
    count: u32,
    runs: u32,
    grid_x: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    correction1: f32,
    correction2: f32,
    step: u32,
}

/// One tensor's row of the parameter table (`Segment` in `shaders/optimizer_common.wgsl`): element
/// offsets from the start of its group's bindings.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
struct Segment {
    start: u32,
    partial_start: u32,
    param: u32,
    grad: u32,
    moment: u32,
    len: u32,
    pad: [u32; 2],
}

/// Consecutive tensors `first..end` updated by one dispatch of each kernel, and the ranges of the
/// parameter, gradient and moment buffers it binds (every tensor of the group inside them).
struct Group<'a> {
    first: usize,
    end: usize,
    runs: usize,
    partials: usize,
    partial_base: usize,
    param: Region<'a>,
    grad: Region<'a>,
    m: Region<'a>,
    v: Region<'a>,
}

/// Parameter tables (by contents) an optimizer keeps: a layout is uploaded once, into a buffer no
/// later step rewrites, so a step recorded before an earlier one is submitted keeps its own table.
const CACHED_TABLES: usize = 4;

/// Splits the tensors into runs that one dispatch can update: a new group begins where the
/// parameter, gradient or moment buffer changes, or where a binding would pass the adapter's
/// binding size.
fn groups<'a>(
    ctx: &Context,
    params: &[&'a GpuTensor],
    grads: &[&'a GpuTensor],
    [m, v]: [&'a [GpuTensor]; 2],
) -> Vec<Group<'a>> {
    let limit = ctx.limits().max_storage_buffer_binding_size;
    let mut groups: Vec<Group<'a>> = Vec::new();
    let mut partial_base = 0;
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        let parts = [p.region(), g.region(), m[i].region(), v[i].region()];
        let partials = g.len().div_ceil(CHUNK);
        let joins = groups.last().is_some_and(|group| {
            let bound = [group.param, group.grad, group.m, group.v];
            bound
                .iter()
                .zip(&parts)
                .all(|(b, t)| b.buffer == t.buffer && b.cover(t).size <= limit)
        });
        match groups.last_mut() {
            Some(group) if joins => {
                group.end = i + 1;
                group.runs += p.len().div_ceil(RUN);
                group.partials += partials;
                group.param = group.param.cover(&parts[0]);
                group.grad = group.grad.cover(&parts[1]);
                group.m = group.m.cover(&parts[2]);
                group.v = group.v.cover(&parts[3]);
            }
            _ => groups.push(Group {
                first: i,
                end: i + 1,
                runs: p.len().div_ceil(RUN),
                partials,
                partial_base,
                param: parts[0],
                grad: parts[1],
                m: parts[2],
                v: parts[3],
            }),
        }
        partial_base += partials;
    }
    groups
}

/// The parameter table of `groups`, uploaded the first time this layout is seen.
fn table(
    ctx: &Context,
    tables: &mut Vec<(Vec<Segment>, wgpu::Buffer, Allocation)>,
    groups: &[Group<'_>],
    params: &[&GpuTensor],
    grads: &[&GpuTensor],
    m: &[GpuTensor],
) -> Result<wgpu::Buffer> {
    let element = |region: Region<'_>, t: &GpuTensor| {
        (t.region().offset - region.offset) / std::mem::size_of::<f32>() as u64
    };
    let mut segments = Vec::with_capacity(params.len());
    for group in groups {
        let mut start = 0;
        let mut partial_start = group.partial_base;
        for i in group.first..group.end {
            let len = params[i].len();
            let offsets = [
                element(group.param, params[i]),
                element(group.grad, grads[i]),
                element(group.m, &m[i]),
            ];
            let [param, grad, moment] = offsets.map(|o| o as u32);
            segments.push(Segment {
                start: start as u32,
                partial_start: partial_start as u32,
                param,
                grad,
                moment,
                len: len as u32,
                pad: [0; 2],
            });
            start += len.div_ceil(RUN);
            partial_start += len.div_ceil(CHUNK);
        }
    }
    if let Some((_, buffer, _)) = tables.iter().find(|(s, _, _)| *s == segments) {
        return Ok(buffer.clone());
    }
    let bytes: &[u8] = bytemuck::cast_slice(&segments);
    let (buffer, allocation) = ctx.create_buffer(
        "optimizer table",
        bytes.len() as u64,
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
    )?;
    ctx.queue().write_buffer(&buffer, 0, bytes);
    if tables.len() == CACHED_TABLES {
        tables.remove(0);
    }
    tables.push((segments, buffer.clone(), allocation));
    Ok(buffer)
}

/// AdamW state for a fixed list of parameter tensors: first and second moments (allocated once), the
/// step count, the last step's `[grad norm, clip scale]` and the non-finite latch.
pub struct AdamW {
    config: AdamWConfig,
    shapes: Vec<Vec<usize>>,
    step: u32,
    m: Vec<GpuTensor>,
    v: Vec<GpuTensor>,
    tables: Vec<(Vec<Segment>, wgpu::Buffer, Allocation)>,
    partials: GpuTensor,
    norm: GpuTensor,
    /// `[first non-finite step or 0, what]` (u32; see `grad_norm_finalize.wgsl`).
    health: wgpu::Buffer,
    _health_allocation: Allocation,
    /// Mixed precision's loss scale ([`AdamW::enable_loss_scaling`]).
    loss_scale: Option<LossScale>,
}

impl AdamW {
    /// Zero moments for parameters shaped like `params`.
    pub fn new(ctx: &Context, config: AdamWConfig, params: &[&GpuTensor]) -> Result<Self> {
        for (arg, value) in [
            ("lr", config.lr),
            ("beta1", config.beta1),
            ("beta2", config.beta2),
            ("eps", config.eps),
            ("weight_decay", config.weight_decay),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(Error::shape(
                    arg,
                    format!("is {value}; it must be finite and >= 0"),
                ));
            }
        }
        if config.beta1 >= 1.0 || config.beta2 >= 1.0 {
            return Err(Error::shape("beta1/beta2", "must be below 1"));
        }
        let regions: Vec<_> = params.iter().map(|p| ("params", p.region())).collect();
        crate::kernels::arguments::check_context(ctx, &regions)?;
        if let Some(n) = config.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return Err(Error::shape(
                    "max_grad_norm",
                    format!("is {n}; it must be finite and positive"),
                ));
            }
        }
        if params.is_empty() {
            return Err(Error::shape("params", "is empty"));
        }
        let partials: usize = params.iter().map(|p| p.len().div_ceil(CHUNK)).sum();
        if let Some(budget) = ctx.loop_budget() {
            if partials > budget as usize {
                return Err(Error::Unsupported {
                    arg: "parameter elements / 256",
                    value: partials as u64,
                    limit: budget as u64,
                    hint: " on this driver (llvmpipe loop cap)",
                });
            }
        }
        let shapes: Vec<&[usize]> = params.iter().map(|p| p.shape()).collect();
        let (health, _health_allocation) = ctx.create_buffer(
            "optimizer health",
            8,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        )?;
        Ok(Self {
            health,
            _health_allocation,
            config,
            shapes: params.iter().map(|p| p.shape().to_vec()).collect(),
            step: 0,
            m: zeros_in_arenas(ctx, &shapes)?,
            v: zeros_in_arenas(ctx, &shapes)?,
            tables: Vec::new(),
            partials: GpuTensor::zeros(ctx, &[partials.max(1)])?,
            norm: GpuTensor::zeros(ctx, &[2])?,
            loss_scale: None,
        })
    }

    /// Mixed precision: from the next step on, the gradients are taken to be scaled by a loss
    /// scale starting at `config.initial_scale` (apply it with
    /// [`crate::kernels::cross_entropy::LossGradient::scaled`] and
    /// [`AdamW::loss_scale`]). Each step unscales them, a step whose gradient norm is not finite
    /// is skipped (parameters, moments and the bias corrections' step count unchanged) and halves
    /// the scale instead of latching, and the scale doubles after `config.growth_interval` clean
    /// steps. A non-finite loss still latches ([`AdamW::check_finite`]). Replaces an earlier scale.
    pub fn enable_loss_scaling(&mut self, ctx: &Context, config: LossScaling) -> Result<()> {
        self.loss_scale = Some(LossScale::new(ctx, config)?);
        Ok(())
    }

    /// The loss scale of mixed precision, if enabled ([`AdamW::enable_loss_scaling`]).
    pub fn loss_scale(&self) -> Option<&LossScale> {
        self.loss_scale.as_ref()
    }

    /// The hyper-parameters it steps with.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Sets the learning rate of the following steps (for schedules).
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::shape(
                "lr",
                format!("is {lr}; it must be finite and >= 0"),
            ));
        }
        self.config.lr = lr;
        Ok(())
    }

    /// Steps taken so far (the `t` of the bias correction).
    pub fn steps(&self) -> u32 {
        self.step
    }

    /// First and second moments, in parameter order (for checkpoints).
    pub fn moments(&self) -> (&[GpuTensor], &[GpuTensor]) {
        (&self.m, &self.v)
    }

    /// Restores the step count (moments are written through [`AdamW::moments`]) and clears the
    /// non-finite latch: what a checkpoint load does.
    pub fn set_steps(&mut self, ctx: &Context, steps: u32) -> Result<()> {
        ctx.check_lost()?;
        ctx.queue()
            .write_buffer(&self.health, 0, bytemuck::bytes_of(&[0u32; 2]));
        self.step = steps;
        Ok(())
    }

    /// `Err(`[`Error::NonFinite`]`)` naming the first step whose gradient norm or guarded loss was
    /// not finite; from that step on the optimizer has changed nothing. Reads 8 bytes back, so it
    /// waits for the submitted steps: call it where the loss is read anyway and before saving.
    pub fn check_finite(&self, ctx: &Context) -> Result<()> {
        crate::device::block_on("AdamW::check_finite", self.check_finite_async(ctx))
    }

    /// Async form of [`AdamW::check_finite`] (what a browser must use).
    pub async fn check_finite_async(&self, ctx: &Context) -> Result<()> {
        let words = crate::tensor::read_buffer(ctx, &self.health, 0, 2).await?;
        let [step, what] = [words[0].to_bits(), words[1].to_bits()];
        if step == 0 {
            return Ok(());
        }
        Err(Error::NonFinite {
            step,
            last_good: step - 1,
            what: match what {
                1 => "gradient norm",
                2 => "loss",
                _ => "loss and gradient norm",
            },
        })
    }

    /// `[global gradient norm, clip scale]` of the last step, on the GPU.
    pub fn grad_norm(&self) -> &GpuTensor {
        &self.norm
    }

    /// Records one step: the global gradient norm and clip scale, then every parameter's update.
    /// Nothing is recorded if the tensors do not match the ones the optimizer was built for.
    pub fn step_into(
        &mut self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        params: &[&GpuTensor],
        grads: &[&GpuTensor],
    ) -> Result<()> {
        self.record_step(ctx, encoder, params, grads, None)
    }

    /// [`AdamW::step_into`] that also skips the update (and latches, see [`AdamW::check_finite`])
    /// when a value of `loss` is not finite.
    pub fn step_into_guarded(
        &mut self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        params: &[&GpuTensor],
        grads: &[&GpuTensor],
        loss: &GpuTensor,
    ) -> Result<()> {
        self.record_step(ctx, encoder, params, grads, Some(loss))
    }

    /// Records [`AdamW::step_into_guarded`] for ahead-of-time compilation: the recording is never
    /// submitted, so the step count is left as it was.
    pub fn record_unsubmitted_step(
        &mut self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        params: &[&GpuTensor],
        grads: &[&GpuTensor],
        loss: &GpuTensor,
    ) -> Result<()> {
        let step = self.step;
        let recorded = self.record_step(ctx, encoder, params, grads, Some(loss));
        self.step = step;
        recorded
    }

    fn record_step(
        &mut self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        params: &[&GpuTensor],
        grads: &[&GpuTensor],
        loss: Option<&GpuTensor>,
    ) -> Result<()> {
        let regions: Vec<_> = (params.iter().map(|p| ("params", p.region())))
            .chain(grads.iter().map(|g| ("grads", g.region())))
            .chain(loss.map(|l| ("loss", l.region())))
            .collect();
        crate::kernels::arguments::check_context(ctx, &regions)?;
        if params.len() != self.shapes.len() || grads.len() != self.shapes.len() {
            return Err(Error::shape(
                "params/grads",
                format!(
                    "{} params and {} grads for an optimizer of {} tensors",
                    params.len(),
                    grads.len(),
                    self.shapes.len()
                ),
            ));
        }
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            if p.shape() != self.shapes[i] || g.shape() != self.shapes[i] {
                return Err(Error::shape(
                    "params/grads",
                    format!(
                        "tensor {i}: param {:?}, grad {:?}, expected {:?}",
                        p.shape(),
                        g.shape(),
                        self.shapes[i]
                    ),
                ));
            }
            // The update binds the parameters writable and the gradients read-only: one buffer
            // cannot be both in a dispatch, even at disjoint ranges.
            if p.buffer() == g.buffer() {
                return Err(Error::shape(
                    "grads",
                    format!("tensor {i} shares the parameter's buffer; keep gradients in another"),
                ));
            }
            if let Some(k) = params[..i].iter().position(|q| q.overlaps(p)) {
                return Err(Error::shape(
                    "params",
                    format!("tensors {k} and {i} overlap; each would be updated twice"),
                ));
            }
        }
        let groups = groups(ctx, params, grads, [&self.m, &self.v]);
        let table = table(ctx, &mut self.tables, &groups, params, grads, &self.m)?;
        // Every dispatch's grid before the step is counted or anything recorded.
        for group in &groups {
            grid_x(ctx, group.partials.max(group.runs))?;
        }
        self.step += 1;
        let c = &self.config;
        // The partial sums of every group, the norm, then the updates of every group (in the
        // caller's pass where it records one; wgpu orders the dispatches that share a buffer).
        let mut pass = ctx.begin_pass(encoder, "grad_norm_partial");
        for group in &groups {
            let p = PartialParams {
                first: group.first as u32,
                count: (group.end - group.first) as u32,
                partials: group.partials as u32,
                partial_base: group.partial_base as u32,
                grid_x: grid_x(ctx, group.partials)?,
                pad: [0; 3],
            };
            encode_in(
                ctx,
                &mut pass,
                SimpleKernel {
                    name: "grad_norm_partial",
                    source: NORM_PARTIAL,
                    constants: &[("CHUNK", CHUNK as u32)],
                },
                bytemuck::bytes_of(&p),
                &[&table, &group.grad, &self.partials],
                group.partials,
            )?;
        }
        drop(pass);
        let partials: usize = groups.iter().map(|g| g.partials).sum();
        let f = FinalizeParams {
            partials: partials as u32,
            clip: c.max_grad_norm.is_some() as u32,
            max_norm: c.max_grad_norm.unwrap_or(0.0),
            step: self.step,
            watched: loss.map_or(0, |l| l.len() as u32),
            growth_interval: self
                .loss_scale
                .as_ref()
                .map_or(0, |s| s.config().growth_interval),
            pad: [0; 2],
        };
        let scaling = self.loss_scale.as_ref().map(LossScale::buffer);
        let scaled = [("LOSS_SCALING", scaling.is_some() as u32)];
        encode(
            ctx,
            encoder,
            SimpleKernel {
                name: "grad_norm_finalize",
                source: NORM_FINALIZE,
                constants: &scaled,
            },
            bytemuck::bytes_of(&f),
            &[
                &self.partials,
                &self.norm,
                loss.unwrap_or(&self.partials),
                &self.health,
                scaling.unwrap_or(ctx.empty_storage_rw(0)),
            ],
            1,
        )?;
        let t = self.step as f64;
        let mut pass = ctx.begin_pass(encoder, "adamw");
        for group in &groups {
            let a = AdamParams {
                first: group.first as u32,
                count: (group.end - group.first) as u32,
                runs: group.runs as u32,
                grid_x: grid_x(ctx, group.runs)?,
                lr: c.lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: c.weight_decay,
                correction1: (1.0 - (c.beta1 as f64).powf(t)) as f32,
                correction2: (1.0 - (c.beta2 as f64).powf(t)) as f32,
                step: self.step,
            };
            encode_in(
                ctx,
                &mut pass,
                SimpleKernel {
                    name: "adamw",
                    source: ADAMW,
                    constants: &[("RUN", RUN as u32), scaled[0]],
                },
                bytemuck::bytes_of(&a),
                &[
                    &table,
                    &group.param,
                    &group.grad,
                    &group.m,
                    &group.v,
                    &self.norm,
                    &self.health,
                    scaling.unwrap_or(ctx.empty_storage()),
                ],
                group.runs,
            )?;
        }
        Ok(())
    }

    /// One step, submitted.
    pub fn step(
        &mut self,
        ctx: &Context,
        params: &[&GpuTensor],
        grads: &[&GpuTensor],
    ) -> Result<()> {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        self.step_into(ctx, &mut encoder, params, grads)?;
        ctx.submit(encoder)?;
        Ok(())
    }
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    vec![
        uniform_layout!(
            "grad_norm_partial",
            "Params",
            PartialParams {
                first,
                count,
                partials,
                partial_base,
                grid_x,
                pad
            }
        ),
        uniform_layout!(
            "grad_norm_finalize",
            "Params",
            FinalizeParams {
                partials,
                clip,
                max_norm,
                step,
                watched,
                growth_interval,
                pad
            }
        ),
        uniform_layout!(
            "adamw",
            "Params",
            AdamParams {
                first,
                count,
                runs,
                grid_x,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                correction1,
                correction2,
                step,
            }
        ),
        uniform_layout!(
            "adamw",
            "Segment",
            Segment {
                start,
                partial_start,
                param,
                grad,
                moment,
                len,
                pad
            }
        ),
    ]
}
