//! A pre-LN Transformer encoder layer (self-attention with a fused QKV projection, GELU feed-forward):
//!
//! ```text
//! h1 = LN1(x);  qkv = h1 Wqkv^T + bqkv;  a = attention(q, k, v);  x1 = x + a Wo^T + bo
//! h2 = LN2(x1); y = x1 + GELU(h2 W1^T + b1) W2^T + b2
//! ```
//!
//! Q, K, V are strided views of the packed projection and dQ, dK, dV are written into views of one
//! packed gradient, so heads are split by indexing, never copied. The CPU counterpart is
//! [`crate::reference::transformer_layer`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::attention::{
    attention_backward_into, attention_backward_workspace, attention_forward, AttentionOptions,
    AttentionOutput, AttentionShape,
};
use crate::kernels::elementwise::{activation_backward, activation_forward, add, Activation};
use crate::kernels::layer_norm::{layer_norm_backward, layer_norm_forward, LayerNormOutput};
use crate::kernels::linear::{linear_backward, linear_forward, LinearGrads};
use crate::tensor::GpuTensor;

/// Sizes of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransformerLayerConfig {
    pub d_model: usize,
    pub heads: usize,
    pub d_ff: usize,
    pub causal: bool,
}

/// Parameter names and shapes, in the order [`TransformerLayer::params`] and the gradients use.
pub fn param_shapes(c: &TransformerLayerConfig) -> Vec<(&'static str, Vec<usize>)> {
    let d = c.d_model;
    vec![
        ("ln1.gamma", vec![d]),
        ("ln1.beta", vec![d]),
        ("attn.qkv.weight", vec![3 * d, d]),
        ("attn.qkv.bias", vec![3 * d]),
        ("attn.out.weight", vec![d, d]),
        ("attn.out.bias", vec![d]),
        ("ln2.gamma", vec![d]),
        ("ln2.beta", vec![d]),
        ("ff.in.weight", vec![c.d_ff, d]),
        ("ff.in.bias", vec![c.d_ff]),
        ("ff.out.weight", vec![d, c.d_ff]),
        ("ff.out.bias", vec![d]),
    ]
}

/// Deterministic initial parameters: LayerNorm gamma 1 and beta 0, weights uniform in
/// `+-1/sqrt(fan_in)` from `seed`, biases small.
pub fn init_params(c: &TransformerLayerConfig, seed: u64) -> Vec<Vec<f32>> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut uniform = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    param_shapes(c)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            if name.ends_with("gamma") {
                vec![1.0; n]
            } else if name.ends_with("beta") {
                vec![0.0; n]
            } else if name.ends_with("bias") {
                (0..n).map(|_| 0.02 * uniform()).collect()
            } else {
                let bound = 1.0 / (shape[1] as f32).sqrt();
                (0..n).map(|_| bound * uniform()).collect()
            }
        })
        .collect()
}

/// A layer's parameters on the GPU.
pub struct TransformerLayer {
    pub config: TransformerLayerConfig,
    pub params: Vec<GpuTensor>,
}

/// What the forward keeps for the backward.
pub struct TransformerLayerCache {
    x: GpuTensor,
    ln1: LayerNormOutput,
    qkv: GpuTensor,
    attn: AttentionOutput,
    x1: GpuTensor,
    ln2: LayerNormOutput,
    ff_in: GpuTensor,
    ff_act: GpuTensor,
    /// The layer's output `y`.
    pub y: GpuTensor,
}

const LN_EPS: f32 = 1e-5;

impl TransformerLayer {
    pub fn new(ctx: &Context, config: TransformerLayerConfig, values: &[Vec<f32>]) -> Result<Self> {
        if config.heads == 0 || !config.d_model.is_multiple_of(config.heads) {
            return Err(Error::shape(
                "heads",
                format!(
                    "d_model {} is not a multiple of {} heads",
                    config.d_model, config.heads
                ),
            ));
        }
        let shapes = param_shapes(&config);
        if values.len() != shapes.len() {
            return Err(Error::shape(
                "params",
                format!("{} tensors, expected {}", values.len(), shapes.len()),
            ));
        }
        let params = shapes
            .iter()
            .zip(values)
            .map(|((_, shape), v)| GpuTensor::from_slice(ctx, v, shape))
            .collect::<Result<_>>()?;
        Ok(Self { config, params })
    }

    fn p(&self, i: usize) -> &GpuTensor {
        &self.params[i]
    }

