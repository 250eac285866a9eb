//! Multi-head attention layer on the fused kernels. Self-attention projects Q, K, V with one fused
//! `[3 d, d]` Linear; cross-attention projects Q from the decoder stream and K, V with one fused
//! `[2 d, d]` Linear from the encoder output (`memory`). Heads are strided views of the projections
//! and dQ, dK, dV are written into views of the packed projection gradients: no transposes, no copies.

use crate::layers::linear::Linear;
use crate::layers::params::{Init, ParamId, Params};
pub use crate::layers::scores::ScoreOptions;
use crate::layers::stack::StackConfig;
use crate::layers::{InputGrad, Recording};
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::additive::{
    additive_backward_into, additive_backward_workspace, additive_decode_into,
    additive_forward_into, additive_probabilities, AdditiveScores,
};
use wgpu_attention::kernels::attention::{
    attention_backward_into, attention_backward_workspace, attention_decode_f16_into,
    attention_decode_int8_into, attention_decode_into, attention_decode_paged_into,
    attention_forward_into, attention_probabilities, attention_sinks_backward_into,
    AttentionOptions, AttentionShape, BackwardViews, ForwardViews, HalfCache, QuantizedCache,
    RelativeBuckets,
};
use wgpu_attention::kernels::kv_cache::{BlockTable, KvFormat, KvStorage};
use wgpu_attention::kernels::linear::Epilogue;
use wgpu_attention::kernels::rope::{
    rope_backward_into, rope_backward_packed_into, rope_forward_cached_into, rope_forward_into,
    rope_forward_packed_into, RopeLayout, RopeTable,
};
use wgpu_attention::tensor::{GpuTensor, HeadsView, PackedSide, SeqLens};

/// The attention shape of self-attention with additive scores of `dim` per head.
fn self_shape(
    batch: usize,
    len: usize,
    heads: usize,
    dim: usize,
    head_dim: usize,
) -> AttentionShape {
    AttentionShape {
        batch,
        q_seq: len,
        kv_seq: len,
        heads,
        kv_heads: heads,
        head_dim_qk: dim,
        head_dim_v: head_dim,
    }
}

