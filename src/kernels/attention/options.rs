//! Options of an attention call: masks, lengths, score modifiers, and their validation against
//! a problem (`check_options`).

use crate::spec::RelativeBuckets;
use crate::tensor::{BiasView, GpuTensor, SeqLens};

/// Options of an attention call. Built with chained setters so later mask and score features (bias,
/// sliding window, softcap) are new fields, not new functions:
/// `AttentionOptions::new().causal(true).seq_lens(&lens)`.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct AttentionOptions<'a> {
    /// Score scale; `None` is `1 / sqrt(Dk)`.
    pub scale: Option<f32>,
    /// Softmax temperature: the scale is divided by it. `None` is 1.
    pub temperature: Option<f32>,
    /// Causal mask, bottom-right aligned: key j is visible to query i iff `j <= i + (Lk - Lq)`.
    pub causal: bool,
    /// Per-batch valid query and/or key lengths (padding, variable length).
    pub seq_lens: Option<&'a SeqLens>,
    /// Score softcap `cap * tanh(s / cap)` of the scaled score `s` (Gemma 2), before ALiBi and
    /// masks.
    pub softcap: Option<f32>,
    /// ALiBi: subtract `slope(h) * |i + (Lk - Lq) - j|` from the scores, with the geometric slopes
    /// of Press et al. (`2^(-8 (h + 1) / H)` for H a power of two) unless `alibi_slopes` are given.
    pub alibi: bool,
    /// Per-query-head ALiBi slopes (at most [`MAX_ALIBI_SLOPES`](super::MAX_ALIBI_SLOPES) heads);
    /// implies `alibi`.
    pub alibi_slopes: Option<&'a [f32]>,
    /// Sliding window `(left, right)`: query i sees keys `p - left ..= p + right`, `p = i + Lk -
    /// Lq` its position aligned as the causal mask; composes with causal (which cuts at `p`) and
    /// padding. Key blocks outside every row's window are skipped, so time grows as L x window.
    pub window: Option<(usize, usize)>,
    /// Attention sinks `[H]`: a learnable logit per query head in every row's softmax denominator,
    /// with no value (gpt-oss). Its gradient comes from
    /// [`attention_backward`](super::attention_backward) (`d_sinks`) or
    /// [`attention_sinks_backward_into`](super::attention_sinks_backward_into).
    pub sinks: Option<&'a GpuTensor>,
    /// Cosine-similarity scores: q and k L2-normalised (eps 1e-6) before the scores, which are then
    /// multiplied by this scale (instead of `scale`; the temperature still divides it).
    pub cosine: Option<f32>,
    /// Cosine scores with a learned per-head scale; see [`AttentionOptions::cosine_learned`].
    pub learned_cosine: Option<LearnedScale<'a>>,
    /// Key-norm clipping: keys whose norm exceeds this are scaled to it before the scores (after
    /// the normalisation of cosine scores, if both).
    pub key_clip: Option<f32>,
    /// Additive score bias `[B or 1, H or 1, Lq, Lk]`, added after softcap and ALiBi; a `-inf`
    /// entry masks its pair. See [`AttentionOptions::bias`].
    pub bias: Option<ScoreBias<'a>>,
    /// T5 relative-position buckets and their `[H, buckets]` table of learned biases.
    pub relative: Option<(RelativeBuckets, &'a GpuTensor)>,
    /// Where the backward writes the relative table's gradient `[H, buckets]` (see
    /// [`AttentionOptions::relative_buckets_learned`]).
    pub relative_grad: Option<&'a GpuTensor>,
    /// Masks and positions aligned on each sequence's lengths (`kv_len - q_len + i`, decoding
    /// from a cache) instead of the tensor lengths: set by decode attention when its prefill runs
    /// on the forward kernels.
    pub(crate) align_lens: bool,
}

/// A learned per-head cosine-score scale `[H]` and the tensor its gradient is written to.
#[derive(Clone, Copy, Debug)]
pub struct LearnedScale<'a> {
    /// The scale per query head `[H]`.
    pub scale: &'a GpuTensor,
    /// Where the backward writes its gradient `[H]`.
    pub grad: &'a GpuTensor,
}

/// An additive score bias and whether its gradient is wanted.
#[derive(Clone, Copy, Debug)]
pub struct ScoreBias<'a> {
    /// The bias view `[B or 1, H or 1, Lq, Lk]`.
    pub view: &'a BiasView,
    /// False for a constant mask: no `d_bias` is computed.
    pub learnable: bool,
}

impl<'a> AttentionOptions<'a> {
    /// No mask, no modifier, scale `1 / sqrt(Dk)`.
    pub fn new() -> Self {
        Self::default()
    }

    /// The score scale (default `1 / sqrt(Dk)`); must be finite.
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Softmax temperature `t > 0`: the score is `(scale / t) * q.k`. It divides the scale only:
    /// ALiBi, the bias, the relative-bucket term and sink logits are not divided by it.
    pub fn temperature(mut self, temperature: f32) -> Self {
        self.temperature = Some(temperature);
        self
    }

    /// The causal mask, bottom-right aligned: key `j` is visible to query `i` iff
    /// `j <= i + (Lk - Lq)`.
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Per-batch valid query and key lengths (padding, variable-length batches).
    pub fn seq_lens(mut self, seq_lens: &'a SeqLens) -> Self {
        self.seq_lens = Some(seq_lens);
        self
    }

