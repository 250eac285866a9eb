//! Looking at what a model attends to: attention maps of any layer and head of a forward
//! ([`Transformer::attention_map`]), gradient-times-attention maps after a backward
//! ([`Transformer::gradient_times_attention`]), and attention rollout across layers
//! ([`attention_rollout`], Abnar and Zuidema 2020).
//!
//! What they show, and what they do not (seed 000's caveat): a map is where each query's softmax put
//! its weight in one layer and head, not why the model produced its output. Values, the other heads,
//! later layers and the residual stream all intervene, and different weights can give the same
//! output. Rollout multiplies the layers' head-averaged maps, each mixed half and half with the
//! identity for the residual path: a heuristic for how information flows, that ignores the values
//! and the feed-forward blocks. Gradient times attention, `P ⊙ dL/dP` with `dL/dP_ij = dO_i . v_j`,
//! weighs each attention weight by how much the loss responds to it (first order, for the batch's
//! loss): large where attention both is strong and matters, signed. None of them is an explanation;
//! they are measurements to form and test hypotheses with.

use crate::layers::attention::MultiHeadAttention;
use crate::model::transformer::Transformer;
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::tensor::{GpuTensor, SeqLens};

/// An attention call of a [`Transformer`]: a layer's encoder self-attention, decoder
/// self-attention or decoder cross-attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionSite {
    /// Self-attention of encoder layer `n`.
    EncoderSelf(usize),
    /// Self-attention of decoder layer `n`.
    DecoderSelf(usize),
    /// Cross-attention of decoder layer `n`.
    DecoderCross(usize),
}

impl Transformer {
    /// The attention layer at `site` and the lengths it masks with.
    fn site(&self, site: AttentionSite) -> Result<(&MultiHeadAttention, &SeqLens)> {
        let missing = || {
            Error::shape(
                "site",
                format!("{site:?} is not an attention layer of this model ({} encoder and {} decoder layers)", self.config().encoder_layers, self.config().decoder_layers),
            )
        };
        let (encoder, decoder) = self.stacks();
        let (lens_enc, lens_dec, lens_cross) = self.lens();
        match site {
            AttentionSite::EncoderSelf(l) => encoder
                .and_then(|e| e.layers.get(l))
                .map(|layer| (layer.attention(), lens_enc)),
            AttentionSite::DecoderSelf(l) => decoder
                .layers()
                .get(l)
                .map(|layer| (layer.self_attention(), lens_dec)),
            AttentionSite::DecoderCross(l) => decoder
                .layers()
                .get(l)
                .and_then(|layer| layer.cross_attention())
                .map(|a| (a, lens_cross)),
        }
        .ok_or_else(missing)
    }

    /// After [`Transformer::forward`]: the attention probabilities `[B, H, Lq, Lk]` at `site`
    /// (recomputed from the saved Q, K and lse; padded rows and keys are 0).
    pub fn attention_map(&self, ctx: &Context, site: AttentionSite) -> Result<GpuTensor> {
        let (attention, lens) = self.site(site)?;
        attention.probabilities(ctx, &self.params, lens, 0..self.query_len(site))
    }

    /// After [`Transformer::backward`]: `P ⊙ dL/dP` at `site`, `[B, H, Lq, Lk]` on the host, with
    /// `dL/dP_ij = dO_i . v_j` (the gradient at the attention output times the values).
    pub fn gradient_times_attention(&self, ctx: &Context, site: AttentionSite) -> Result<Vec<f32>> {
        let p = self.attention_map(ctx, site)?.to_vec(ctx)?;
        let (attention, _) = self.site(site)?;
        let (v, d_out) = attention.values_and_output_grad()?;
        let [b, lk, h, d] = v.shape();
        let lq = d_out.shape()[1];
        let (v, d_out) = (v.to_vec(ctx)?, d_out.to_vec(ctx)?);
        let mut g = vec![0.0f32; p.len()];
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..lq {
                    let o = &d_out[((bi * lq + i) * h + hi) * d..][..d];
                    for j in 0..lk {
                        let at = ((bi * h + hi) * lq + i) * lk + j;
                        if p[at] == 0.0 {
                            continue;
                        }
                        let vj = &v[((bi * lk + j) * h + hi) * d..][..d];
                        let dp: f64 = o.iter().zip(vj).map(|(x, y)| *x as f64 * *y as f64).sum();
                        g[at] = (p[at] as f64 * dp) as f32;
                    }
                }
            }
        }
        Ok(g)
    }
}

/// Attention rollout (Abnar and Zuidema 2020) over self-attention maps of consecutive layers,
/// first layer first, each `[batch, heads, len, len]`: `R = A_L ... A_1` with
/// `A_l = (mean over heads of P_l + I) / 2`, rows renormalised. Returns `[batch, len, len]`: row `i`
/// is how much of each input position reaches position `i` of the last layer under this heuristic.
pub fn attention_rollout(maps: &[Vec<f32>], [batch, heads, len]: [usize; 3]) -> Result<Vec<f64>> {
    if maps.is_empty() || maps.iter().any(|m| m.len() != batch * heads * len * len) {
        return Err(Error::shape(
            "maps",
            format!("needs at least one map of {batch} x {heads} x {len} x {len} values per layer"),
        ));
    }
    let mut rollout = vec![0.0; batch * len * len];
    for b in 0..batch {
        // R starts as the identity.
        let mut r: Vec<f64> = (0..len * len)
            .map(|n| (n / len == n % len) as u8 as f64)
            .collect();
        for map in maps {
            let mut a = vec![0.0; len * len];
            for h in 0..heads {
                for (n, x) in a.iter_mut().enumerate() {
                    *x += map[(b * heads + h) * len * len + n] as f64 / heads as f64;
                }
            }
            for i in 0..len {
                a[i * len + i] += 1.0;
                let sum: f64 = a[i * len..][..len].iter().sum();
                a[i * len..][..len].iter_mut().for_each(|x| *x /= sum);
            }
            // R <- A R
            let mut next = vec![0.0; len * len];
            for i in 0..len {
                for k in 0..len {
                    let x = a[i * len + k];
                    if x != 0.0 {
                        for j in 0..len {
                            next[i * len + j] += x * r[k * len + j];
                        }
                    }
                }
            }
            r = next;
        }
        rollout[b * len * len..][..len * len].copy_from_slice(&r);
    }
    Ok(rollout)
}
