//! Position-wise feed-forward block `FF(x) = GELU(x W1^T + b1) W2^T + b2`, with its activations
//! allocated once for a `[batch, seq, d_model]` input. The GELU and its backward run in the GEMMs'
//! epilogues, and so does an optional residual added to the output (and to the input gradient).

use crate::device::Context;
use crate::error::Result;
use crate::kernels::elementwise::Activation;
use crate::kernels::linear::Epilogue;
use crate::layers::linear::Linear;
use crate::layers::params::Params;
use crate::tensor::GpuTensor;

/// `FFN(x) = GELU(x W1^T + b1) W2^T + b2`, with its backward.
pub struct FeedForward {
    /// `W1 [d_ff, d_model]`, `b1`.
    pub input: Linear,
    /// `W2 [d_model, d_ff]`, `b2`.
    pub output: Linear,
    /// `x W1^T + b1` and its GELU, `[batch, seq, d_ff]`.
    hidden: GpuTensor,
    act: GpuTensor,
    d_hidden: GpuTensor,
}

impl FeedForward {
    /// Adds `{name}.input.*` and `{name}.output.*` and allocates the hidden buffers for `rows =
    /// [batch, seq]`.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        d_model: usize,
        d_ff: usize,
        rows: [usize; 2],
    ) -> Result<Self> {
        let shape = [rows[0], rows[1], d_ff];
        Ok(Self {
            input: Linear::new(ctx, params, &format!("{name}.in"), d_model, d_ff)?,
            output: Linear::new(ctx, params, &format!("{name}.out"), d_ff, d_model)?,
            hidden: GpuTensor::zeros(ctx, &shape)?,
            act: GpuTensor::zeros(ctx, &shape)?,
            d_hidden: GpuTensor::zeros(ctx, &shape)?,
        })
    }

    /// `y = FF(x) + residual`.
    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        y: &GpuTensor,
        residual: Option<&GpuTensor>,
    ) -> Result<()> {
        let gelu = Epilogue {
            activation: Some((Activation::Gelu, &self.hidden)),
            residual: None,
        };
        self.input
            .forward_epilogue(ctx, encoder, p, x, gelu, &self.act)?;
        let add = Epilogue {
            activation: None,
            residual,
        };
        self.output
            .forward_epilogue(ctx, encoder, p, &self.act, add, y)
    }

    /// `dx = dFF(dy) + residual` and the parameter gradients.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        dy: &GpuTensor,
        dx: &GpuTensor,
        residual: Option<&GpuTensor>,
    ) -> Result<()> {
        let gelu_grad = Epilogue {
            activation: Some((Activation::Gelu, &self.hidden)),
            residual: None,
        };
        self.output
            .backward_epilogue(ctx, encoder, p, &self.act, dy, &self.d_hidden, gelu_grad)?;
        let add = Epilogue {
            activation: None,
            residual,
        };
        self.input
            .backward_epilogue(ctx, encoder, p, x, &self.d_hidden, dx, add)
    }
}
