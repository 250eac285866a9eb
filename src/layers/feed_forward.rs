//! Position-wise feed-forward block `FF(x) = GELU(x W1^T + b1) W2^T + b2`, with its activations
//! allocated once for a `[batch, seq, d_model]` input.

use crate::device::Context;
use crate::error::Result;
use crate::kernels::elementwise::{activation_backward_into, activation_forward_into, Activation};
use crate::layers::linear::Linear;
use crate::layers::params::Params;
use crate::tensor::GpuTensor;

pub struct FeedForward {
    pub input: Linear,
    pub output: Linear,
    /// `x W1^T + b1` and its GELU, `[batch, seq, d_ff]`.
    hidden: GpuTensor,
    act: GpuTensor,
    d_act: GpuTensor,
    d_hidden: GpuTensor,
}

impl FeedForward {
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
            d_act: GpuTensor::zeros(ctx, &shape)?,
            d_hidden: GpuTensor::zeros(ctx, &shape)?,
        })
    }

    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        y: &GpuTensor,
    ) -> Result<()> {
        self.input.forward(ctx, encoder, p, x, &self.hidden)?;
        activation_forward_into(ctx, encoder, Activation::Gelu, &self.hidden, &self.act)?;
        self.output.forward(ctx, encoder, p, &self.act, y)
    }

    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        dy: &GpuTensor,
        dx: &GpuTensor,
    ) -> Result<()> {
        self.output
            .backward(ctx, encoder, p, &self.act, dy, &self.d_act)?;
        activation_backward_into(
            ctx,
            encoder,
            Activation::Gelu,
            &self.hidden,
            &self.d_act,
            &self.d_hidden,
        )?;
        self.input.backward(ctx, encoder, p, x, &self.d_hidden, dx)
    }
}
