//! The Transformer of "Attention Is All You Need" (pre-LN or post-LN), and its decoder-only
//! language-model configuration (`encoder_layers = 0`: no encoder, no cross-attention):
//!
//! ```text
//! memory = Encoder(Embed_src(src) + Pos)                       (padded keys masked by src_lens)
//! h      = Decoder(Embed_tgt(tgt_in) + Pos, memory)            (causal; padding masked by tgt_lens)
//! logits = h W_out^T + b_out;   loss = mean cross-entropy(logits, tgt_out), padding ignored
//! ```
//!
//! The model is built for one batch shape (`batch`, `src_len`, `tgt_len`, padded): every activation
//! and gradient is allocated then and reused by every step; a batch's tokens and lengths are written
//! into the same buffers. `forward` and `backward` record into the caller's encoder, so a training
//! step is one submission.

use crate::layers::decoder::{Decoder, DecoderInputs};
use crate::layers::embedding::{Embedding, PositionKind};
use crate::layers::encoder::Encoder;
use crate::layers::feed_forward::FeedForwardConfig;
use crate::layers::linear::Linear;
use crate::layers::params::Params;
use crate::layers::residual::{NormConfig, LN_EPS};
use crate::layers::scores::ScoreOptions;
use crate::layers::stack::StackConfig;
use crate::layers::{Precision, Recording};
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::attention::RelativeBuckets;
use wgpu_attention::kernels::cross_entropy::{
    cross_entropy_forward_into, CrossEntropyOutput, LossGradient,
};
use wgpu_attention::kernels::loss_scale::LossScale;
pub use wgpu_attention::spec::{Activation, Norm, RopeScaling};
use wgpu_attention::tensor::{GpuTensor, GpuTokens, SeqLens};

/// The model's hyper-parameters, stored in checkpoints as JSON. A field added after checkpoint format
/// 2 must carry `#[serde(default)]` (or `default = ...`) with the value that reproduces the behaviour
/// from before it existed, so that older checkpoints keep loading.
///
/// Outside this crate it is built from `TransformerConfig::default()` with one setter per field
/// (`.vocab(13).d_model(64)`): adding a field breaks no caller.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TransformerConfig {
    /// Token ids are `0..vocab`, shared by source and target.
    pub vocab: usize,
    /// Model width.
    pub d_model: usize,
    /// Attention heads (`d_model % heads == 0`).
    pub heads: usize,
    /// Feed-forward width.
    pub d_ff: usize,
    /// `0` builds the decoder-only language model.
    pub encoder_layers: usize,
    /// Decoder layers.
    pub decoder_layers: usize,
    /// Pre-LN blocks (with a final LayerNorm per stack) or post-LN.
    pub pre_ln: bool,
    /// Learned position tables instead of the fixed sinusoidal one (default false).
    #[serde(default)]
    pub learned_positions: bool,
    /// Padding id: ignored by the loss (positions past a length are masked in attention); default 0.
    #[serde(default)]
    pub pad_id: u32,
    /// Self-attention score softcap `cap * tanh(s / cap)` (default none).
    #[serde(default)]
    pub attention_softcap: Option<f32>,
    /// ALiBi in self-attention (default false).
    #[serde(default)]
    pub alibi: bool,
    /// Self-attention sliding window: `w` keys on each side in the encoder, the last `w` keys before
    /// each query (and itself) in the causal decoder (default none).
    #[serde(default)]
    pub attention_window: Option<usize>,
    /// T5 relative-position bias in self-attention: a learned `[H, buckets]` table per layer
    /// (`*.relative`), one-directional in the causal decoder (default none).
    #[serde(default)]
    pub relative_buckets: Option<RelativeBuckets>,
    /// Learned attention sinks in self-attention, `[H]` per layer (`*.sinks`; default false).
    #[serde(default)]
    pub attention_sinks: bool,
    /// Cosine-similarity scores in self-attention, with a learned per-head scale per layer
    /// (`*.cosine_scale`, `[H]`) starting at this value (default none).
    #[serde(default)]
    pub cosine_scores: Option<f32>,
    /// Key-norm clipping in self-attention (default none).
    #[serde(default)]
    pub key_norm_clip: Option<f32>,
    /// Rotary position embeddings in self-attention with this base (LLaMA's half layout, every head
    /// dim), instead of the additive position table (default none: additive positions).
    #[serde(default)]
    pub rope_base: Option<f32>,
    /// Additive (Bahdanau) scores in self-attention with this score dim per head, instead of dot
    /// products (cross-attention keeps dot products); only the window combines with it (default
    /// none).
    #[serde(default)]
    pub additive_attention: Option<usize>,
    /// The blocks' and stacks' normalisation: LayerNorm (default) or RMSNorm (LLaMA).
    #[serde(default)]
    pub norm: Norm,
    /// The norms' epsilon (default 1e-5).
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f32,
    /// The feed-forward nonlinearity (default GELU in its tanh form, GPT-2's).
    #[serde(default = "default_activation")]
    pub activation: Activation,
    /// Gated feed-forward blocks, `(act(x Wg^T) * x Wu^T) W2^T` (SwiGLU with SiLU, LLaMA's; GeGLU
    /// with GELU); `d_ff` is the width of the gate (default false).
    #[serde(default)]
    pub gated_feed_forward: bool,
    /// Biases in the attention and feed-forward projections (default true; LLaMA has none).
    #[serde(default = "default_true")]
    pub bias: bool,
    /// A bias in the output head (default true; GPT-2 and LLaMA have none).
    #[serde(default = "default_true")]
    pub output_bias: bool,
    /// The output head's weight is the target token embedding `tgt.embed` (GPT-2's tied
    /// embeddings; the head then has no `out.weight`; default false).
    #[serde(default)]
    pub tied_embeddings: bool,
    /// Key and value heads of self-attention (`kv_heads`, or `heads` when unset). grouped-query attention when below `heads`, which it
    /// must divide (default: `heads`).
    #[serde(default)]
    pub kv_heads: Option<usize>,
    /// How the rotary frequencies are stretched (needs `rope_base`; default none).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Rows of the learned position tables (GPT-2's `n_positions`); batches and decoding may use
    /// up to this many positions (default: the lengths the model is built for).
    #[serde(default)]
    pub max_positions: Option<usize>,
}

