//! The contract's plain types (SPEC.md): problem sizes and configurations that the kernels, the
//! layers and the CPU reference all name. Data and its validation only: no GPU code, and none of
//! either side's arithmetic, so the reference can check the kernels without sharing their code.

use crate::error::{Error, Result};

/// The sizes of one attention problem, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Batch size B.
    pub batch: usize,
    /// Query rows Lq.
    pub q_seq: usize,
    /// Keys Lk.
    pub kv_seq: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads Hkv (H % Hkv == 0).
    pub kv_heads: usize,
    /// Query/key head dim Dk.
    pub head_dim_qk: usize,
    /// Value head dim Dv.
    pub head_dim_v: usize,
}

impl AttentionShape {
    /// Multiply-adds counted as 2 FLOPs: `4 * B * H * Lq * Lk * D` for the forward (two products);
    /// halved under the causal mask when `Lq == Lk`, as is customary.
    pub fn forward_flops(&self, causal: bool) -> f64 {
        let d = (self.head_dim_qk + self.head_dim_v) as f64 / 2.0;
        let full =
            4.0 * (self.batch * self.heads) as f64 * self.q_seq as f64 * self.kv_seq as f64 * d;
        if causal {
            full / 2.0
        } else {
            full
        }
    }

    /// Backward FLOPs: five products (S recompute, dV, dP, dQ, dK), 2.5x the forward.
    pub fn backward_flops(&self, causal: bool) -> f64 {
        2.5 * self.forward_flops(causal)
    }
}

/// T5 relative-position buckets (Raffel et al. 2020): `buckets` in all (half per direction when
/// `bidirectional`); in each direction distances below a quarter (half, one-directional) of the
/// buckets get one each and larger ones log-spaced buckets up to `max_distance`, beyond which they
/// share the last. T5 uses `RelativeBuckets::new(32, 128, true)` in the encoder and
/// `(32, 128, false)` in the decoder's self-attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelativeBuckets {
    /// Buckets in all (both directions of a bidirectional table).
    pub buckets: usize,
    /// Distances at and past this share the last bucket of their direction.
    pub max_distance: usize,
    /// Keys after the query get buckets of their own (encoders); otherwise only keys before it
    /// count (causal decoders).
    pub bidirectional: bool,
}

impl RelativeBuckets {
    /// `buckets` in all, log-spaced up to `max_distance`; `bidirectional` for encoders.
    pub fn new(buckets: usize, max_distance: usize, bidirectional: bool) -> Self {
        Self {
            buckets,
            max_distance,
            bidirectional,
        }
    }
}

/// How the rotated dims are paired: `(2k, 2k + 1)` (GPT-J, RoFormer) or `(k, k + rotary_dim / 2)`
/// (GPT-NeoX, LLaMA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RopeLayout {
    /// Pairs `(2k, 2k + 1)`.
    Interleaved,
    /// Pairs `(k, k + rotary_dim / 2)`.
    Half,
}

/// A pointwise nonlinearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// GELU, tanh approximation (GPT-2's `gelu_new`, PyTorch's `gelu(approximate="tanh")`).
    Gelu,
    /// SiLU (swish), `x * sigmoid(x)`: LLaMA's gate in SwiGLU.
    Silu,
}

/// The normalisation in a model's residual blocks and at the end of a pre-LN stack.
// Exhaustive: the Transformer crate and its reference match every kind, so a new one is a compile
// error wherever it must be handled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Norm {
    /// `(x - mean) / sqrt(var + eps) * gamma + beta` (`{name}.gamma`, `{name}.beta`).
    #[default]
    LayerNorm,
    /// `x / sqrt(mean(x^2) + eps) * gamma` (LLaMA's; `{name}.gamma` only).
    RmsNorm,
}

/// How rotary frequencies are stretched for contexts longer than a model was trained on (Hugging
/// Face's `rope_scaling`). Each pair's inverse frequency `inv = base^(-2k / rotary_dim)` becomes:
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum RopeScaling {
    /// `inv / factor`: positions interpolated linearly (`"linear"`).
    Linear {
        /// Above 1.
        factor: f32,
    },
    /// LLaMA 3.1's (`"llama3"`): with wavelength `w = 2 pi / inv`, `inv` where `w` is below
    /// `original / high_freq_factor`, `inv / factor` where it is above `original /
    /// low_freq_factor`, and between them the blend `(1 - s) inv / factor + s inv`, `s = (original /
    /// w - low_freq_factor) / (high_freq_factor - low_freq_factor)`.
    Llama3 {
        /// Above 1.
        factor: f32,
        /// Below `high_freq_factor`.
        low_freq_factor: f32,
        /// Above `low_freq_factor`.
        high_freq_factor: f32,
        /// The context length the model was trained on.
        original_max_positions: usize,
    },
}

