//! Linear layer `y = x W^T + b`: parameters in a [`Params`] store, recorded with
//! [`crate::kernels::linear`]. Weights start uniform in `+-1/sqrt(in)`, biases at zero.

use crate::device::Context;
use crate::error::Result;
use crate::kernels::linear::{linear_backward_into, linear_forward_into, LinearGrads};
use crate::layers::params::{Init, ParamId, Params};
use crate::tensor::GpuTensor;

pub struct Linear {
    pub weight: ParamId,
    pub bias: ParamId,
}

impl Linear {
    /// Adds `{name}.weight [out, in]` and `{name}.bias [out]`.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        in_features: usize,
        out_features: usize,
    ) -> Result<Self> {
        let bound = 1.0 / (in_features as f32).sqrt();
        Ok(Self {
            weight: params.add(
                ctx,
                format!("{name}.weight"),
                &[out_features, in_features],
                Init::Uniform(bound),
            )?,
            bias: params.add(ctx, format!("{name}.bias"), &[out_features], Init::Zeros)?,
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
        let (w, b) = (p.value(self.weight), p.value(self.bias));
        linear_forward_into(ctx, encoder, x, w, Some(b), y)
    }

    /// Writes `dx` and the weight and bias gradients.
    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        dy: &GpuTensor,
        dx: &GpuTensor,
    ) -> Result<()> {
        let grads = LinearGrads {
            dx: dx.clone(),
            d_weight: p.grad(self.weight).clone(),
            d_bias: Some(p.grad(self.bias).clone()),
        };
        linear_backward_into(ctx, encoder, x, p.value(self.weight), dy, &grads)
    }
}