fn default_norm_eps() -> f32 {
    LN_EPS
}

fn default_activation() -> Activation {
    Activation::Gelu
}

wgpu_attention::config_setters!(TransformerConfig {
    vocab: usize,
    d_model: usize,
    heads: usize,
    d_ff: usize,
    encoder_layers: usize,
    decoder_layers: usize,
    pre_ln: bool,
    learned_positions: bool,
    pad_id: u32,
    attention_softcap: Option<f32>,
    alibi: bool,
    attention_window: Option<usize>,
    relative_buckets: Option<RelativeBuckets>,
    attention_sinks: bool,
    cosine_scores: Option<f32>,
    key_norm_clip: Option<f32>,
    rope_base: Option<f32>,
    additive_attention: Option<usize>,
    norm: Norm,
    norm_eps: f32,
    activation: Activation,
    gated_feed_forward: bool,
    bias: bool,
    output_bias: bool,
    tied_embeddings: bool,
    kv_heads: Option<usize>,
    rope_scaling: Option<RopeScaling>,
    max_positions: Option<usize>,
});

fn default_true() -> bool {
    true
}

impl Default for TransformerConfig {
    /// A small encoder-decoder (the examples' size): vocabulary 256, d_model 64, 4 heads, d_ff 256,
    /// 2 encoder and 2 decoder layers, pre-LN, sinusoidal positions, pad id 0, no score modifier.
    /// Set the fields that differ: `TransformerConfig::default().vocab(13)`.
    fn default() -> Self {
        Self {
            vocab: 256,
            d_model: 64,
            heads: 4,
            d_ff: 256,
            encoder_layers: 2,
            decoder_layers: 2,
            pre_ln: true,
            learned_positions: false,
            pad_id: 0,
            attention_softcap: None,
            alibi: false,
            attention_window: None,
            relative_buckets: None,
            attention_sinks: false,
            cosine_scores: None,
            key_norm_clip: None,
            rope_base: None,
            additive_attention: None,
            norm: Norm::LayerNorm,
            norm_eps: LN_EPS,
            activation: Activation::Gelu,
            gated_feed_forward: false,
            bias: true,
            output_bias: true,
            tied_embeddings: false,
            kv_heads: None,
            rope_scaling: None,
            max_positions: None,
        }
    }
}

impl TransformerConfig {
    /// Whether the model has an encoder (`encoder_layers > 0`); otherwise it is a decoder-only
    /// language model.
    pub fn has_encoder(&self) -> bool {
        self.encoder_layers > 0
    }