impl RopeScaling {
    /// Checks the factors (see each variant).
    pub fn check(&self) -> Result<()> {
        let positive = |arg: &'static str, x: f32| {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                Err(Error::shape(
                    arg,
                    format!("is {x}; it must be finite and positive"),
                ))
            }
        };
        match *self {
            RopeScaling::Linear { factor } => positive("rope_scaling.factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => {
                positive("rope_scaling.factor", factor)?;
                positive("rope_scaling.low_freq_factor", low_freq_factor)?;
                positive("rope_scaling.high_freq_factor", high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(Error::shape(
                        "rope_scaling.high_freq_factor",
                        format!(
                            "is {high_freq_factor}; it must exceed low_freq_factor {low_freq_factor}"
                        ),
                    ));
                }
                if original_max_positions == 0 {
                    return Err(Error::shape(
                        "rope_scaling.original_max_position_embeddings",
                        "must be positive",
                    ));
                }
                Ok(())
            }
        }
    }
}

/// Builder setters for a `#[non_exhaustive]` configuration struct: `$name(value)` sets field `$name`
/// and returns the struct, so callers outside its crate write `Config::default().lr(3e-4)` (a struct
/// literal there would break at every added field). Used by the workspace's crates for their
/// configurations.
#[doc(hidden)]
#[macro_export]
macro_rules! config_setters {
    ($ty:ty { $($field:ident: $t:ty),* $(,)? }) => {
        impl $ty {
            $(
                #[doc = concat!("Sets `", stringify!($field), "`.")]
                #[must_use]
                pub fn $field(mut self, value: $t) -> Self {
                    self.$field = value;
                    self
                }
            )*
        }
    };
}

/// AdamW hyper-parameters: `AdamWConfig::default()` with setters (`.lr(3e-4).max_grad_norm(Some(1.0))`).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the second moment's square root.
    pub eps: f32,
    /// Decoupled weight decay (applied to the parameter, times lr).
    pub weight_decay: f32,
    /// Clip the global gradient norm to this value; `None` does not clip.
    pub max_grad_norm: Option<f32>,
}

crate::config_setters!(AdamWConfig {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    max_grad_norm: Option<f32>,
});

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: None,
        }
    }
}

/// How a token is chosen from a row of logits: [`Sampling::greedy`] or [`Sampling::temperature`],
/// then [`Sampling::top_k`] and [`Sampling::top_p`].
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct Sampling {
    /// 0 chooses the arg max (greedy); otherwise softmax(logits / temperature).
    pub temperature: f32,
    /// Keep only the ids whose probability is at least the k-th largest (ties kept).
    pub top_k: Option<usize>,
    /// Keep only the most probable ids whose probabilities add up to at least `top_p` (nucleus
    /// sampling; ties at the boundary kept).
    pub top_p: Option<f32>,
    /// Seeds the draws; draw `n` of row `b` uses random numbers of `(seed, n, b)`.
    pub seed: u64,
}

impl Sampling {
    /// The arg max.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }

    /// Softmax sampling at `temperature` with `seed`.
    pub fn temperature(temperature: f32, seed: u64) -> Self {
        Self {
            temperature,
            top_k: None,
            top_p: None,
            seed,
        }
    }

    /// Keeps the `k` most probable ids (ties at the k-th kept).
    pub fn top_k(mut self, k: usize) -> Self {
        self.top_k = Some(k);
        self
    }

    /// Keeps the most probable ids whose probabilities add up to at least `p`.
    pub fn top_p(mut self, p: f32) -> Self {
        self.top_p = Some(p);
        self
    }

    /// Checks the options.
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::shape(
                "temperature",
                format!(
                    "is {}; it must be finite and at least 0 (0 is greedy)",
                    self.temperature
                ),
            ));
        }
        if self.top_k == Some(0) {
            return Err(Error::shape(
                "top_k",
                "is 0; keep at least one id (or None for all)",
            ));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(Error::shape(
                    "top_p",
                    format!("is {p}; it must be in (0, 1]"),
                ));
            }
        }
        Ok(())
    }

    /// Greedy: temperature 0 or a single id kept.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }
}
