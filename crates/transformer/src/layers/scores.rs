//! The score options of a self-attention layer, shared by the layer ([`super::attention`]) and the
//! stack configurations that carry them ([`super::stack::StackConfig`]).

use wgpu_attention::kernels::attention::RelativeBuckets;
use wgpu_attention::kernels::rope::RopeScaling;

/// Score modifiers of a self-attention layer (see [`wgpu_attention::AttentionOptions`]): softcap, ALiBi, a
/// sliding window of `window` keys on each side (only before the query when causal), T5
/// relative-position buckets with a learned `[H, buckets]` table (`{name}.relative`; one-directional
/// in causal layers, as T5's decoder), learned attention sinks (`{name}.sinks`, `[H]`), cosine
/// scores with a learned per-head scale starting at `cosine` (`{name}.cosine_scale`, `[H]`),
/// key-norm clipping, and rotary position embeddings of Q and K (before all of the above).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ScoreOptions {
    /// Score softcap.
    pub softcap: Option<f32>,
    /// ALiBi with the geometric slopes.
    pub alibi: bool,
    /// Sliding window (keys on each side; before only, when causal).
    pub window: Option<usize>,
    /// T5 relative-position buckets with a learned table.
    pub relative: Option<RelativeBuckets>,
    /// Learned attention sinks.
    pub sinks: bool,
    /// Cosine scores with a learned per-head scale starting at this value.
    pub cosine: Option<f32>,
    /// Key-norm clipping.
    pub key_clip: Option<f32>,
    /// Rotary position embeddings of Q and K with this base (half layout, every head dim).
    pub rope_base: Option<f32>,
    /// How the rotary frequencies are stretched (with `rope_base`).
    pub rope_scaling: Option<RopeScaling>,
    /// Additive (Bahdanau) scores instead of dot products, with this score dim per head: the fused
    /// projection gives `a` and `b` (`[.., H, Da]` each) instead of Q and K, and the layer learns
    /// `{name}.additive_w` and `{name}.additive_bias` (`[H, Da]`). Excludes every other score term
    /// but the window.
    pub additive: Option<usize>,
}

wgpu_attention::config_setters!(ScoreOptions {
    softcap: Option<f32>,
    alibi: bool,
    window: Option<usize>,
    relative: Option<RelativeBuckets>,
    sinks: bool,
    cosine: Option<f32>,
    key_clip: Option<f32>,
    rope_base: Option<f32>,
    rope_scaling: Option<RopeScaling>,
    additive: Option<usize>,
});

impl ScoreOptions {
    /// The relative buckets a layer uses: causal layers see no key after the query, so their table
    /// is one-directional (T5's decoder).
    pub fn relative_for(&self, causal: bool) -> Option<RelativeBuckets> {
        self.relative.map(|r| RelativeBuckets {
            bidirectional: r.bidirectional && !causal,
            ..r
        })
    }
}