    /// How positions enter the model: rotary, learned or sinusoidal.
    pub fn position_kind(&self) -> PositionKind {
        match (self.rope_base, self.learned_positions) {
            (Some(_), _) => PositionKind::Rotary,
            (None, true) => PositionKind::Learned,
            (None, false) => PositionKind::Sinusoidal,
        }
    }

    /// Key and value heads of self-attention (`kv_heads`, or `heads` when unset).
    pub fn effective_kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// The rows of a learned position table for sequences of up to `len` positions.
    pub fn position_rows(&self, len: usize) -> usize {
        self.max_positions.unwrap_or(len)
    }

    /// The output head `out` (`out.weight [vocab, d_model]`, or `target`'s table when the
    /// embeddings are tied, and `out.bias` if `output_bias`).
    pub fn output_head(
        &self,
        ctx: &Context,
        params: &mut Params,
        target: &mut Embedding,
    ) -> Result<Linear> {
        if self.tied_embeddings {
            target.tie_output();
            return Linear::tied(ctx, params, "out", target.table(), self.output_bias);
        }
        Linear::with_bias(
            ctx,
            params,
            "out",
            self.d_model,
            self.vocab,
            self.output_bias,
        )
    }

    /// The input layer `{name}.embed` (+ `{name}.pos`) for `rows` tokens, its position table
    /// covering `positions`.
    pub fn embedding(
        &self,
        ctx: &Context,
        params: &mut Params,
        name: &str,
        rows: [usize; 2],
        positions: usize,
    ) -> Result<Embedding> {
        let kind = self.position_kind();
        let table = [self.vocab, self.d_model];
        Embedding::new(
            ctx,
            params,
            name,
            table,
            self.pad_id,
            (kind, positions),
            rows,
        )
    }

    /// The score modifiers of the self-attention layers.
    pub fn scores(&self) -> ScoreOptions {
        ScoreOptions {
            softcap: self.attention_softcap,
            alibi: self.alibi,
            window: self.attention_window,
            relative: self.relative_buckets,
            sinks: self.attention_sinks,
            cosine: self.cosine_scores,
            key_clip: self.key_norm_clip,
            rope_base: self.rope_base,
            rope_scaling: self.rope_scaling,
            additive: self.additive_attention,
        }
    }

    /// The sizes of a stack of `layers` layers whose sequences have at most `positions` tokens.
    pub fn stack(&self, layers: usize, positions: usize) -> StackConfig {
        StackConfig {
            d_model: self.d_model,
            heads: self.heads,
            d_ff: self.d_ff,
            layers,
            pre_ln: self.pre_ln,
            norm: NormConfig {
                kind: self.norm,
                eps: self.norm_eps,
            },
            feed_forward: FeedForwardConfig {
                activation: self.activation,
                gated: self.gated_feed_forward,
            },
            kv_heads: self.effective_kv_heads(),
            bias: self.bias,
            scores: self.scores(),
            positions,
            packed_sequences: None,
        }
    }

