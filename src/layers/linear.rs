//! Linear layer `y = x W^T + b`: parameters in a [`Params`] store, recorded with
//! [`crate::kernels::linear`]. Weights start uniform in `+-1/sqrt(in)`, biases at zero.

use crate::device::Context;
use crate::error::Result;
use crate::kernels::linear::{
    linear_backward_epilogue_into, linear_forward_epilogue_into, Epilogue, LinearGrads,
};
use crate::layers::params::{Init, ParamId, Params};
use crate::tensor::GpuTensor;

/// A linear layer's parameters: `weight [out, in]` and `bias [out]`.
pub struct Linear {
    /// `[out, in]`.
    pub weight: ParamId,
    /// `[out]`.
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

    /// Records `y = x W^T + b`.
    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        y: &GpuTensor,
    ) -> Result<()> {
        self.forward_epilogue(ctx, encoder, p, x, Epilogue::default(), y)
    }

    /// `y = act(x W^T + b) + residual` in one GEMM (see [`Epilogue`]).
    pub fn forward_epilogue(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        epilogue: Epilogue<'_>,
        y: &GpuTensor,
    ) -> Result<()> {
        let (w, b) = (p.value(self.weight), p.value(self.bias));
        linear_forward_epilogue_into(ctx, encoder, x, w, Some(b), epilogue, y)
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
        self.backward_epilogue(ctx, encoder, p, x, dy, dx, Epilogue::default())
    }

    /// [`Linear::backward`] with `dx = (dy W) * act'(pre) + residual` (see [`Epilogue`]).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_epilogue(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        dy: &GpuTensor,
        dx: &GpuTensor,
        dx_epilogue: Epilogue<'_>,
    ) -> Result<()> {
        let grads = LinearGrads {
            dx: dx.clone(),
            d_weight: p.grad(self.weight).clone(),
            d_bias: Some(p.grad(self.bias).clone()),
        };
        let w = p.value(self.weight);
        linear_backward_epilogue_into(ctx, encoder, x, w, dy, &grads, dx_epilogue)
    }
}
