//! AdamW with bias correction and optional global-norm gradient clipping (SPEC.md):
//! `shaders/grad_norm_{partial,finalize}.wgsl` compute the norm of all gradients and the clip scale
//! on the GPU in a fixed order; `shaders/adamw.wgsl` updates each parameter with its moments.
//! CPU reference: [`crate::reference::optimizer`].
//!
//! Non-finite guard: the first step whose gradient norm (or the loss, with
//! [`AdamW::step_into_guarded`]) is Inf or NaN is latched on the GPU, and from it on every update
//! is skipped, so the parameters stay those of the last good step without a readback per step;
//! [`AdamW::check_finite`] reports it.

use crate::device::{Allocation, Context};
use crate::error::{Error, Result};
use crate::kernels::dispatch::{encode, encode_in, grid_x};
use crate::tensor::GpuTensor;

const NORM_PARTIAL: &str = include_str!("../../shaders/grad_norm_partial.wgsl");
const NORM_FINALIZE: &str = include_str!("../../shaders/grad_norm_finalize.wgsl");
const ADAMW: &str = include_str!("../../shaders/adamw.wgsl");
/// Elements each invocation of the partial-norm kernel sums (`CHUNK` in the shader).
const CHUNK: usize = 256;

/// The optimizer shaders by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![
        ("grad_norm_partial", NORM_PARTIAL.to_string()),
        ("grad_norm_finalize", NORM_FINALIZE.to_string()),
        ("adamw", ADAMW.to_string()),
    ]
}

/// AdamW hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip the global gradient norm to this value; `None` does not clip.
    pub max_grad_norm: Option<f32>,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: None,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct PartialParams {
    len: u32,
    partial_offset: u32,
    grid_x: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct FinalizeParams {
    partials: u32,
    clip: u32,
    max_norm: f32,
    step: u32,
    watched: u32,
    pad: [u32; 3],
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AdamParams {
    len: u32,
    grid_x: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    correction1: f32,
    correction2: f32,
    pad: [u32; 3],
}

/// AdamW state for a fixed list of parameter tensors: first and second moments (allocated once), the
/// step count, the last step's `[grad norm, clip scale]` and the non-finite latch.
pub struct AdamW {
    config: AdamWConfig,
    shapes: Vec<Vec<usize>>,
    step: u32,
    m: Vec<GpuTensor>,
    v: Vec<GpuTensor>,
    partials: GpuTensor,
    norm: GpuTensor,
    /// `[first non-finite step or 0, what]` (u32; see `grad_norm_finalize.wgsl`).
    health: wgpu::Buffer,
    _health_allocation: Allocation,
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
            m: params
                .iter()
                .map(|p| GpuTensor::zeros(ctx, p.shape()))
                .collect::<Result<_>>()?,
            v: params
                .iter()
                .map(|p| GpuTensor::zeros(ctx, p.shape()))
                .collect::<Result<_>>()?,
            partials: GpuTensor::zeros(ctx, &[partials.max(1)])?,
            norm: GpuTensor::zeros(ctx, &[2])?,
        })
    }

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
        let words = pollster::block_on(crate::tensor::read_buffer(ctx, &self.health, 0, 2))?;
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

    fn record_step(
        &mut self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        params: &[&GpuTensor],
        grads: &[&GpuTensor],
        loss: Option<&GpuTensor>,
    ) -> Result<()> {
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
            if p.buffer() == g.buffer() {
                return Err(Error::shape(
                    "grads",
                    format!("tensor {i} shares the parameter's buffer"),
                ));
            }
        }
        self.step += 1;
        let c = &self.config;
        // One pass for the partial sums of every tensor and one for every update: the dispatches
        // of a pass touch disjoint buffers, so none waits for another.
        let mut offset = 0usize;
        let mut pass = ctx.begin_pass(encoder, "grad_norm_partial");
        for g in grads {
            let partials = g.len().div_ceil(CHUNK);
            let p = PartialParams {
                len: g.len() as u32,
                partial_offset: offset as u32,
                grid_x: grid_x(partials),
                pad: 0,
            };
            encode_in(
                ctx,
                &mut pass,
                "grad_norm_partial",
                NORM_PARTIAL,
                &[("CHUNK", CHUNK as u32)],
                bytemuck::bytes_of(&p),
                &[*g, &self.partials],
                partials,
            );
            offset += partials;
        }
        drop(pass);
        let f = FinalizeParams {
            partials: offset as u32,
            clip: c.max_grad_norm.is_some() as u32,
            max_norm: c.max_grad_norm.unwrap_or(0.0),
            step: self.step,
            watched: loss.map_or(0, |l| l.len() as u32),
            pad: [0; 3],
        };
        encode(
            ctx,
            encoder,
            "grad_norm_finalize",
            NORM_FINALIZE,
            &[],
            bytemuck::bytes_of(&f),
            &[
                &self.partials,
                &self.norm,
                loss.unwrap_or(&self.partials),
                &self.health,
            ],
            1,
        );
        let t = self.step as f64;
        let mut pass = ctx.begin_pass(encoder, "adamw");
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let a = AdamParams {
                len: p.len() as u32,
                grid_x: grid_x(p.len()),
                lr: c.lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: c.weight_decay,
                correction1: (1.0 - (c.beta1 as f64).powf(t)) as f32,
                correction2: (1.0 - (c.beta2 as f64).powf(t)) as f32,
                pad: [0; 3],
            };
            encode_in(
                ctx,
                &mut pass,
                "adamw",
                ADAMW,
                &[],
                bytemuck::bytes_of(&a),
                &[*p, *g, &self.m[i], &self.v[i], &self.norm, &self.health],
                p.len(),
            );
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