    /// Refuses a configuration no model can be built from, naming the field and its value (what
    /// building a model or a generator checks first).
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if c.vocab == 0 || c.d_model == 0 || c.d_ff == 0 || c.decoder_layers == 0 {
            return Err(Error::shape(
                "TransformerConfig",
                format!("{c:?}: vocab, d_model, d_ff and decoder_layers must be positive"),
            ));
        }
        for (arg, value) in [
            ("attention_softcap", c.attention_softcap),
            ("cosine_scores", c.cosine_scores),
            ("key_norm_clip", c.key_norm_clip),
        ] {
            if let Some(x) = value {
                if !(x.is_finite() && x > 0.0) {
                    return Err(Error::shape(
                        arg,
                        format!("is {x}; it must be finite and positive"),
                    ));
                }
            }
        }
        if c.rope_base.is_some() && c.learned_positions {
            return Err(Error::shape(
                "learned_positions/rope_base",
                "rotary embeddings replace the additive positions; set one of them",
            ));
        }
        if let Some(base) = c.rope_base {
            if !(base.is_finite() && base > 1.0) {
                return Err(Error::shape(
                    "rope_base",
                    format!("is {base}; it must be finite and above 1 (10000 in most models)"),
                ));
            }
        }
        if let Some(dim) = c.additive_attention {
            if dim == 0 || dim > wgpu_attention::kernels::additive::MAX_ADDITIVE_DIM {
                return Err(Error::shape(
                    "additive_attention",
                    format!(
                        "score dim {dim}; it must be 1 to {}",
                        wgpu_attention::kernels::additive::MAX_ADDITIVE_DIM
                    ),
                ));
            }
            let others = [
                ("attention_softcap", c.attention_softcap.is_some()),
                ("alibi", c.alibi),
                ("relative_buckets", c.relative_buckets.is_some()),
                ("attention_sinks", c.attention_sinks),
                ("cosine_scores", c.cosine_scores.is_some()),
                ("key_norm_clip", c.key_norm_clip.is_some()),
                ("rope_base", c.rope_base.is_some()),
            ];
            if let Some((arg, _)) = others.iter().find(|(_, set)| *set) {
                return Err(Error::shape(
                    arg,
                    "is a dot-product score term; additive_attention combines only with attention_window",
                ));
            }
        }
        if let Some(buckets) = c.relative_buckets {
            // The encoder uses the table as given; the causal decoder one-directionally, all its
            // buckets on one side (ScoreOptions::relative_for).
            buckets.check()?;
            RelativeBuckets {
                bidirectional: false,
                ..buckets
            }
            .check()?;
        }
        if c.heads == 0 || !c.d_model.is_multiple_of(c.heads) {
            return Err(Error::shape(
                "heads",
                format!(
                    "d_model {} is not a multiple of {} heads",
                    c.d_model, c.heads
                ),
            ));
        }
        let kv = c.effective_kv_heads();
        if kv == 0 || !c.heads.is_multiple_of(kv) {
            return Err(Error::shape(
                "kv_heads",
                format!("is {kv}; it must divide the {} query heads", c.heads),
            ));
        }
        if kv != c.heads && c.additive_attention.is_some() {
            return Err(Error::shape(
                "kv_heads",
                "grouped key/value heads are for dot-product scores, not additive_attention",
            ));
        }
        if !(c.norm_eps.is_finite() && c.norm_eps >= 0.0) {
            return Err(Error::shape(
                "norm_eps",
                format!("is {}; it must be finite and >= 0", c.norm_eps),
            ));
        }
        if let Some(scaling) = c.rope_scaling {
            if c.rope_base.is_none() {
                return Err(Error::shape(
                    "rope_scaling",
                    "stretches rotary frequencies; set rope_base too",
                ));
            }
            scaling.check()?;
        }
        if let Some(rows) = c.max_positions {
            if rows == 0 || c.position_kind() != PositionKind::Learned {
                return Err(Error::shape(
                    "max_positions",
                    format!("is {rows}; it sizes learned position tables (learned_positions) and must be positive"),
                ));
            }
        }
        if c.pad_id as usize >= c.vocab {
            return Err(Error::shape(
                "pad_id",
                format!("{} is not below vocab {}", c.pad_id, c.vocab),
            ));
        }
        Ok(())
    }
}

/// The padded batch shape a model is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchShape {
    /// Sequences per batch.
    pub batch: usize,
    /// Source length (ignored by the decoder-only model).
    pub src_len: usize,
    /// Decoder length.
    pub tgt_len: usize,
}

/// A packed batch's lengths as the model's lengths buffer holds them: the batch's `lens` (at most
/// `sequences`, summing to at most `rows`), the rows after them as one more sequence, empty ones to
/// fill.
fn packed_lens(lens: &[u32], sequences: usize, rows: usize) -> Result<Vec<u32>> {
    let used: u64 = lens.iter().map(|&l| l as u64).sum();
    if lens.len() > sequences || used > rows as u64 {
        return Err(Error::shape(
            "tgt_lens",
            format!(
                "has {} sequences of {used} rows; the packed model takes up to {sequences} \
                 sequences in {rows} rows",
                lens.len()
            ),
        ));
    }
    let mut all = lens.to_vec();
    all.resize(sequences, 0);
    all.push(rows as u32 - used as u32);
    Ok(all)
}

/// The packed batch shape a decoder-only model is built for ([`Transformer::packed`]): up to
/// `sequences` sequences of any lengths one after another in `rows` token rows, no padding between
/// them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedShape {
    /// The most sequences one batch packs.
    pub sequences: usize,
    /// Token rows per batch (the sequences' lengths sum to at most this).
    pub rows: usize,
}

