//! A Transformer encoder layer (self-attention with a fused QKV projection, GELU feed-forward),
//! pre-LN or post-LN:
//!
//! ```text
//! pre-LN:  x1 = x + Attn(LN1(x));   y = x1 + FF(LN2(x1))
//! post-LN: x1 = LN1(x + Attn(x));   y = LN2(x1 + FF(x1))
//! Attn(h) = attention(q, k, v) Wo^T + bo with [q k v] = h Wqkv^T + bqkv;  FF(h) = GELU(h W1^T + b1) W2^T + b2
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
    /// LayerNorm before each sub-block (pre-LN) or after each residual sum (post-LN).
    pub pre_ln: bool,
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
    /// Input of the QKV projection: LN1(x) pre-LN, x post-LN.
    attn_in: GpuTensor,
    /// What LN1 normalised: x pre-LN, x + Attn(x) post-LN.
    ln1_in: GpuTensor,
    ln1: LayerNormOutput,
    qkv: GpuTensor,
    attn: AttentionOutput,
    /// Input of the feed-forward block: LN2(x1) pre-LN, x1 = LN1(..) post-LN.
    ff_x: GpuTensor,
    /// What LN2 normalised: x1 pre-LN, x1 + FF(x1) post-LN.
    ln2_in: GpuTensor,
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
        let attention = |attn_in: &GpuTensor| -> Result<(GpuTensor, AttentionOutput, GpuTensor)> {
            let qkv = linear_forward(ctx, attn_in, self.p(2), Some(self.p(3)))?;
            let (q, k, v) = (
                qkv.split_heads(0, h, hd)?,
                qkv.split_heads(d, h, hd)?,
                qkv.split_heads(2 * d, h, hd)?,
            );
            let attn =
                attention_forward(ctx, &q, &k, &v, &AttentionOptions::new().causal(c.causal))?;
            let proj = linear_forward(
                ctx,
                &attn.out.reshape(&[b, l, d])?,
                self.p(4),
                Some(self.p(5)),
            )?;
            Ok((qkv, attn, proj))
        };
        let feed_forward = |ff_x: &GpuTensor| -> Result<(GpuTensor, GpuTensor, GpuTensor)> {
            let ff_in = linear_forward(ctx, ff_x, self.p(8), Some(self.p(9)))?;
            let ff_act = activation_forward(ctx, Activation::Gelu, &ff_in)?;
            let ff_out = linear_forward(ctx, &ff_act, self.p(10), Some(self.p(11)))?;
            Ok((ff_in, ff_act, ff_out))
        };
        if c.pre_ln {
            let ln1 = layer_norm_forward(ctx, x, self.p(0), self.p(1), LN_EPS)?;
            let (qkv, attn, proj) = attention(&ln1.y)?;
            let x1 = add(ctx, x, &proj)?;
            let ln2 = layer_norm_forward(ctx, &x1, self.p(6), self.p(7), LN_EPS)?;
            let (ff_in, ff_act, ff_out) = feed_forward(&ln2.y)?;
            let y = add(ctx, &x1, &ff_out)?;
            Ok(TransformerLayerCache {
                x: x.clone(),
                attn_in: ln1.y.clone(),
                ln1_in: x.clone(),
                ln1,
                qkv,
                attn,
                ff_x: ln2.y.clone(),
                ln2_in: x1,
                ln2,
                ff_in,
                ff_act,
                y,
            })
        } else {
            let (qkv, attn, proj) = attention(x)?;
            let s1 = add(ctx, x, &proj)?;
            let ln1 = layer_norm_forward(ctx, &s1, self.p(0), self.p(1), LN_EPS)?;
            let (ff_in, ff_act, ff_out) = feed_forward(&ln1.y)?;
            let s2 = add(ctx, &ln1.y, &ff_out)?;
            let ln2 = layer_norm_forward(ctx, &s2, self.p(6), self.p(7), LN_EPS)?;
            Ok(TransformerLayerCache {
                x: x.clone(),
                attn_in: x.clone(),
                ln1_in: s1,
                ff_x: ln1.y.clone(),
                ln1,
                qkv,
                attn,
                ln2_in: s2,
                y: ln2.y.clone(),
                ln2,
                ff_in,
                ff_act,
            })
        }
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
        // Feed-forward block: gradient at its input from the gradient at its output.
        let feed_forward_back = |d_out: &GpuTensor| -> Result<_> {
            let (d_act, d_w2, d_b2) = some(linear_backward(
                ctx,
                &cache.ff_act,
                self.p(10),
                d_out,
                true,
            )?);
            let d_ff_in = activation_backward(ctx, Activation::Gelu, &cache.ff_in, &d_act)?;
            let (d_ff_x, d_w1, d_b1) = some(linear_backward(
                ctx,
                &cache.ff_x,
                self.p(8),
                &d_ff_in,
                true,
            )?);
            Ok((d_ff_x, [d_w1, d_b1, d_w2, d_b2]))
        };
        // Attention block: gradient at the QKV projection's input from the gradient at Wo's output.
        let attention_back = |d_proj: &GpuTensor| -> Result<_> {
            let attn_out = cache.attn.out.reshape(&[b, l, d])?;
            let (d_attn, d_wo, d_bo) =
                some(linear_backward(ctx, &attn_out, self.p(4), d_proj, true)?);
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
            let (d_in, d_wqkv, d_bqkv) = some(linear_backward(
                ctx,
                &cache.attn_in,
                self.p(2),
                &d_qkv,
                true,
            )?);
            Ok((d_in, [d_wqkv, d_bqkv, d_wo, d_bo]))
        };
        let (dx, ln1, ln2, attn_grads, ff_grads);
        if c.pre_ln {
            // y = x1 + FF(LN2(x1)),  x1 = x + Attn(LN1(x))
            let (d_h2, ff) = feed_forward_back(dy)?;
            let l2 = layer_norm_backward(ctx, &cache.ln2_in, self.p(6), &cache.ln2.stats, &d_h2)?;
            let d_x1 = add(ctx, dy, &l2.dx)?;
            let (d_h1, at) = attention_back(&d_x1)?;
            let l1 = layer_norm_backward(ctx, &cache.ln1_in, self.p(0), &cache.ln1.stats, &d_h1)?;
            dx = add(ctx, &d_x1, &l1.dx)?;
            (ln1, ln2, attn_grads, ff_grads) = (l1, l2, at, ff);
        } else {
            // y = LN2(s2), s2 = x1 + FF(x1), x1 = LN1(s1), s1 = x + Attn(x)
            let l2 = layer_norm_backward(ctx, &cache.ln2_in, self.p(6), &cache.ln2.stats, dy)?;
            let (d_ff_x, ff) = feed_forward_back(&l2.dx)?;
            let d_x1 = add(ctx, &l2.dx, &d_ff_x)?;
            let l1 = layer_norm_backward(ctx, &cache.ln1_in, self.p(0), &cache.ln1.stats, &d_x1)?;
            let (d_attn_in, at) = attention_back(&l1.dx)?;
            dx = add(ctx, &l1.dx, &d_attn_in)?;
            (ln1, ln2, attn_grads, ff_grads) = (l1, l2, at, ff);
        }
        let [d_wqkv, d_bqkv, d_wo, d_bo] = attn_grads;
        let [d_w1, d_b1, d_w2, d_b2] = ff_grads;
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
