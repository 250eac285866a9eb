//! A residual sub-block with its LayerNorm, pre-LN or post-LN, around any sublayer `F`
//! (attention or feed-forward):
//!
//! ```text
//! pre-LN:  y = x + F(LN(x))        dx = dy + LN'(dF(dy))
//! post-LN: y = LN(x + F(x))        ds = LN'(dy),  dx = ds + dF(ds)
//! ```
//!
//! The block owns its output `y`, its input gradient `dx` and the activations its backward reads,
//! allocated once for a `[batch, seq, d_model]` input. The residual sums run in the epilogues of the
//! sublayer's GEMMs and of the LayerNorm backward, not in passes of their own.

use crate::layers::params::{Init, ParamId, Params};
use crate::layers::{InputGrad, Recording};
use wgpu_attention::device::Context;
use wgpu_attention::error::Result;
use wgpu_attention::kernels::layer_norm::{
    layer_norm_backward_add_into, layer_norm_forward_into, rms_norm_backward_add_into,
    rms_norm_forward_into,
};
pub use wgpu_attention::spec::Norm;
use wgpu_attention::tensor::GpuTensor;

/// LayerNorm's epsilon (SPEC.md).
pub const LN_EPS: f32 = 1e-5;

/// Which normalisation a block uses, and its epsilon.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct NormConfig {
    /// LayerNorm or RMSNorm.
    pub kind: Norm,
    /// Added to the variance (or mean square) under the square root.
    pub eps: f32,
}

wgpu_attention::config_setters!(NormConfig {
    kind: Norm,
    eps: f32,
});

impl Default for NormConfig {
    /// LayerNorm with [`LN_EPS`].
    fn default() -> Self {
        Self {
            kind: Norm::LayerNorm,
            eps: LN_EPS,
        }
    }
}

/// LayerNorm parameters `{name}.gamma` (ones) and `{name}.beta` (zeros); RMSNorm has no `beta`.
pub struct LayerNorm {
    /// The scale, ones at first.
    pub gamma: ParamId,
    /// The shift, zeros at first; `None` for RMSNorm.
    pub beta: Option<ParamId>,
    eps: f32,
}

impl LayerNorm {
    /// Adds `{name}.gamma` and `{name}.beta` of `d_model` elements.
    pub fn new(ctx: &Context, params: &mut Params, name: &str, d_model: usize) -> Result<Self> {
        Self::with_config(ctx, params, name, d_model, NormConfig::default())
    }

    /// Adds `{name}.gamma` (and `{name}.beta` for LayerNorm) of `d_model` elements.
    pub fn with_config(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        d_model: usize,
        norm: NormConfig,
    ) -> Result<Self> {
        Ok(Self {
            gamma: params.add(ctx, format!("{name}.gamma"), &[d_model], Init::Ones)?,
            beta: match norm.kind {
                Norm::LayerNorm => {
                    Some(params.add(ctx, format!("{name}.beta"), &[d_model], Init::Zeros)?)
                }
                Norm::RmsNorm => None,
            },
            eps: norm.eps,
        })
    }

    /// Records `y = LN(x)`, keeping the row statistics in `stats`.
    pub fn forward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        y: &GpuTensor,
        stats: &GpuTensor,
    ) -> Result<()> {
        let Recording { ctx, params: p, .. } = *rec;
        let g = p.value(self.gamma);
        match self.beta {
            Some(b) => {
                layer_norm_forward_into(ctx, rec.encoder, x, [g, p.value(b)], self.eps, [y, stats])
            }
            None => rms_norm_forward_into(ctx, rec.encoder, x, g, self.eps, [y, stats]),
        }
    }

    /// `dx = LN'(dy) + residual` and the parameter gradients.
    pub fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        stats: &GpuTensor,
        dy: &GpuTensor,
        residual: Option<&GpuTensor>,
        dx: &GpuTensor,
    ) -> Result<()> {
        let Recording { ctx, params: p, .. } = *rec;
        let gamma = p.value(self.gamma);
        let d_gamma = p.grad(self.gamma);
        match self.beta {
            Some(b) => {
                let grads = [dx, d_gamma, p.grad(b)];
                layer_norm_backward_add_into(
                    ctx,
                    rec.encoder,
                    x,
                    gamma,
                    stats,
                    (dy, residual),
                    grads,
                )
            }
            None => {
                let grads = [dx, d_gamma];
                rms_norm_backward_add_into(ctx, rec.encoder, x, gamma, stats, (dy, residual), grads)
            }
        }
    }
}