/// One batch, padded to the model's [`BatchShape`] (row-major `[batch, len]`); for a packed model
/// ([`Transformer::packed`]), `tgt_in` and `tgt_out` are its `rows` tokens with the sequences one
/// after another, `tgt_lens` their lengths (at most `sequences` of them), and the rows after the
/// sequences hold `pad_id` targets.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// Source ids `[batch, src_len]` (encoder-decoder models).
    pub src: Vec<u32>,
    /// Each source's length.
    pub src_lens: Vec<u32>,
    /// Decoder input (e.g. BOS followed by the target) and the ids it must predict, position by
    /// position; `pad_id` where there is nothing to predict.
    pub tgt_in: Vec<u32>,
    /// The ids the decoder must predict, `[batch, tgt_len]`.
    pub tgt_out: Vec<u32>,
    /// Each target's length.
    pub tgt_lens: Vec<u32>,
}

/// An encoder-decoder Transformer, or a decoder-only language model, with its forward, backward and
/// loss on the GPU, for one fixed batch shape (all buffers allocated once).
pub struct Transformer {
    config: TransformerConfig,
    shape: BatchShape,
    /// Every parameter and its gradient, in two arenas.
    pub params: Params,
    source: Option<Embedding>,
    target: Embedding,
    encoder: Option<Encoder>,
    decoder: Decoder,
    output: Linear,
    encoder_lens: SeqLens,
    decoder_lens: SeqLens,
    cross_lens: SeqLens,
    targets: GpuTokens,
    logits: GpuTensor,
    loss: CrossEntropyOutput,
    d_logits: GpuTensor,
    d_decoder_out: GpuTensor,
    /// A packed model's sequences per batch ([`Transformer::packed`]).
    packed: Option<usize>,
    /// The Linear layers' products ([`Transformer::set_precision`]).
    precision: Precision,
}

impl Transformer {
    /// A decoder-only model for packed batches ([`PackedShape`]): its layers run over the batch's
    /// rows as one sequence of `rows` tokens, and attention, positions and rotary embeddings follow
    /// each packed sequence (`SeqLens::packed`), so no padding rows are stored or computed between
    /// sequences (the rows after the last one form one more sequence whose targets are `pad_id`).
    /// Logits, loss and gradients are those of the same sequences in a padded batch. The
    /// parameters are drawn from `seed` as [`Transformer::new`] draws them.
    pub fn packed(
        ctx: &Context,
        config: TransformerConfig,
        shape: PackedShape,
        seed: u64,
    ) -> Result<Self> {
        if config.has_encoder() || shape.sequences == 0 || shape.rows == 0 {
            return Err(Error::shape(
                "PackedShape",
                format!(
                    "{shape:?}: packed batches are for decoder-only models, with at least one \
                     sequence and one row"
                ),
            ));
        }
        let padded = BatchShape {
            batch: 1,
            src_len: 0,
            tgt_len: shape.rows,
        };
        Self::build(
            ctx,
            config,
            padded,
            Params::new(seed),
            Some(shape.sequences),
        )
    }

    /// Builds the model with parameters drawn from `seed`, for batches of `shape`.
    pub fn new(
        ctx: &Context,
        config: TransformerConfig,
        shape: BatchShape,
        seed: u64,
    ) -> Result<Self> {
        Self::with_params(ctx, config, shape, Params::new(seed))
    }

    /// A model whose parameters start at zero, for weights loaded right after (a published
    /// checkpoint): no initialisation is drawn on the host or uploaded.
    pub(crate) fn for_loading(
        ctx: &Context,
        config: TransformerConfig,
        shape: BatchShape,
    ) -> Result<Self> {
        Self::with_params(ctx, config, shape, Params::zeroed())
    }

    fn with_params(
        ctx: &Context,
        config: TransformerConfig,
        shape: BatchShape,
        params: Params,
    ) -> Result<Self> {
        Self::build(ctx, config, shape, params, None)
    }

