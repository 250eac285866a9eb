//! Position-wise feed-forward block, plain `FF(x) = act(x W1^T + b1) W2^T + b2` (GELU in "Attention Is
//! All You Need" and GPT-2) or gated `FF(x) = (act(x Wg^T) * (x Wu^T)) W2^T` (SwiGLU in LLaMA, GeGLU),
//! with its activations allocated once for a `[batch, seq, d_model]` input. The plain activation and
//! its backward run in the GEMMs' epilogues, and so does an optional residual added to the output (and
//! to the input gradient). The gated block's gate and up projections are one GEMM (`{name}.in`,
//! `[2 d_ff, d_model]`, gate rows first) followed by the gated activation kernel.

use crate::layers::linear::Linear;
use crate::layers::params::Params;
use crate::layers::{InputGrad, Recording};
use wgpu_attention::device::Context;
use wgpu_attention::error::Result;
use wgpu_attention::kernels::elementwise::{
    gated_activation_backward_into, gated_activation_forward_into, Activation,
};
use wgpu_attention::kernels::linear::Epilogue;
use wgpu_attention::tensor::GpuTensor;

/// The kind of feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FeedForwardConfig {
    /// The nonlinearity (of the gate, when gated).
    pub activation: Activation,
    /// Gated (GLU family): `act(gate) * up`.
    pub gated: bool,
}

wgpu_attention::config_setters!(FeedForwardConfig {
    activation: Activation,
    gated: bool,
});

impl Default for FeedForwardConfig {
    /// Plain GELU.
    fn default() -> Self {
        Self {
            activation: Activation::Gelu,
            gated: false,
        }
    }
}

/// A feed-forward block with its backward.
pub struct FeedForward {
    /// `W1 [d_ff, d_model]` (gated: `[Wg; Wu]`, `[2 d_ff, d_model]`), `b1`.
    pub input: Linear,
    /// `W2 [d_model, d_ff]`, `b2`.
    pub output: Linear,
    config: FeedForwardConfig,
    /// `x W1^T + b1` (`[batch, seq, d_ff]`; gated `[.., 2 d_ff]`), its activation `[.., d_ff]`,
    /// and the gradient at the former.
    hidden: GpuTensor,
    act: GpuTensor,
    d_hidden: GpuTensor,
    /// Gated only: the gradient at the activation, `[.., d_ff]`.
    d_act: Option<GpuTensor>,
}

impl FeedForward {
    /// Adds `{name}.in.*` and `{name}.out.*` (biases if `bias`) for widths `[d_model, d_ff]` and
    /// allocates the hidden buffers for `rows = [batch, seq]`.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        [d_model, d_ff]: [usize; 2],
        rows: [usize; 2],
        config: FeedForwardConfig,
        bias: bool,
    ) -> Result<Self> {
        let width = if config.gated { 2 * d_ff } else { d_ff };
        let shape = [rows[0], rows[1], width];
        let act_shape = [rows[0], rows[1], d_ff];
        Ok(Self {
            input: Linear::with_bias(ctx, params, &format!("{name}.in"), d_model, width, bias)?,
            output: Linear::with_bias(ctx, params, &format!("{name}.out"), d_ff, d_model, bias)?,
            config,
            hidden: GpuTensor::zeros(ctx, &shape)?,
            act: GpuTensor::zeros(ctx, &act_shape)?,
            d_hidden: GpuTensor::zeros(ctx, &shape)?,
            d_act: config
                .gated
                .then(|| GpuTensor::zeros(ctx, &act_shape))
                .transpose()?,
        })
    }

    /// `y = FF(x) + residual`.
    pub fn forward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        y: &GpuTensor,
        residual: Option<&GpuTensor>,
    ) -> Result<()> {
        let ctx = rec.ctx;
        let kind = self.config.activation;
        if self.config.gated {
            self.input.forward(rec, x, &self.hidden)?;
            gated_activation_forward_into(ctx, rec.encoder, kind, &self.hidden, &self.act)?;
        } else {
            let act = Epilogue {
                activation: Some((kind, &self.hidden)),
                residual: None,
            };
            self.input.forward_epilogue(rec, x, act, &self.act)?;
        }
        let add = Epilogue {
            activation: None,
            residual,
        };
        self.output.forward_epilogue(rec, &self.act, add, y)
    }

    /// `dx = dFF(dy) + residual` ([`InputGrad`]) and the parameter gradients.
    pub fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        grad: InputGrad<'_>,
    ) -> Result<()> {
        let InputGrad { dy, dx, residual } = grad;
        let ctx = rec.ctx;
        let kind = self.config.activation;
        match &self.d_act {
            Some(d_act) => {
                self.output.backward(rec, &self.act, dy, d_act)?;
                gated_activation_backward_into(
                    ctx,
                    rec.encoder,
                    kind,
                    &self.hidden,
                    d_act,
                    &self.d_hidden,
                )?;
            }
            None => {
                let act_grad = Epilogue {
                    activation: Some((kind, &self.hidden)),
                    residual: None,
                };
                self.output
                    .backward_epilogue(rec, &self.act, dy, &self.d_hidden, act_grad)?;
            }
        }
        let add = Epilogue {
            activation: None,
            residual,
        };
        self.input
            .backward_epilogue(rec, x, &self.d_hidden, dx, add)
    }
}
