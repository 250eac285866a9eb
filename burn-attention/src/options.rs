//! What a fused attention call takes besides Q, K, V: the host-side settings ([`ScoreSpec`], what
//! the kernels are specialised and masked by) and the tensors of the learnable score terms.

use burn::tensor::{Bool, Tensor};
use wgpu_attention::RelativeBuckets;

/// The host-side settings of a fused attention call: scale, masks, lengths and the score modifiers
/// that need no tensor. The same value goes to the forward and the backward kernels.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ScoreSpec {
    /// Score scale; `None` is `1 / sqrt(Dk)`.
    pub scale: Option<f32>,
    /// Softmax temperature (the scale is divided by it); `None` is 1.
    pub temperature: Option<f32>,
    /// Causal mask, bottom-right aligned (key j visible to query i iff `j <= i + Lk - Lq`), as
    /// burn's `is_causal`.
    pub causal: bool,
    /// Valid query lengths per batch element (rows past them give 0 and no gradient).
    pub q_lens: Option<Vec<u32>>,
    /// Valid key lengths per batch element (keys past them are masked): padding.
    pub kv_lens: Option<Vec<u32>>,
    /// Score softcap `cap * tanh(s / cap)`, as burn's `softcap`.
    pub softcap: Option<f32>,
    /// Sliding window `(left, right)` around each query's aligned position.
    pub window: Option<(usize, usize)>,
    /// ALiBi with the geometric slopes of Press et al., or these per-head slopes.
    pub alibi: Option<Option<Vec<f32>>>,
    /// Cosine-similarity scores (q and k L2-normalised) times this scale.
    pub cosine: Option<f32>,
    /// Keys whose norm exceeds this are scaled to it before the scores.
    pub key_clip: Option<f32>,
    /// T5 relative-position buckets; the table is [`FusedAttentionOptions::relative_table`].
    pub relative: Option<RelativeBuckets>,
}

/// Options of [`fused_attention`](crate::fused_attention): a builder, so new options break no
/// caller. `FusedAttentionOptions::new().causal(true).softcap(30.0)`.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct FusedAttentionOptions {
    /// The host-side settings.
    pub spec: ScoreSpec,
    /// Additive score bias `[B or 1, H or 1, Lq, Lk]` (any strides; a `-inf` entry masks its
    /// pair). Its gradient is computed when it requires one.
    pub bias: Option<Tensor<4>>,
    /// The `[H, buckets]` table of T5 relative-position biases (with [`Self::relative_buckets`]).
    pub relative_table: Option<Tensor<2>>,
    /// Attention sinks `[H]`: a learnable logit per head in every row's softmax denominator.
    pub sinks: Option<Tensor<1>>,
    /// An arbitrary boolean mask `[B or 1, H or 1, Lq, Lk]`, `true` masking the pair (burn's
    /// convention). The kernels read it as a constant `-inf` bias (added to [`Self::bias`] if both
    /// are given), so it costs a float tensor of its shape: causal, padding lengths and windows are
    /// masks the kernels compute instead.
    pub mask: Option<Tensor<4, Bool>>,
}

impl FusedAttentionOptions {
    /// No mask, no modifier, scale `1 / sqrt(Dk)`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Score scale instead of `1 / sqrt(Dk)`.
    pub fn scale(mut self, scale: f32) -> Self {
        self.spec.scale = Some(scale);
        self
    }

    /// Softmax temperature: the scale is divided by it.
    pub fn temperature(mut self, temperature: f32) -> Self {
        self.spec.temperature = Some(temperature);
        self
    }

    /// Causal mask (bottom-right aligned, as burn's `is_causal`).
    pub fn causal(mut self, causal: bool) -> Self {
        self.spec.causal = causal;
        self
    }

    /// Valid key lengths per batch element: keys past them are masked (padding).
    pub fn kv_lens(mut self, lens: impl Into<Vec<u32>>) -> Self {
        self.spec.kv_lens = Some(lens.into());
        self
    }

    /// Valid query lengths per batch element: rows past them give 0 (and no gradient).
    pub fn q_lens(mut self, lens: impl Into<Vec<u32>>) -> Self {
        self.spec.q_lens = Some(lens.into());
        self
    }

    /// Score softcap `cap * tanh(s / cap)` (Gemma 2), as burn's `softcap`.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.spec.softcap = Some(cap);
        self
    }

    /// Sliding window: each query sees `left` keys before its aligned position and `right` after.
    pub fn window(mut self, left: usize, right: usize) -> Self {
        self.spec.window = Some((left, right));
        self
    }

    /// ALiBi with Press et al.'s geometric slopes.
    pub fn alibi(mut self) -> Self {
        self.spec.alibi = Some(None);
        self
    }

    /// ALiBi with these per-head slopes.
    pub fn alibi_slopes(mut self, slopes: impl Into<Vec<f32>>) -> Self {
        self.spec.alibi = Some(Some(slopes.into()));
        self
    }

    /// Cosine-similarity scores times `scale`.
    pub fn cosine(mut self, scale: f32) -> Self {
        self.spec.cosine = Some(scale);
        self
    }

    /// Clip key norms to `max_norm` before the scores.
    pub fn key_norm_clip(mut self, max_norm: f32) -> Self {
        self.spec.key_clip = Some(max_norm);
        self
    }

    /// Additive score bias `[B or 1, H or 1, Lq, Lk]`; learnable when it requires a gradient.
    pub fn bias(mut self, bias: Tensor<4>) -> Self {
        self.bias = Some(bias);
        self
    }

    /// T5 relative-position buckets with their `[H, buckets]` table (learnable when it requires a
    /// gradient).
    pub fn relative_buckets(mut self, buckets: RelativeBuckets, table: Tensor<2>) -> Self {
        self.spec.relative = Some(buckets);
        self.relative_table = Some(table);
        self
    }

    /// An arbitrary boolean mask, `true` masking the pair: see [`Self::mask`](#structfield.mask).
    pub fn mask(mut self, mask: Tensor<4, Bool>) -> Self {
        self.mask = Some(mask);
        self
    }

    /// Attention sinks `[H]` (learnable when they require a gradient).
    pub fn sinks(mut self, sinks: Tensor<1>) -> Self {
        self.sinks = Some(sinks);
        self
    }
}