    /// The model over `shape`, or with `packed` a packed model of up to that many sequences in
    /// `shape.tgt_len` rows (one more holds the rows after them).
    fn build(
        ctx: &Context,
        config: TransformerConfig,
        shape: BatchShape,
        mut params: Params,
        packed: Option<usize>,
    ) -> Result<Self> {
        config.validate()?;
        if shape.batch == 0 || shape.tgt_len == 0 || (config.has_encoder() && shape.src_len == 0) {
            return Err(Error::shape(
                "BatchShape",
                format!("{shape:?}: batch and lengths must be positive"),
            ));
        }
        let c = &config;
        let (src_rows, tgt_rows) = ([shape.batch, shape.src_len], [shape.batch, shape.tgt_len]);
        for (arg, len) in [("src_len", shape.src_len), ("tgt_len", shape.tgt_len)] {
            if len > c.position_rows(len) {
                return Err(Error::shape(
                    arg,
                    format!(
                        "is {len}; the learned position tables have {} rows (max_positions)",
                        c.position_rows(len)
                    ),
                ));
            }
        }
        let source = c
            .has_encoder()
            .then(|| {
                let positions = c.position_rows(shape.src_len);
                c.embedding(ctx, &mut params, "src", src_rows, positions)
            })
            .transpose()?;
        let mut target = c.embedding(
            ctx,
            &mut params,
            "tgt",
            tgt_rows,
            c.position_rows(shape.tgt_len),
        )?;
        let encoder = c
            .has_encoder()
            .then(|| {
                let stack = c.stack(c.encoder_layers, shape.src_len);
                Encoder::new(ctx, &mut params, "enc", &stack, src_rows)
            })
            .transpose()?;
        let memory_len = c.has_encoder().then_some(shape.src_len);
        let decoder_stack = StackConfig {
            packed_sequences: packed.map(|n| n + 1),
            ..c.stack(c.decoder_layers, shape.tgt_len)
        };
        let decoder = Decoder::new(
            ctx,
            &mut params,
            "dec",
            &decoder_stack,
            tgt_rows,
            memory_len,
        )?;
        let output = c.output_head(ctx, &mut params, &mut target)?;
        // One arena for the values and one for the gradients: AdamW updates all in one dispatch.
        params.pack(ctx)?;
        let rows = shape.batch * shape.tgt_len;
        let src_lens = vec![shape.src_len as u32; shape.batch];
        let tgt_lens = vec![shape.tgt_len as u32; shape.batch];
        let decoder_lens = match packed {
            // Until the first batch: one sequence of every row, the others empty.
            Some(n) => {
                let mut lens = vec![0; n + 1];
                lens[0] = shape.tgt_len as u32;
                SeqLens::packed(ctx, &lens, &lens)?
            }
            None => SeqLens::new(ctx, Some(&tgt_lens), Some(&tgt_lens))?,
        };
        Ok(Self {
            encoder_lens: SeqLens::new(ctx, Some(&src_lens), Some(&src_lens))?,
            decoder_lens,
            cross_lens: SeqLens::new(ctx, Some(&tgt_lens), Some(&src_lens))?,
            targets: GpuTokens::from_slice(ctx, &vec![c.pad_id; rows], &[rows])?,
            logits: GpuTensor::zeros(ctx, &[rows, c.vocab])?,
            loss: CrossEntropyOutput {
                loss: GpuTensor::zeros(ctx, &[2])?,
                row_loss: GpuTensor::zeros(ctx, &[rows])?,
                row_lse: GpuTensor::zeros(ctx, &[rows])?,
            },
            d_logits: GpuTensor::zeros(ctx, &[rows, c.vocab])?,
            d_decoder_out: GpuTensor::zeros(ctx, &[shape.batch, shape.tgt_len, c.d_model])?,
            packed,
            precision: Precision::F32,
            config,
            shape,
            params,
            source,
            target,
            encoder,
            decoder,
            output,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    /// The batch shape its buffers hold.
    pub fn shape(&self) -> &BatchShape {
        &self.shape
    }

    /// Writes a batch's tokens and lengths into the model's input buffers (validated first: on
    /// error nothing is written).
    pub fn set_batch(&mut self, ctx: &Context, batch: &Batch) -> Result<()> {
        let s = self.shape;
        let c = self.config;
        let check_len = |arg: &'static str, v: &[u32], n: usize| {
            if v.len() != n {
                return Err(Error::shape(
                    arg,
                    format!(
                        "has {} entries; the model's batch shape {s:?} needs {n}",
                        v.len()
                    ),
                ));
            }
            Ok(())
        };
        let check_ids =
            |arg: &'static str, v: &[u32]| match v.iter().position(|&t| t as usize >= c.vocab) {
                Some(i) => Err(Error::shape(
                    arg,
                    format!("id {} at {i} is not below vocab {}", v[i], c.vocab),
                )),
                None => Ok(()),
            };
        let check_lens = |arg: &'static str, v: &[u32], max: usize| match v
            .iter()
            .find(|&&l| l as usize > max)
        {
            Some(l) => Err(Error::shape(
                arg,
                format!("length {l} exceeds the padded length {max}"),
            )),
            None => Ok(()),
        };
        let tokens = s.batch * s.tgt_len;
        check_len("tgt_in", &batch.tgt_in, tokens)?;
        check_len("tgt_out", &batch.tgt_out, tokens)?;
        check_ids("tgt_in", &batch.tgt_in)?;
        check_ids("tgt_out", &batch.tgt_out)?;
        if let Some(sequences) = self.packed {
            let lens = packed_lens(&batch.tgt_lens, sequences, s.tgt_len)?;
            let used = s.tgt_len - *lens.last().expect("one more than the sequences") as usize;
            if let Some(i) = batch.tgt_out[used..].iter().position(|&t| t != c.pad_id) {
                return Err(Error::shape(
                    "tgt_out",
                    format!(
                        "row {} is after the packed sequences ({used} rows) but its target is {}, \
                         not pad_id {}",
                        used + i,
                        batch.tgt_out[used + i],
                        c.pad_id
                    ),
                ));
            }
            self.target.tokens.write(ctx, &batch.tgt_in)?;
            self.targets.write(ctx, &batch.tgt_out)?;
            return self.decoder_lens.write(ctx, Some(&lens), Some(&lens));
        }
        check_len("tgt_lens", &batch.tgt_lens, s.batch)?;
        check_lens("tgt_lens", &batch.tgt_lens, s.tgt_len)?;
        if c.has_encoder() {
            check_len("src", &batch.src, s.batch * s.src_len)?;
            check_len("src_lens", &batch.src_lens, s.batch)?;
            check_ids("src", &batch.src)?;
            check_lens("src_lens", &batch.src_lens, s.src_len)?;
        }
        self.target.tokens.write(ctx, &batch.tgt_in)?;
        self.targets.write(ctx, &batch.tgt_out)?;
        let tgt = Some(batch.tgt_lens.as_slice());
        self.decoder_lens.write(ctx, tgt, tgt)?;
        if let Some(source) = &mut self.source {
            let src = Some(batch.src_lens.as_slice());
            source.tokens.write(ctx, &batch.src)?;
            self.encoder_lens.write(ctx, src, src)?;
            self.cross_lens.write(ctx, tgt, src)?;
        }
        Ok(())
    }

    /// A packed model's sequences per batch ([`Transformer::packed`]), `None` for a padded one.
    pub fn packed_sequences(&self) -> Option<usize> {
        self.packed
    }

    fn decoder_inputs(&self) -> DecoderInputs<'_> {
        let memory = match (&self.encoder, &self.source) {
            (Some(e), Some(s)) => Some((e.output(&s.x), &self.cross_lens)),
            _ => None,
        };
        DecoderInputs {
            self_lens: &self.decoder_lens,
            memory,
        }
    }