    /// `x [B, L, d_model]` -> the cache holding `y` and what the backward needs.
    pub fn forward(&self, ctx: &Context, x: &GpuTensor) -> Result<TransformerLayerCache> {
        let c = &self.config;
        let &[b, l, d] = x.shape() else {
            return Err(Error::shape(
                "x",
                format!("has shape {:?}; expected [batch, seq, d_model]", x.shape()),
            ));
        };
        if d != c.d_model {
            return Err(Error::shape(
                "x",
                format!("has d_model {d}, the layer {}", c.d_model),
            ));
        }
        let (h, hd) = (c.heads, c.d_model / c.heads);
        let ln1 = layer_norm_forward(ctx, x, self.p(0), self.p(1), LN_EPS)?;
        let qkv = linear_forward(ctx, &ln1.y, self.p(2), Some(self.p(3)))?;
        let (q, k, v) = (
            qkv.split_heads(0, h, hd)?,
            qkv.split_heads(d, h, hd)?,
            qkv.split_heads(2 * d, h, hd)?,
        );
        let attn = attention_forward(ctx, &q, &k, &v, &AttentionOptions::new().causal(c.causal))?;
        let proj = linear_forward(
            ctx,
            &attn.out.reshape(&[b, l, d])?,
            self.p(4),
            Some(self.p(5)),
        )?;
        let x1 = add(ctx, x, &proj)?;
        let ln2 = layer_norm_forward(ctx, &x1, self.p(6), self.p(7), LN_EPS)?;
        let ff_in = linear_forward(ctx, &ln2.y, self.p(8), Some(self.p(9)))?;
        let ff_act = activation_forward(ctx, Activation::Gelu, &ff_in)?;
        let ff_out = linear_forward(ctx, &ff_act, self.p(10), Some(self.p(11)))?;
        let y = add(ctx, &x1, &ff_out)?;
        Ok(TransformerLayerCache {
            x: x.clone(),
            ln1,
            qkv,
            attn,
            x1,
            ln2,
            ff_in,
            ff_act,
            y,
        })
    }

    /// Gradients for the upstream `dy`: `(dx, parameter gradients in param order)`.
    pub fn backward(
        &self,
        ctx: &Context,
        cache: &TransformerLayerCache,
        dy: &GpuTensor,
    ) -> Result<(GpuTensor, Vec<GpuTensor>)> {
        let c = &self.config;
        let [b, l, d] = [cache.x.shape()[0], cache.x.shape()[1], c.d_model];
        let (h, hd) = (c.heads, d / c.heads);
        let some = |g: LinearGrads| (g.dx, g.d_weight, g.d_bias.expect("biased layer"));
        // y = x1 + FF(LN2(x1))
        let (d_act, d_w2, d_b2) = some(linear_backward(ctx, &cache.ff_act, self.p(10), dy, true)?);
        let d_ff_in = activation_backward(ctx, Activation::Gelu, &cache.ff_in, &d_act)?;
        let (d_h2, d_w1, d_b1) = some(linear_backward(
            ctx,
            &cache.ln2.y,
            self.p(8),
            &d_ff_in,
            true,
        )?);
        let ln2 = layer_norm_backward(ctx, &cache.x1, self.p(6), &cache.ln2.stats, &d_h2)?;
        let d_x1 = add(ctx, dy, &ln2.dx)?;
        // x1 = x + Attn(LN1(x)) Wo^T + bo
        let attn_out = cache.attn.out.reshape(&[b, l, d])?;
        let (d_attn, d_wo, d_bo) = some(linear_backward(ctx, &attn_out, self.p(4), &d_x1, true)?);
        let (q, k, v) = (
            cache.qkv.split_heads(0, h, hd)?,
            cache.qkv.split_heads(d, h, hd)?,
            cache.qkv.split_heads(2 * d, h, hd)?,
        );
        let d_qkv = GpuTensor::zeros(ctx, &[b, l, 3 * d])?;
        let workspace = attention_backward_workspace(ctx, &AttentionShape::of(&q, &k, &v)?)?;
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        attention_backward_into(
            ctx,
            &mut encoder,
            &q,
            &k,
            &v,
            &cache.attn.out.heads()?,
            &cache.attn.lse,
            &d_attn.reshape(&[b, l, h, hd])?.heads()?,
            &d_qkv.split_heads(0, h, hd)?,
            &d_qkv.split_heads(d, h, hd)?,
            &d_qkv.split_heads(2 * d, h, hd)?,
            &workspace,
            &AttentionOptions::new().causal(c.causal),
        )?;
        ctx.queue().submit([encoder.finish()]);
        let (d_h1, d_wqkv, d_bqkv) =
            some(linear_backward(ctx, &cache.ln1.y, self.p(2), &d_qkv, true)?);
        let ln1 = layer_norm_backward(ctx, &cache.x, self.p(0), &cache.ln1.stats, &d_h1)?;
        let dx = add(ctx, &d_x1, &ln1.dx)?;
        Ok((
            dx,
            vec![
                ln1.d_gamma,
                ln1.d_beta,
                d_wqkv,
                d_bqkv,
                d_wo,
                d_bo,
                ln2.d_gamma,
                ln2.d_beta,
                d_w1,
                d_b1,
                d_w2,
                d_b2,
            ],
        ))
    }
}
