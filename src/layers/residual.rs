//! A residual sub-block with its LayerNorm, pre-LN or post-LN, around any sublayer `F`
//! (attention or feed-forward):
//!
//! ```text
//! pre-LN:  y = x + F(LN(x))        dx = dy + LN'(dF(dy))
//! post-LN: y = LN(x + F(x))        ds = LN'(dy),  dx = ds + dF(ds)
//! ```
//!
//! The block owns its output `y`, its input gradient `dx` and the activations its backward reads,
//! allocated once for a `[batch, seq, d_model]` input.

use crate::device::Context;
use crate::error::Result;
use crate::kernels::elementwise::add_into;
use crate::kernels::layer_norm::{layer_norm_backward_into, layer_norm_forward_into};
use crate::layers::params::{Init, ParamId, Params};
use crate::tensor::GpuTensor;

pub const LN_EPS: f32 = 1e-5;

/// LayerNorm parameters `{name}.gamma` (ones) and `{name}.beta` (zeros).
pub struct LayerNorm {
    pub gamma: ParamId,
    pub beta: ParamId,
}

impl LayerNorm {
    pub fn new(ctx: &Context, params: &mut Params, name: &str, d_model: usize) -> Result<Self> {
        Ok(Self {
            gamma: params.add(ctx, format!("{name}.gamma"), &[d_model], Init::Ones)?,
            beta: params.add(ctx, format!("{name}.beta"), &[d_model], Init::Zeros)?,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        y: &GpuTensor,
        stats: &GpuTensor,
    ) -> Result<()> {
        let (g, b) = (p.value(self.gamma), p.value(self.beta));
        layer_norm_forward_into(ctx, encoder, x, g, b, LN_EPS, y, stats)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        stats: &GpuTensor,
        dy: &GpuTensor,
        dx: &GpuTensor,
    ) -> Result<()> {
        layer_norm_backward_into(
            ctx,
            encoder,
            x,
            p.value(self.gamma),
            stats,
            dy,
            dx,
            p.grad(self.gamma),
            p.grad(self.beta),
        )
    }
}

pub struct Residual {
    pre_ln: bool,
    pub norm: LayerNorm,
    /// Pre-LN: `LN(x)`, the sublayer's input. Post-LN: `x + F(x)`, what LN normalises.
    mid: GpuTensor,
    stats: GpuTensor,
    /// `F(..)`.
    sub_out: GpuTensor,
    /// The block's output and input gradient.
    pub y: GpuTensor,
    pub dx: GpuTensor,
    /// Gradients at the sublayer's input and at the LayerNorm's input / output side.
    d_sub_in: GpuTensor,
    d_mid: GpuTensor,
}

impl Residual {
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        d_model: usize,
        rows: [usize; 2],
        pre_ln: bool,
    ) -> Result<Self> {
        let shape = [rows[0], rows[1], d_model];
        let t = || GpuTensor::zeros(ctx, &shape);
        Ok(Self {
            pre_ln,
            norm: LayerNorm::new(ctx, params, name, d_model)?,
            mid: t()?,
            stats: GpuTensor::zeros(ctx, &[rows[0] * rows[1], 2])?,
            sub_out: t()?,
            y: t()?,
            dx: t()?,
            d_sub_in: t()?,
            d_mid: t()?,
        })
    }

    /// Records the block for input `x`; `sublayer(encoder, input, output)` records `F`.
    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        sublayer: impl FnOnce(&mut wgpu::CommandEncoder, &GpuTensor, &GpuTensor) -> Result<()>,
    ) -> Result<()> {
        if self.pre_ln {
            self.norm
                .forward(ctx, encoder, p, x, &self.mid, &self.stats)?;
            sublayer(encoder, &self.mid, &self.sub_out)?;
            add_into(ctx, encoder, x, &self.sub_out, &self.y)
        } else {
            sublayer(encoder, x, &self.sub_out)?;
            add_into(ctx, encoder, x, &self.sub_out, &self.mid)?;
            self.norm
                .forward(ctx, encoder, p, &self.mid, &self.y, &self.stats)
        }
    }

    /// Records the backward for upstream `dy` into [`Residual::dx`];
    /// `sublayer_backward(encoder, input, d_output, d_input)` records `F`'s backward.
    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        dy: &GpuTensor,
        sublayer_backward: impl FnOnce(
            &mut wgpu::CommandEncoder,
            &GpuTensor,
            &GpuTensor,
            &GpuTensor,
        ) -> Result<()>,
    ) -> Result<()> {
        if self.pre_ln {
            sublayer_backward(encoder, &self.mid, dy, &self.d_sub_in)?;
            self.norm
                .backward(ctx, encoder, p, x, &self.stats, &self.d_sub_in, &self.d_mid)?;
            add_into(ctx, encoder, dy, &self.d_mid, &self.dx)
        } else {
            self.norm
                .backward(ctx, encoder, p, &self.mid, &self.stats, dy, &self.d_mid)?;
            sublayer_backward(encoder, x, &self.d_mid, &self.d_sub_in)?;
            add_into(ctx, encoder, &self.d_mid, &self.d_sub_in, &self.dx)
        }
    }
}