/// A self-attention layer's key/value cache when decoding (keys and values in one [`KvFormat`]).
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum LayerCache<'a> {
    /// Keys and values `[B, max_len, Hkv, D]`, one row of each per sequence.
    Contiguous([&'a KvStorage; 2]),
    /// Key and value pools `[blocks * page, Hkv, D]` shared by the sequences, read and written
    /// through a block table (see `wgpu_attention_serve::PagedKvCache`).
    Paged([&'a KvStorage; 2], &'a BlockTable),
}

impl<'a> LayerCache<'a> {
    /// The positions a sequence can hold.
    fn capacity(&self) -> usize {
        match self {
            LayerCache::Contiguous([keys, _]) => keys.shape().get(1).copied().unwrap_or(0),
            LayerCache::Paged(_, table) => table.capacity(),
        }
    }

    /// Keys, values and the block table of a paged cache.
    fn parts(&self) -> ([&'a KvStorage; 2], Option<&'a BlockTable>) {
        match *self {
            LayerCache::Contiguous(kv) => (kv, None),
            LayerCache::Paged(kv, table) => (kv, Some(table)),
        }
    }
}

/// The learned parameters and workspace of additive scores.
struct Additive {
    dim: usize,
    w: ParamId,
    bias: ParamId,
    workspace: GpuTensor,
}

/// Self-attention (optionally causal) or cross-attention over a memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Queries, keys and values from the input.
    SelfAttention {
        /// With the causal mask (decoders).
        causal: bool,
    },
    /// Cross-attention: queries from the input, keys and values from a memory (the encoder output).
    Cross,
}

/// Multi-head attention: the Q, K, V projections (one fused projection for self-attention), the
/// fused attention kernel with the layer's masks and score options, and the output projection.
pub struct MultiHeadAttention {
    kind: AttentionKind,
    name: String,
    scores: ScoreOptions,
    /// Learned score parameters: sinks `[H]`, relative table `[H, buckets]`, cosine scale `[H]`.
    sinks: Option<ParamId>,
    relative: Option<(RelativeBuckets, ParamId)>,
    cosine_scale: Option<ParamId>,
    /// Rotary embeddings: Q and K are rotated in place in the projection after it is computed, and
    /// dQ, dK rotated back in place in its gradient.
    rope: Option<RopeTable>,
    /// Additive scores: the score dim, the score vector and bias, and the backward's workspace.
    additive: Option<Additive>,
    shape: AttentionShape,
    heads: usize,
    /// Self-attention's key and value heads (`heads` in cross-attention).
    kv_heads: usize,
    d_model: usize,
    /// Self: the fused QKV projection. Cross: the Q projection.
    pub query: Linear,
    /// Cross only: the fused KV projection of the memory.
    pub key_value: Option<Linear>,
    /// The output projection.
    pub output: Linear,
    /// `[B, Lq, 3d]` (self) or `[B, Lq, d]` (cross), and its gradient.
    proj: GpuTensor,
    d_proj: GpuTensor,
    /// Cross only: `[B, Lk, 2d]` and its gradient.
    kv_proj: Option<GpuTensor>,
    d_kv_proj: Option<GpuTensor>,
    /// Attention output `[B, Lq, H, d/H]` (= `[B, Lq, d]`), its lse and gradient.
    attn: GpuTensor,
    lse: GpuTensor,
    d_attn: GpuTensor,
    workspace: GpuTensor,
    /// Sequences a packed batch may hold (`StackConfig::packed_sequences`): lse and the workspace
    /// are sized for them.
    packed_sequences: Option<usize>,
}

/// Where one call's attention reads and writes: the padded layout, or for packed lengths each
/// sequence's rows of the layer's buffers and the leading part of lse and the workspace.
struct CallLayout<'a> {
    packed: Option<&'a SeqLens>,
    lse: GpuTensor,
    workspace: GpuTensor,
    shape: AttentionShape,
}

impl MultiHeadAttention {
    /// A layer of stack `c` (width, heads, key/value heads, biases, additive scores) for `rows =
    /// [batch, query length]`, `memory_len` the key length of cross-attention. Self-attention's
    /// fused projection is `[Q; K; V]` with `kv_heads` key and value heads (GQA); cross-attention
    /// has as many key and value heads as query heads and dot-product scores.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        kind: AttentionKind,
        c: &StackConfig,
        rows: [usize; 2],
        memory_len: usize,
    ) -> Result<Self> {
        let (d_model, heads) = (c.d_model, c.heads);
        let self_attention = matches!(kind, AttentionKind::SelfAttention { .. });
        let additive = c.scores.additive.filter(|_| self_attention);
        let kv_heads = if self_attention { c.kv_heads } else { heads };
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(Error::shape(
                "kv_heads",
                format!("is {kv_heads}; it must divide the {heads} query heads"),
            ));
        }
        if additive.is_some() && kv_heads != heads {
            return Err(Error::shape(
                "kv_heads",
                "additive scores have one key projection per query head; grouped heads are for dot products",
            ));
        }
        let [b, lq] = rows;
        let hd = d_model / heads;
        // Width of the projections that meet in the scores: Q and K, or additive's a and b.
        let qk_dim = additive.unwrap_or(hd);
        let proj_width = heads * qk_dim + kv_heads * (qk_dim + hd);
        let (query, key_value) = match kind {
            AttentionKind::SelfAttention { .. } => (
                Linear::with_bias(
                    ctx,
                    params,
                    &format!("{name}.qkv"),
                    d_model,
                    proj_width,
                    c.bias,
                )?,
                None,
            ),
            AttentionKind::Cross => (
                Linear::with_bias(ctx, params, &format!("{name}.q"), d_model, d_model, c.bias)?,
                Some(Linear::with_bias(
                    ctx,
                    params,
                    &format!("{name}.kv"),
                    d_model,
                    2 * d_model,
                    c.bias,
                )?),
            ),
        };
        let proj_width = if self_attention { proj_width } else { d_model };
        let output = Linear::with_bias(
            ctx,
            params,
            &format!("{name}.out"),
            d_model,
            d_model,
            c.bias,
        )?;
        let lk = if kind == AttentionKind::Cross {
            memory_len
        } else {
            lq
        };
        let kv = |w| GpuTensor::zeros(ctx, &[b, lk, w]);
        if let Some(sequences) = c.packed_sequences {
            if !self_attention || additive.is_some() || b != 1 || sequences == 0 {
                return Err(Error::shape(
                    "packed_sequences",
                    format!(
                        "is {sequences}; packed batches are for dot-product self-attention over one \
                         row of sequences (batch 1, at least one sequence), not {kind:?} with batch {b}"
                    ),
                ));
            }
        }
        // lse and the backward's workspace hold a packed batch's [sequences, H, longest] rows.
        let stat_rows = c.packed_sequences.unwrap_or(b);
        let shape = AttentionShape {
            batch: b,
            q_seq: lq,
            kv_seq: lk,
            heads,
            kv_heads,
            head_dim_qk: qk_dim,
            head_dim_v: hd,
        };
        let additive = match additive {
            Some(dim) => {
                let shape = [heads, dim];
                let bound = 1.0 / (dim as f32).sqrt();
                // The bias starts spread over +-1: at 0, tanh is near-linear there and the query's
                // term w . a cancels in the softmax, so the scores start query-independent and learn
                // slowly (examples/additive_task: 0.25 held-out accuracy after 600 steps with a zero
                // bias, 1.00 with this one).
                Some(Additive {
                    dim,
                    w: params.add(
                        ctx,
                        format!("{name}.additive_w"),
                        &shape,
                        Init::Uniform(bound),
                    )?,
                    bias: params.add(
                        ctx,
                        format!("{name}.additive_bias"),
                        &shape,
                        Init::Uniform(1.0),
                    )?,
                    workspace: additive_backward_workspace(
                        ctx,
                        &self_shape(b, lq, heads, dim, hd),
                    )?,
                })
            }
            None => None,
        };
        Ok(Self {
            kind,
            name: name.to_string(),
            scores: ScoreOptions::default(),
            sinks: None,
            relative: None,
            cosine_scale: None,
            rope: None,
            additive,
            shape,
            heads,
            kv_heads,
            d_model,
            query,
            key_value,
            output,
            proj: GpuTensor::zeros(ctx, &[b, lq, proj_width])?,
            d_proj: GpuTensor::zeros(ctx, &[b, lq, proj_width])?,
            kv_proj: (kind == AttentionKind::Cross)
                .then(|| kv(2 * d_model))
                .transpose()?,
            d_kv_proj: (kind == AttentionKind::Cross)
                .then(|| kv(2 * d_model))
                .transpose()?,
            attn: GpuTensor::zeros(ctx, &[b, lq, heads, hd])?,
            lse: GpuTensor::zeros(ctx, &[stat_rows, heads, lq])?,
            d_attn: GpuTensor::zeros(ctx, &[b, lq, heads, hd])?,
            workspace: attention_backward_workspace(
                ctx,
                &AttentionShape {
                    batch: stat_rows,
                    ..shape
                },
            )?,
            packed_sequences: c.packed_sequences,
        })
    }

    /// Q, K, V views of `proj` (and `kv_proj` for cross-attention); with additive scores, a, b, V.
    fn split(&self, proj: &GpuTensor, kv_proj: Option<&GpuTensor>) -> Result<[HeadsView; 3]> {
        let (h, kv, d) = (self.heads, self.kv_heads, self.d_model);
        let hd = d / h;
        let qk = self.additive.as_ref().map_or(hd, |a| a.dim);
        Ok(match kv_proj {
            None => [
                proj.split_heads(0, h, qk)?,
                proj.split_heads(h * qk, kv, qk)?,
                proj.split_heads(h * qk + kv * qk, kv, hd)?,
            ],
            Some(kv) => [
                proj.split_heads(0, h, hd)?,
                kv.split_heads(0, h, hd)?,
                kv.split_heads(d, h, hd)?,
            ],
        })
    }

    fn check_memory(&self, memory: Option<&GpuTensor>) -> Result<()> {
        match (self.kind, memory) {
            (AttentionKind::Cross, None) => Err(Error::shape(
                "memory",
                "cross-attention needs the encoder output",
            )),
            (AttentionKind::SelfAttention { .. }, Some(_)) => Err(Error::shape(
                "memory",
                "self-attention takes no memory; build the layer with AttentionKind::Cross",
            )),
            _ => Ok(()),
        }
    }

    /// Applies score modifiers (self-attention only: positions of a memory are not the queries'),
    /// adding their learned parameters to `params`; rotary tables cover `positions` positions.
    pub fn with_scores(
        mut self,
        ctx: &Context,
        params: &mut Params,
        scores: ScoreOptions,
        positions: usize,
    ) -> Result<Self> {
        if scores != ScoreOptions::default() && self.kind == AttentionKind::Cross {
            return Err(Error::shape(
                "scores",
                "score modifiers apply to self-attention; cross-attention has none",
            ));
        }
        let h = self.heads;
        if scores.sinks {
            let name = format!("{}.sinks", self.name);
            self.sinks = Some(params.add(ctx, name, &[h], Init::Zeros)?);
        }
        if let Some(buckets) = scores.relative_for(self.causal()) {
            buckets.check()?;
            let name = format!("{}.relative", self.name);
            let id = params.add(ctx, name, &[h, buckets.buckets], Init::Uniform(0.1))?;
            self.relative = Some((buckets, id));
        }
        if let Some(base) = scores.rope_base {
            let hd = self.d_model / h;
            self.rope = Some(RopeTable::scaled(
                ctx,
                base.into(),
                hd,
                RopeLayout::Half,
                scores.rope_scaling,
                positions,
            )?);
        }
        if let Some(init) = scores.cosine {
            let name = format!("{}.cosine_scale", self.name);
            self.cosine_scale = Some(params.add(ctx, name, &[h], Init::Constant(init))?);
        }
        self.scores = scores;
        Ok(self)
    }

    fn causal(&self) -> bool {
        matches!(self.kind, AttentionKind::SelfAttention { causal: true })
    }

    fn options<'a>(&self, p: &'a Params, lens: &'a SeqLens) -> AttentionOptions<'a> {
        let causal = self.causal();
        let s = self.scores;
        let mut opts = AttentionOptions::new()
            .causal(causal)
            .seq_lens(lens)
            .alibi(s.alibi);
        if let Some(cap) = s.softcap {
            opts = opts.softcap(cap);
        }
        if let Some(w) = s.window {
            opts = opts.window(w, if causal { 0 } else { w });
        }
        if let Some(id) = self.sinks {
            opts = opts.sinks(p.value(id));
        }
        if let Some((buckets, id)) = self.relative {
            opts = opts.relative_buckets_learned(buckets, p.value(id), p.grad(id));
        }
        if let Some(id) = self.cosine_scale {
            opts = opts.cosine_learned(p.value(id), p.grad(id));
        }
        if let Some(c) = s.key_clip {
            opts = opts.key_norm_clip(c);
        }
        opts
    }

    /// The layout of a call with `lens`: packed lengths need a layer built for packed batches and
    /// select each sequence's rows; others use the padded buffers as they are.
    fn layout<'a>(&self, lens: &'a SeqLens) -> Result<CallLayout<'a>> {
        self.layout_of(lens, false)
    }

    /// [`MultiHeadAttention::layout`]; with `cached` the keys are a cache's (its capacity checked by
    /// [`SeqLens::check_decode`]), so only the new rows must fit the layer's: a packed prefill.
    fn layout_of<'a>(&self, lens: &'a SeqLens, cached: bool) -> Result<CallLayout<'a>> {
        let s = self.shape;
        if !lens.is_packed() {
            return Ok(CallLayout {
                packed: None,
                lse: self.padded_lse()?,
                workspace: GpuTensor::view_of(&self.workspace, 0, &[s.batch, s.heads, s.q_seq, 2])?,
                shape: s,
            });
        }
        let capacity = self.packed_sequences.unwrap_or(0);
        let longest =
            |l: Option<&[u32]>| l.into_iter().flatten().copied().max().unwrap_or(0).max(1);
        let (q_seq, kv_seq) = (
            longest(lens.q_lens()) as usize,
            longest(lens.kv_lens()) as usize,
        );
        let rows = match cached {
            true => q_seq,
            false => q_seq.max(kv_seq),
        };
        if lens.batch() > capacity || rows > s.q_seq {
            return Err(Error::shape(
                "seq_lens",
                format!(
                    "hold {} packed sequences of up to {} rows; layer {} takes up to {capacity} \
                     sequences (StackConfig::packed_sequences) of up to {} rows",
                    lens.batch(),
                    rows,
                    self.name,
                    s.q_seq
                ),
            ));
        }
        let n = lens.batch();
        Ok(CallLayout {
            packed: Some(lens),
            lse: GpuTensor::view_of(&self.lse, 0, &[n, s.heads, q_seq])?,
            workspace: GpuTensor::view_of(&self.workspace, 0, &[n, s.heads, q_seq, 2])?,
            shape: AttentionShape {
                batch: n,
                q_seq,
                kv_seq,
                ..s
            },
        })
    }

    /// lse of the padded layout, `[B, H, Lq]`.
    fn padded_lse(&self) -> Result<GpuTensor> {
        let s = self.shape;
        GpuTensor::view_of(&self.lse, 0, &[s.batch, s.heads, s.q_seq])
    }

    /// `view` of the layer's buffers as `layout` reads it (packed on `side`, or as it is).
    fn place(view: HeadsView, side: PackedSide, layout: &CallLayout<'_>) -> Result<HeadsView> {
        match layout.packed {
            Some(lens) => view.packed(lens, side),
            None => Ok(view),
        }
    }

    /// Q, K, V of `proj` (and `kv_proj`) placed by `layout`.
    fn placed_split(
        &self,
        proj: &GpuTensor,
        kv_proj: Option<&GpuTensor>,
        layout: &CallLayout<'_>,
    ) -> Result<[HeadsView; 3]> {
        let [q, k, v] = self.split(proj, kv_proj)?;
        Ok([
            Self::place(q, PackedSide::Queries, layout)?,
            Self::place(k, PackedSide::Keys, layout)?,
            Self::place(v, PackedSide::Keys, layout)?,
        ])
    }

    /// Rotates Q and K (or dQ and dK, `backward`) in place, at each sequence's positions.
    fn rotate(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        [q, k]: [&HeadsView; 2],
        layout: &CallLayout<'_>,
        backward: bool,
    ) -> Result<()> {
        let Some(rope) = &self.rope else {
            return Ok(());
        };
        for x in [q, k] {
            match (layout.packed, backward) {
                (None, false) => rope_forward_into(ctx, encoder, x, rope, 0)?,
                (None, true) => rope_backward_into(ctx, encoder, x, rope, 0)?,
                (Some(lens), false) => rope_forward_packed_into(ctx, encoder, x, rope, lens, 0)?,
                (Some(lens), true) => rope_backward_packed_into(ctx, encoder, x, rope, lens, 0)?,
            }
        }
        Ok(())
    }

    fn flat(&self, t: &GpuTensor) -> Result<GpuTensor> {
        let s = t.shape();
        t.reshape(&[s[0], s[1], self.d_model])
    }

    /// `y = Attention(x, memory) + residual`; `lens` masks padded queries and keys.
    pub fn forward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        memory: Option<&GpuTensor>,
        lens: &SeqLens,
        y: &GpuTensor,
        residual: Option<&GpuTensor>,
    ) -> Result<()> {
        let Recording { ctx, params: p, .. } = *rec;
        self.check_memory(memory)?;
        self.query.forward(rec, x, &self.proj)?;
        if let (Some(kv), Some(kv_proj), Some(memory)) = (&self.key_value, &self.kv_proj, memory) {
            kv.forward(rec, memory, kv_proj)?;
        }
        let layout = self.layout(lens)?;
        let [q, k, v] = self.placed_split(&self.proj, self.kv_proj.as_ref(), &layout)?;
        self.rotate(ctx, rec.encoder, [&q, &k], &layout, false)?;
        let out = Self::place(self.attn.heads()?, PackedSide::Queries, &layout)?;
        let views = ForwardViews {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &layout.lse,
        };
        let opts = self.options(p, lens);
        match &self.additive {
            Some(add) => {
                let scores = AdditiveScores {
                    w: p.value(add.w),
                    bias: p.value(add.bias),
                };
                additive_forward_into(ctx, rec.encoder, &views, scores, &opts)?;
            }
            None => attention_forward_into(ctx, rec.encoder, &views, &opts)?,
        }
        let add = Epilogue {
            activation: None,
            residual,
        };
        self.output
            .forward_epilogue(rec, &self.flat(&self.attn)?, add, y)
    }

    /// Decoding, cross-attention: projects the memory's keys and values once per source (they
    /// stay in the layer for every [`MultiHeadAttention::forward_cached`] step).
    pub fn prepare_memory(&self, rec: &mut Recording<'_>, memory: &GpuTensor) -> Result<()> {
        match (&self.key_value, &self.kv_proj) {
            (Some(kv), Some(kv_proj)) => kv.forward(rec, memory, kv_proj),
            _ => Err(Error::shape(
                "memory",
                "self-attention takes no memory; build the layer with AttentionKind::Cross",
            )),
        }
    }

    /// Decoding: `y = Attention(x)` for new tokens `x [B, L, d]` after each sequence's cached ones
    /// (`lens`: `q_lens` new, `kv_lens` cached including them, see [`SeqLens::check_decode`]).
    /// Self-attention appends the new keys and values to `cache` (contiguous `[B, max_len, Hkv,
    /// d/H]` each, or paged pools with their block table; keys `[.., Da]` of additive scores, which
    /// cache their key projections, contiguous only) and attends over it with decode attention, or
    /// the additive forward aligned per sequence (RoPE at each sequence's positions);
    /// cross-attention (`cache` `None`) attends over the memory projected by
    /// [`MultiHeadAttention::prepare_memory`], `lens` giving the new tokens and the memory lengths.
    /// `residual` is added to `y`.
    pub fn forward_cached(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        cache: Option<LayerCache<'_>>,
        lens: &SeqLens,
        y: &GpuTensor,
        residual: Option<&GpuTensor>,
    ) -> Result<()> {
        let Recording { ctx, params: p, .. } = *rec;
        let opts = self.options(p, lens);
        match (self.kind, cache) {
            (AttentionKind::SelfAttention { .. }, Some(cache)) => {
                let &[b, l, _] = x.shape() else {
                    return Err(Error::shape(
                        "x",
                        format!("has shape {:?}; expected [batch, seq, d_model]", x.shape()),
                    ));
                };
                let layout = self.layout_of(lens, true)?;
                // A packed prefill's sequences are its lengths', in one row of rows.
                let sequences = match layout.packed {
                    Some(_) if b != 1 => {
                        return Err(Error::shape(
                            "x",
                            format!(
                                "has shape {:?}; packed rows are [1, rows, d_model]",
                                x.shape()
                            ),
                        ))
                    }
                    Some(packed) => packed.batch(),
                    None => b,
                };
                lens.check_decode(sequences, l, cache.capacity())?;
                let ([keys, values], table) = cache.parts();
                if self.additive.is_some()
                    && (table.is_some()
                        || keys.format() != KvFormat::F32
                        || layout.packed.is_some())
                {
                    return Err(Error::shape(
                        "cache",
                        "additive scores decode padded rows from a contiguous f32 cache; a paged or int8 cache or packed rows are not supported",
                    ));
                }
                self.query.forward(rec, x, &self.proj)?;
                // A packed prefill's new keys and values follow its queries' rows.
                let [q, k, v] = self
                    .split(&self.proj, None)?
                    .map(|view| Self::place(view, PackedSide::Queries, &layout));
                let [q, k, v] = [q?, k?, v?];
                let out = Self::place(self.attn.heads()?, PackedSide::Queries, &layout)?;
                let lse = &layout.lse;
                if let Some(rope) = &self.rope {
                    rope_forward_cached_into(ctx, rec.encoder, &q, rope, lens)?;
                    rope_forward_cached_into(ctx, rec.encoder, &k, rope, lens)?;
                }
                // Additive layers cache b, their key projections, in place of keys.
                keys.append_into(ctx, rec.encoder, &k, table, lens)?;
                values.append_into(ctx, rec.encoder, &v, table, lens)?;
                // Paged pools [rows, Hkv, D] are read as [1, rows, Hkv, D].
                let view = |t: &GpuTensor| -> Result<HeadsView> {
                    match table {
                        None => t.heads(),
                        Some(_) => {
                            let s = t.shape();
                            t.reshape(&[1, s[0], s[1], s[2]])?.heads()
                        }
                    }
                };
                match ([keys, values], &self.additive) {
                    ([KvStorage::F32(keys), KvStorage::F32(values)], Some(add)) => {
                        let scores = AdditiveScores {
                            w: p.value(add.w),
                            bias: p.value(add.bias),
                        };
                        let (keys, values) = (keys.heads()?, values.heads()?);
                        let views = ForwardViews {
                            q: &q,
                            k: &keys,
                            v: &values,
                            out: &out,
                            lse,
                        };
                        additive_decode_into(ctx, rec.encoder, &views, scores, &opts)?
                    }
                    ([KvStorage::F32(keys), KvStorage::F32(values)], None) => {
                        let (keys, values) = (view(keys)?, view(values)?);
                        let views = ForwardViews {
                            q: &q,
                            k: &keys,
                            v: &values,
                            out: &out,
                            lse,
                        };
                        match table {
                            None => attention_decode_into(ctx, rec.encoder, &views, &opts)?,
                            Some(table) => {
                                attention_decode_paged_into(ctx, rec.encoder, &views, table, &opts)?
                            }
                        }
                    }
                    ([KvStorage::F16(keys), KvStorage::F16(values)], None) => {
                        attention_decode_f16_into(
                            ctx,
                            rec.encoder,
                            &q,
                            HalfCache {
                                k: keys,
                                v: values,
                                table,
                            },
                            &out,
                            lse,
                            &opts,
                        )?
                    }
                    ([KvStorage::Int8(keys), KvStorage::Int8(values)], _) => {
                        attention_decode_int8_into(
                            ctx,
                            rec.encoder,
                            &q,
                            QuantizedCache {
                                k: keys,
                                v: values,
                                table,
                            },
                            &out,
                            lse,
                            &opts,
                        )?
                    }
                    _ => {
                        return Err(Error::shape(
                            "cache",
                            format!(
                                "keys are {} and values {}; a cache stores both in one format",
                                keys.format().name(),
                                values.format().name()
                            ),
                        ))
                    }
                }
            }
            (AttentionKind::Cross, None) => {
                self.query.forward(rec, x, &self.proj)?;
                let [q, k, v] = self.split(&self.proj, self.kv_proj.as_ref())?;
                let (out, lse) = (self.attn.heads()?, &self.padded_lse()?);
                attention_forward_into(
                    ctx,
                    rec.encoder,
                    &ForwardViews {
                        q: &q,
                        k: &k,
                        v: &v,
                        out: &out,
                        lse,
                    },
                    &opts,
                )?;
            }
            _ => {
                return Err(Error::shape(
                    "cache",
                    "self-attention decodes with a key/value cache; cross-attention with none",
                ))
            }
        }
        let add = Epilogue {
            activation: None,
            residual,
        };
        self.output
            .forward_epilogue(rec, &self.flat(&self.attn)?, add, y)
    }

    /// Attention maps after a forward with the same `lens`: the probabilities `[B, H, rows, Lk]` of
    /// query rows `rows`, recomputed from the saved Q, K and lse (see
    /// [`wgpu_attention::kernels::attention::attention_probabilities`]).
    pub fn probabilities(
        &self,
        ctx: &Context,
        p: &Params,
        lens: &SeqLens,
        rows: std::ops::Range<usize>,
    ) -> Result<GpuTensor> {
        let [q, k, _] = self.split(&self.proj, self.kv_proj.as_ref())?;
        let lse = &self.padded_lse()?;
        if let Some(add) = &self.additive {
            let scores = AdditiveScores {
                w: p.value(add.w),
                bias: p.value(add.bias),
            };
            let opts = self.options(p, lens);
            return additive_probabilities(ctx, &q, &k, lse, scores, &opts, rows);
        }
        attention_probabilities(ctx, &q, &k, lse, &self.options(p, lens), rows)
    }

    /// The values `[B, Lk, H, d/H]` of the last forward, and the gradient at the attention output
    /// `[B, Lq, H, d/H]` of the last backward: `dL/dP_ij = dO_i . V_j` (gradient-times-attention maps).
    pub fn values_and_output_grad(&self) -> Result<(HeadsView, HeadsView)> {
        let [_, _, v] = self.split(&self.proj, self.kv_proj.as_ref())?;
        Ok((v, self.d_attn.heads()?))
    }

    /// Writes `dx = dAttention(dy) + residual` ([`InputGrad`]; and, for cross-attention,
    /// `d_memory`) and every parameter gradient.
    pub fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        memory: Option<&GpuTensor>,
        lens: &SeqLens,
        grad: InputGrad<'_>,
        d_memory: Option<&GpuTensor>,
    ) -> Result<()> {
        let InputGrad { dy, dx, residual } = grad;
        let Recording { ctx, params: p, .. } = *rec;
        self.check_memory(memory)?;
        let dx_epilogue = Epilogue {
            activation: None,
            residual,
        };
        if self.kind == AttentionKind::Cross && d_memory.is_none() {
            return Err(Error::shape(
                "d_memory",
                "cross-attention needs a d_memory output",
            ));
        }
        let d_attn = self.flat(&self.d_attn)?;
        self.output
            .backward(rec, &self.flat(&self.attn)?, dy, &d_attn)?;
        let layout = self.layout(lens)?;
        let [q, k, v] = self.placed_split(&self.proj, self.kv_proj.as_ref(), &layout)?;
        let [dq, dk, dv] = self.placed_split(&self.d_proj, self.d_kv_proj.as_ref(), &layout)?;
        let out = Self::place(self.attn.heads()?, PackedSide::Queries, &layout)?;
        let d_out = Self::place(self.d_attn.heads()?, PackedSide::Queries, &layout)?;
        // The relative table's and the cosine scale's gradients are written by the backward itself.
        let opts = self.options(p, lens);
        let views = BackwardViews {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &layout.lse,
            d_out: &d_out,
            dq: &dq,
            dk: &dk,
            dv: &dv,
            workspace: &layout.workspace,
        };
        if let Some(add) = &self.additive {
            let scores = AdditiveScores {
                w: p.value(add.w),
                bias: p.value(add.bias),
            };
            let additive_views = BackwardViews {
                workspace: &add.workspace,
                ..views
            };
            let param_grads = [p.grad(add.w), p.grad(add.bias)];
            additive_backward_into(
                ctx,
                rec.encoder,
                &additive_views,
                scores,
                param_grads,
                &opts,
            )?;
            self.query
                .backward_epilogue(rec, x, &self.d_proj, dx, dx_epilogue)?;
            return Ok(());
        }
        attention_backward_into(ctx, rec.encoder, &views, &opts)?;
        self.rotate(ctx, rec.encoder, [&dq, &dk], &layout, true)?;
        if let Some(id) = self.sinks {
            let (sinks, d_sinks) = (p.value(id), p.grad(id));
            attention_sinks_backward_into(
                ctx,
                rec.encoder,
                &layout.shape,
                sinks,
                &layout.workspace,
                d_sinks,
                &opts,
            )?;
        }
        self.query
            .backward_epilogue(rec, x, &self.d_proj, dx, dx_epilogue)?;
        if let (Some(kv), Some(d_kv_proj), Some(memory), Some(d_memory)) =
            (&self.key_value, &self.d_kv_proj, memory, d_memory)
        {
            kv.backward(rec, memory, d_kv_proj, d_memory)?;
        }
        Ok(())
    }
}