/// A sublayer with its residual connection and LayerNorm: pre-LN `y = x + F(LN(x))` or post-LN `y =
/// LN(x + F(x))`.
pub struct Residual {
    pre_ln: bool,
    /// The block's LayerNorm.
    pub norm: LayerNorm,
    /// Pre-LN: `LN(x)`, the sublayer's input. Post-LN: `x + F(x)`, what LN normalises.
    mid: GpuTensor,
    stats: GpuTensor,
    /// The block's output and input gradient.
    pub y: GpuTensor,
    /// The gradient at the block's input.
    pub dx: GpuTensor,
    /// Pre-LN: the gradient at the sublayer's input. Post-LN: at the LayerNorm's input.
    d_mid: GpuTensor,
}

impl Residual {
    /// Adds the norm's parameters under `name` and allocates the block's buffers for `rows =
    /// [batch, seq]`.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        d_model: usize,
        rows: [usize; 2],
        pre_ln: bool,
        norm: NormConfig,
    ) -> Result<Self> {
        let shape = [rows[0], rows[1], d_model];
        let t = || GpuTensor::zeros(ctx, &shape);
        Ok(Self {
            pre_ln,
            norm: LayerNorm::with_config(ctx, params, name, d_model, norm)?,
            mid: t()?,
            stats: GpuTensor::zeros(ctx, &[rows[0] * rows[1], 2])?,
            y: t()?,
            dx: t()?,
            d_mid: t()?,
        })
    }

    /// Records the block for input `x`; `sublayer(rec, input, output, residual)` records
    /// `output = F(input) + residual` (the residual sum in `F`'s last GEMM, not a pass of its own).
    pub fn forward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        sublayer: impl FnOnce(&mut Recording<'_>, &GpuTensor, &GpuTensor, &GpuTensor) -> Result<()>,
    ) -> Result<()> {
        if self.pre_ln {
            self.norm.forward(rec, x, &self.mid, &self.stats)?;
            sublayer(rec, &self.mid, &self.y, x)
        } else {
            sublayer(rec, x, &self.mid, x)?;
            self.norm.forward(rec, &self.mid, &self.y, &self.stats)
        }
    }

    /// Records the backward for upstream `dy` into [`Residual::dx`];
    /// `sublayer_backward(rec, input, grad)` records the sublayer's [`InputGrad`].
    pub fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        dy: &GpuTensor,
        sublayer_backward: impl FnOnce(&mut Recording<'_>, &GpuTensor, InputGrad<'_>) -> Result<()>,
    ) -> Result<()> {
        if self.pre_ln {
            // dx = dy + LN'(dF(dy)): the sum in the LayerNorm backward.
            let grad = InputGrad {
                dy,
                dx: &self.d_mid,
                residual: None,
            };
            sublayer_backward(rec, &self.mid, grad)?;
            self.norm
                .backward(rec, x, &self.stats, &self.d_mid, Some(dy), &self.dx)
        } else {
            // dx = ds + dF(ds), ds = LN'(dy): the sum in the sublayer's input-gradient GEMM.
            self.norm
                .backward(rec, &self.mid, &self.stats, dy, None, &self.d_mid)?;
            let grad = InputGrad {
                dy: &self.d_mid,
                dx: &self.dx,
                residual: Some(&self.d_mid),
            };
            sublayer_backward(rec, x, grad)
        }
    }
}