    /// Sets the arithmetic of the Linear layers' products from the next forward on. Mixed
    /// precision allocates the f16 weight copies (refreshed at the start of every forward) and
    /// needs `SHADER_F16`; train it with a loss scale ([`crate::training::Trainer::with_precision`]).
    pub fn set_precision(&mut self, ctx: &Context, precision: Precision) -> Result<()> {
        if precision == Precision::Mixed {
            ctx.require_f16(
                "mixed precision",
                "; train in f32 on this adapter (the GL back end has no f16)",
            )?;
            self.params.enable_half_copies(ctx)?;
        }
        self.precision = precision;
        Ok(())
    }

    /// The arithmetic of the Linear layers' products.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// A recording of this model's layers in its precision.
    fn recording<'a>(
        &'a self,
        ctx: &'a Context,
        encoder: &'a mut wgpu::CommandEncoder,
    ) -> Recording<'a> {
        Recording::new(ctx, encoder, &self.params).with_precision(self.precision)
    }

    /// Records the forward pass through the loss, in one compute pass.
    pub fn forward(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<()> {
        ctx.with_one_pass(encoder, "transformer forward", |encoder| {
            self.record_forward(ctx, encoder)
        })
    }

    fn record_forward(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<()> {
        if self.precision == Precision::Mixed {
            self.params.record_half_copies(ctx, encoder)?;
        }
        let rec = &mut self.recording(ctx, encoder);
        if let (Some(source), Some(enc)) = (&self.source, &self.encoder) {
            source.forward(rec)?;
            enc.forward(rec, &source.x, &self.encoder_lens)?;
        }
        match self.packed {
            Some(_) => self.target.forward_packed(rec, &self.decoder_lens)?,
            None => self.target.forward(rec)?,
        }
        self.decoder
            .forward(rec, &self.target.x, self.decoder_inputs())?;
        let h = self.flat_rows(self.decoder.output(&self.target.x))?;
        self.output.forward(rec, &h, &self.logits)?;
        let ignore = Some(self.config.pad_id);
        cross_entropy_forward_into(
            ctx,
            rec.encoder,
            &self.logits,
            &self.targets,
            ignore,
            &self.loss,
        )
    }

    /// Records the backward pass of the mean loss into every parameter gradient (after
    /// [`Transformer::forward`] in the same or an earlier submission), in one compute pass.
    pub fn backward(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<()> {
        self.backward_scaled(ctx, encoder, None)
    }

    /// [`Transformer::backward`] of the loss times `scale` (mixed precision's loss scale): every
    /// gradient is `S` times the loss's, for the optimizer to unscale
    /// ([`wgpu_attention::kernels::optimizer::AdamW::enable_loss_scaling`]).
    pub fn backward_scaled(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        scale: Option<&LossScale>,
    ) -> Result<()> {
        ctx.with_one_pass(encoder, "transformer backward", |encoder| {
            self.record_backward(ctx, encoder, scale)
        })
    }

    fn record_backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        scale: Option<&LossScale>,
    ) -> Result<()> {
        let rec = &mut self.recording(ctx, encoder);
        let ignore = Some(self.config.pad_id);
        LossGradient::new(&self.logits, &self.targets, ignore, &self.loss)
            .scaled(scale)
            .record(ctx, rec.encoder, &self.d_logits)?;
        let dec_out = self.decoder.output(&self.target.x);
        let d_dec_out = &self.d_decoder_out;
        self.output.backward(
            rec,
            &self.flat_rows(dec_out)?,
            &self.d_logits,
            &self.flat_rows(d_dec_out)?,
        )?;
        self.decoder
            .backward(rec, &self.target.x, self.decoder_inputs(), d_dec_out)?;
        let d_target = self.decoder.d_input(d_dec_out);
        match self.packed {
            Some(_) => self
                .target
                .backward_packed(rec, d_target, &self.decoder_lens)?,
            None => self.target.backward(rec, d_target)?,
        }
        if let (Some(source), Some(enc), Some(d_memory)) =
            (&self.source, &self.encoder, self.decoder.d_memory())
        {
            enc.backward(rec, &source.x, &self.encoder_lens, d_memory)?;
            source.backward(rec, enc.d_input(d_memory))?;
        }
        Ok(())
    }

    fn flat_rows(&self, t: &GpuTensor) -> Result<GpuTensor> {
        t.reshape(&[self.shape.batch * self.shape.tgt_len, self.config.d_model])
    }

    /// The encoder (if any) and the decoder.
    pub(crate) fn stacks(&self) -> (Option<&Encoder>, &Decoder) {
        (self.encoder.as_ref(), &self.decoder)
    }

    /// The encoder's, the decoder's and cross-attention's lengths of the current batch.
    pub(crate) fn lens(&self) -> (&SeqLens, &SeqLens, &SeqLens) {
        (&self.encoder_lens, &self.decoder_lens, &self.cross_lens)
    }

    /// Query rows of an attention site: the source length in the encoder, the target length in the
    /// decoder.
    pub(crate) fn query_len(&self, site: crate::model::AttentionSite) -> usize {
        match site {
            crate::model::AttentionSite::EncoderSelf(_) => self.shape.src_len,
            _ => self.shape.tgt_len,
        }
    }

    /// `[batch * tgt_len, vocab]` logits of the last forward.
    pub fn logits(&self) -> &GpuTensor {
        &self.logits
    }

    /// `[mean loss over non-padding targets, their count]` of the last forward.
    pub fn loss(&self) -> &GpuTensor {
        &self.loss.loss
    }

    /// Parameter tensors and their gradients, in one fixed order (names in `params.names()`).
    pub fn parameters(&self) -> (Vec<&GpuTensor>, Vec<&GpuTensor>) {
        (
            self.params.values().iter().collect(),
            self.params.grads().iter().collect(),
        )
    }
}
