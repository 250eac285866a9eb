//! Linear layer `y = x W^T + b`: parameters in a [`Params`] store, recorded with
//! [`wgpu_attention::kernels::linear`]. Weights start uniform in `+-1/sqrt(in)`, biases at zero. A layer may
//! have no bias (LLaMA's), or borrow its weight from another layer (an output head tied to the token
//! embedding). In mixed precision ([`crate::layers::Precision::Mixed`]) the products take the
//! weight's f16 copy and f16-rounded activations and gradients, with f32 accumulation.

use crate::layers::params::{Init, ParamId, Params};
use crate::layers::{Precision, Recording};
use wgpu_attention::device::Context;
use wgpu_attention::error::Error;
use wgpu_attention::error::Result;
use wgpu_attention::kernels::linear::{
    linear_backward_epilogue_into, linear_backward_mixed_into, linear_forward_epilogue_into,
    linear_forward_mixed_into, Epilogue, LinearGrads,
};
use wgpu_attention::tensor::GpuTensor;
use wgpu_attention::tensor::GpuTensorF16;

/// A linear layer's parameters: `weight [out, in]` and `bias [out]` (if it has one).
pub struct Linear {
    /// `[out, in]`.
    pub weight: ParamId,
    /// `[out]`.
    pub bias: Option<ParamId>,
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
        Self::with_bias(ctx, params, name, in_features, out_features, true)
    }

    /// Adds `{name}.weight [out, in]` and, if `bias`, `{name}.bias [out]`.
    pub fn with_bias(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        let bound = 1.0 / (in_features as f32).sqrt();
        let weight = params.add(
            ctx,
            format!("{name}.weight"),
            &[out_features, in_features],
            Init::Uniform(bound),
        )?;
        params.mark_product_weight(weight);
        Ok(Self {
            weight,
            bias: bias
                .then(|| params.add(ctx, format!("{name}.bias"), &[out_features], Init::Zeros))
                .transpose()?,
        })
    }

    /// A layer whose weight is another's parameter (`weight`, `[out, in]`), with a bias of its own
    /// `{name}.bias` if `bias`. Its backward overwrites the weight's gradient: the owner's backward
    /// must run after it and add to it (see [`crate::layers::embedding::Embedding`]).
    pub fn tied(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        weight: ParamId,
        bias: bool,
    ) -> Result<Self> {
        let out_features = params.value(weight).shape()[0];
        params.mark_product_weight(weight);
        Ok(Self {
            weight,
            bias: bias
                .then(|| params.add(ctx, format!("{name}.bias"), &[out_features], Init::Zeros))
                .transpose()?,
        })
    }

    /// Records `y = x W^T + b`.
    pub fn forward(&self, rec: &mut Recording<'_>, x: &GpuTensor, y: &GpuTensor) -> Result<()> {
        self.forward_epilogue(rec, x, Epilogue::default(), y)
    }

    /// `y = act(x W^T + b) + residual` in one GEMM (see [`Epilogue`]).
    pub fn forward_epilogue(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        epilogue: Epilogue<'_>,
        y: &GpuTensor,
    ) -> Result<()> {
        let Recording { ctx, params: p, .. } = *rec;
        let b = self.bias.map(|b| p.value(b));
        match self.half_weight(rec)? {
            Some(w16) => linear_forward_mixed_into(ctx, rec.encoder, x, w16, b, epilogue, y),
            None => {
                let w = p.value(self.weight);
                linear_forward_epilogue_into(ctx, rec.encoder, x, w, b, epilogue, y)
            }
        }
    }

    /// The f16 weight copy the products take in mixed precision, `None` in f32.
    fn half_weight<'r>(&self, rec: &Recording<'r>) -> Result<Option<&'r GpuTensorF16>> {
        match rec.precision {
            Precision::F32 => Ok(None),
            Precision::Mixed => rec.params.half(self.weight).map(Some).ok_or_else(|| {
                Error::shape(
                    "precision",
                    "is mixed, but the parameters have no f16 copies; call \
                     Params::enable_half_copies (Transformer::set_precision does)",
                )
            }),
        }
    }

    /// Writes `dx` and the weight and bias gradients.
    pub fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        dy: &GpuTensor,
        dx: &GpuTensor,
    ) -> Result<()> {
        self.backward_epilogue(rec, x, dy, dx, Epilogue::default())
    }

    /// [`Linear::backward`] with `dx = (dy W) * act'(pre) + residual` (see [`Epilogue`]).
    pub fn backward_epilogue(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        dy: &GpuTensor,
        dx: &GpuTensor,
        dx_epilogue: Epilogue<'_>,
    ) -> Result<()> {
        let Recording { ctx, params: p, .. } = *rec;
        let grads = LinearGrads {
            dx: dx.clone(),
            d_weight: p.grad(self.weight).clone(),
            d_bias: self.bias.map(|b| p.grad(b).clone()),
        };
        match self.half_weight(rec)? {
            Some(w16) => {
                linear_backward_mixed_into(ctx, rec.encoder, x, w16, dy, &grads, dx_epilogue)
            }
            None => {
                let w = p.value(self.weight);
                linear_backward_epilogue_into(ctx, rec.encoder, x, w, dy, &grads, dx_epilogue)
            }
        }
    }
}