    /// Softcap `cap * tanh(s / cap)` of the scaled (and tempered) dot-product score, applied
    /// before ALiBi, the bias and the relative-bucket term, which are added uncapped. Sink logits
    /// are not capped. `cap` must be finite and positive.
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// ALiBi with Press et al.'s geometric slopes (after softcap, before the bias).
    pub fn alibi(mut self, alibi: bool) -> Self {
        self.alibi = alibi;
        self
    }

    /// ALiBi with the caller's slope per query head (`slopes.len() == H`) instead of the geometric
    /// default.
    pub fn alibi_slopes(mut self, slopes: &'a [f32]) -> Self {
        self.alibi = true;
        self.alibi_slopes = Some(slopes);
        self
    }

    /// Cosine-similarity scores times `scale` (e.g. 10-30: unit vectors' dot products lie in
    /// [-1, 1]). Each q and k row is normalised as `x / max(|x|, 1e-6)` (PyTorch's
    /// `F.normalize` with `eps = 1e-6`), so a zero row stays zero. The temperature still divides
    /// `scale`; set `cosine` or `scale`, not both.
    pub fn cosine(mut self, scale: f32) -> Self {
        self.cosine = Some(scale);
        self
    }

    /// Cosine-similarity scores times a learned scale per query head, read on the GPU from `scale`
    /// (`[H]`, e.g. 10 to 30 at first; Swin V2's logit scale): `s = scale[h] * cos(q, k)`. The
    /// backward writes (overwrites, not adds to) `dL/dscale` into `grad` (`[H]`), summed over rows
    /// in a fixed order.
    pub fn cosine_learned(mut self, scale: &'a GpuTensor, grad: &'a GpuTensor) -> Self {
        self.learned_cosine = Some(LearnedScale { scale, grad });
        self
    }

    /// Scales keys whose L2 norm exceeds `max_norm` down to it before the scores.
    pub fn key_norm_clip(mut self, max_norm: f32) -> Self {
        self.key_clip = Some(max_norm);
        self
    }

    /// Attention sinks `[H]`: one logit per query head added to every row's softmax denominator
    /// as it is (neither tempered nor softcapped), with no value.
    pub fn sinks(mut self, sinks: &'a GpuTensor) -> Self {
        self.sinks = Some(sinks);
        self
    }

    /// Sliding window of `left` keys before and `right` after each query's aligned position
    /// (`window(w - 1, 0)` with `causal(true)`: the last `w` keys, as Mistral and Gemma 2).
    pub fn window(mut self, left: usize, right: usize) -> Self {
        self.window = Some((left, right));
        self
    }

    /// A learnable additive score bias: [`attention_backward`](super::attention_backward) returns
    /// its gradient (`d_bias`, shaped like the view, summed over its broadcast dimensions in a
    /// fixed order); [`attention_bias_backward_into`](super::attention_bias_backward_into) records
    /// it.
    pub fn bias(mut self, bias: &'a BiasView) -> Self {
        self.bias = Some(ScoreBias {
            view: bias,
            learnable: true,
        });
        self
    }

    /// A constant additive score bias (an arbitrary mask: `-inf` hides a pair, `0` keeps it):
    /// no gradient is computed for it. A modified score at or below `-3e38` counts as masked, as
    /// `-inf` does.
    pub fn constant_bias(mut self, bias: &'a BiasView) -> Self {
        self.bias = Some(ScoreBias {
            view: bias,
            learnable: false,
        });
        self
    }

    /// T5 relative-position bias: `table [H, buckets]` entry of the bucket of `j - (i + Lk - Lq)`
    /// added to each score, computed in the kernels (no `Lq x Lk` tensor).
    /// [`attention_backward`](super::attention_backward) returns its gradient (`d_relative`);
    /// [`attention_backward_into`](super::attention_backward_into) computes none (a constant table)
    /// unless [`AttentionOptions::relative_buckets_learned`] names a destination.
    pub fn relative_buckets(mut self, buckets: RelativeBuckets, table: &'a GpuTensor) -> Self {
        self.relative = Some((buckets, table));
        self
    }

    /// [`AttentionOptions::relative_buckets`] with a learned table: the backward's dQ kernels sum
    /// each query row's `p (dP - D)` per bucket as they go, and their row shares are added per
    /// (head, bucket) in a fixed order and written into `grad` (`[H, buckets]`; overwritten, not
    /// added to). The relative term is added after softcap and ALiBi, uncapped.
    pub fn relative_buckets_learned(
        mut self,
        buckets: RelativeBuckets,
        table: &'a GpuTensor,
        grad: &'a GpuTensor,
    ) -> Self {
        self.relative = Some((buckets, table));
        self.relative_grad = Some(grad);
        self
    }

    /// Whether a score modifier is set (the unfused path has none).
    pub(super) fn has_score_modifier(&self) -> bool {
        self.softcap.is_some()
            || self.bias.is_some()
            || self.relative.is_some()
            || self.alibi
            || self.sinks.is_some()
            || self.cosine.is_some()
            || self.learned_cosine.is_some()
            || self.key_clip.is_some()
    }
}
