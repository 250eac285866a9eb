//! The [`Generator`]: prefill, decoding steps, sampling and the generation loop.

mod speculative;

pub use speculative::Draft;

use web_time::Instant;
use wgpu_attention_transformer::layers::Recording;

use crate::kv_cache::{KvCache, StepLens};
use crate::paged_cache::{PagedKvCache, PagedKvCacheConfig};
use wgpu_attention::device::read_mapped;
use wgpu_attention::device::{block_on, BindingCache, Context};
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::attention::PREFILL_FORWARD_ROWS;
use wgpu_attention::kernels::kv_cache::KvFormat;
use wgpu_attention::kernels::sampling::{sample_into, sample_rows_into, Sampling, SamplingRows};
use wgpu_attention::tensor::{GpuTensor, SeqLens};
use wgpu_attention_transformer::layers::attention::LayerCache;
use wgpu_attention_transformer::layers::decoder::Decoder;
use wgpu_attention_transformer::layers::embedding::{Embedding, PositionKind};
use wgpu_attention_transformer::layers::encoder::Encoder;
use wgpu_attention_transformer::layers::linear::Linear;
use wgpu_attention_transformer::layers::params::Params;
use wgpu_attention_transformer::model::pretrained::Pretrained;
use wgpu_attention_transformer::model::transformer::{Transformer, TransformerConfig};

/// The sizes a [`Generator`] is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeneratorShape {
    /// Sequences generated together.
    pub batch: usize,
    /// Tokens a sequence can hold, prompt and generated (the cache's capacity).
    pub capacity: usize,
    /// Sizes the prefill passes (at most `capacity` is used): a pass holds `batch *
    /// prefill_chunk` prompt tokens, the sequences' packed one after another with no padding rows
    /// between them (one long prompt may fill it), and a second pass of `prefill_chunk` rows takes
    /// what is left when it fits there (an admitted request's prompt). Models whose attention takes
    /// no packed rows (encoder-decoder; additive scores, cosine scores, key clipping) feed
    /// `prefill_chunk` tokens of each sequence per pass instead.
    pub prefill_chunk: usize,
    /// Longest source (encoder-decoder models; ignored by decoder-only ones).
    pub src_len: usize,
}

/// What [`Generator::generate`] does after the prompts: `GenerateOptions::default()` with setters
/// (`.max_new_tokens(32).stop(Some(eos))`).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct GenerateOptions {
    /// The most tokens generated per sequence.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// A sequence ends after generating this id (e.g. EOS).
    pub stop: Option<u32>,
}

wgpu_attention::config_setters!(GenerateOptions {
    max_new_tokens: usize,
    sampling: Sampling,
    stop: Option<u32>,
});

impl Default for GenerateOptions {
    /// 64 new tokens, greedy, no stop id: set the fields that differ with
    /// `GenerateOptions::default().stop(Some(eos))`.
    fn default() -> Self {
        Self {
            max_new_tokens: 64,
            sampling: Sampling::greedy(),
            stop: None,
        }
    }
}

/// The tokens [`Generator::generate`] produced per sequence (the stop id included when met), and
/// how long the two phases took (wall clock, the device synchronised).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generated {
    /// Each sequence's generated ids (the stop id included when met).
    pub tokens: Vec<Vec<u32>>,
    /// Prompt tokens fed in the prefill.
    pub prefill_tokens: usize,
    /// Seconds the prefill took.
    pub prefill_seconds: f64,
    /// Tokens fed by decoding steps (each step feeds every unfinished sequence its last sample).
    pub decode_tokens: usize,
    /// Seconds the decoding steps took.
    pub decode_seconds: f64,
    /// Decoding steps run.
    pub decode_steps: usize,
}

/// How a generator's key/value cache is laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum CacheLayout {
    /// Per layer `[batch, capacity, Hkv, D]`: every sequence's whole capacity reserved.
    #[default]
    Contiguous,
    /// Per layer pools of `pool_blocks` blocks of `page` tokens shared by the sequences, memory
    /// in use growing with the tokens cached ([`PagedKvCache`]); sequences fork without copying
    /// ([`Generator::fork`]).
    Paged {
        /// Tokens per block.
        page: usize,
        /// Blocks in each pool.
        pool_blocks: usize,
    },
}

/// A generator's key/value cache: its layout and storage format. A [`CacheLayout`] converts into
/// one with f32 storage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheConfig {
    /// Contiguous or paged.
    pub layout: CacheLayout,
    /// f32, or int8 with a scale per token and head (dequantised in the decode kernel; not for
    /// additive scores).
    pub format: KvFormat,
}

impl CacheConfig {
    /// `layout` with f32 storage.
    pub fn new(layout: CacheLayout) -> Self {
        Self {
            layout,
            format: KvFormat::F32,
        }
    }

    /// The same layout storing keys and values in `format`.
    pub fn with_format(self, format: KvFormat) -> Self {
        Self { format, ..self }
    }
}

impl From<CacheLayout> for CacheConfig {
    fn from(layout: CacheLayout) -> Self {
        Self::new(layout)
    }
}

/// The generator's cache in either layout.
enum Cache {
    Contiguous(Box<KvCache>),
    Paged(Box<PagedKvCache>),
}

impl Cache {
    fn lens(&self) -> &[u32] {
        match self {
            Cache::Contiguous(c) => c.lens(),
            Cache::Paged(c) => c.lens(),
        }
    }

    /// Checks that `new` tokens per slot fit, in one step or several, changing nothing.
    fn check_room(&self, new: &[u32]) -> Result<()> {
        match self {
            Cache::Contiguous(c) => c.step(new).map(|_| ()),
            Cache::Paged(c) => c.check_room(new).map(|_| ()),
        }
    }

    /// A step's lengths (paged: its blocks allocated, shared ones copied).
    fn step(&mut self, ctx: &Context, new: &[u32]) -> Result<StepLens> {
        match self {
            Cache::Contiguous(c) => c.step(new),
            Cache::Paged(c) => c.prepare(ctx, new),
        }
    }

    fn advance(&mut self, step: &StepLens) {
        match self {
            Cache::Contiguous(c) => c.advance(step),
            Cache::Paged(c) => c.advance(step),
        }
    }

    /// Forgets every sequence; each slot then holds an empty one.
    fn clear(&mut self) {
        match self {
            Cache::Contiguous(c) => c.clear(),
            Cache::Paged(c) => {
                c.clear();
                for slot in 0..c.config().slots {
                    c.add_sequence(slot).expect("cleared");
                }
            }
        }
    }

    /// Forgets slot `slot`'s sequence; the slot then holds an empty one.
    fn release(&mut self, slot: usize) -> Result<()> {
        match self {
            Cache::Contiguous(c) => c.reset(slot),
            Cache::Paged(c) => {
                c.remove(slot)?;
                c.add_sequence(slot)
            }
        }
    }

    fn layers(&self) -> Vec<LayerCache<'_>> {
        match self {
            Cache::Contiguous(c) => c.layers().into_iter().map(LayerCache::Contiguous).collect(),
            Cache::Paged(c) => c
                .layers()
                .iter()
                .map(|[k, v]| LayerCache::Paged([k, v], c.table()))
                .collect(),
        }
    }
}

/// One set of decoder buffers: a prefill pass, the decoding step (one row per sequence) or the
/// verification of drafts.
struct Pass {
    target: Embedding,
    decoder: Decoder,
    /// New rows per sequence (`[batch, rows]`), or in all for a packed pass.
    rows: usize,
    /// A packed pass's lengths ([`SeqLens::packed`] of the new and the cached tokens): its `[1,
    /// rows]` rows hold the fed sequences' new tokens one after another, no padding between them.
    packed: Option<SeqLens>,
}

/// The encoder, run once per batch of sources.
struct Source {
    embedding: Embedding,
    encoder: Encoder,
    lens: SeqLens,
    lens_host: Vec<u32>,
}

/// Generates from a model through a key/value cache: prefill in chunks, then one token per sequence
/// per step, sampled on the GPU. Shares the model's parameters (training updates are seen) and
/// allocates everything once.
pub struct Generator {
    config: TransformerConfig,
    shape: GeneratorShape,
    params: Params,
    source: Option<Source>,
    /// Prompt chunks: packed (`batch * prefill_chunk` rows shared by the sequences fed) where the
    /// model's attention takes packed rows, else `prefill_chunk` rows per sequence.
    prefill: Pass,
    /// A packed pass of `prefill_chunk` rows for the last chunk of a prefill that fits it (one
    /// admitted prompt): the full pass would compute `batch` times its rows. `None` at batch 1 or
    /// for padded passes.
    short_prefill: Option<Pass>,
    step: Pass,
    output: Linear,
    cache: Cache,
    /// New tokens and cached tokens including them, per sequence, for the current pass.
    self_lens: SeqLens,
    /// New tokens and source lengths (encoder-decoder).
    cross_lens: SeqLens,
    /// Each sequence's last fed position's decoder output `[B, d]` and its logits `[B, vocab]`.
    last: GpuTensor,
    logits: GpuTensor,
    ids: wgpu::Buffer,
    ids_staging: wgpu::Buffer,
    /// Sampling draws so far: each draw uses fresh random numbers.
    draws: u64,
    /// Per-sequence settings for [`Generator::sample_each`].
    rows: SamplingRows,
    /// Bind groups and parameter blocks of every recording, reused from step to step.
    bindings: BindingCache,
    /// The verification pass and every draft row's logits and greedy token, allocated by the
    /// first [`Generator::verify`] (again for larger drafts).
    verify: Option<speculative::VerifyBuffers>,
    /// Rows of the target position table (learned positions).
    tgt_positions: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum PassKind {
    Prefill,
    /// [`Generator::short_prefill`].
    ShortPrefill,
    Step,
    /// Speculative decoding's drafts ([`Generator::verify`]).
    Verify,
}

/// What a pass records after the decoder: nothing more (a prefill chunk before the last), the
/// output layer's logits, or the logits and a sample from them.
#[derive(Clone, Copy)]
enum PassEnd<'a> {
    Hidden,
    Logits,
    Sample(&'a Sampling),
}

impl<'a> PassEnd<'a> {
    /// The logits, and a sample where `sampling` is given.
    fn after(sampling: Option<&'a Sampling>) -> Self {
        match sampling {
            Some(sampling) => Self::Sample(sampling),
            None => Self::Logits,
        }
    }
}

impl Pass {
    /// The embedding and decoder buffers of `rows` new rows per sequence (`[batch, rows]`), or
    /// with `packed` of `rows` rows in all, the new tokens of up to `batch` sequences one after
    /// another (decoder-only models whose attention takes packed rows: [`packs_prefill`]); over the
    /// parameters of `params` (found by name when already there).
    fn new(
        ctx: &Context,
        c: &TransformerConfig,
        params: &mut Params,
        s: &GeneratorShape,
        [rows, tgt_positions]: [usize; 2],
        packed: bool,
    ) -> Result<Self> {
        let mut stack = c.stack(c.decoder_layers, s.capacity);
        let (shape, memory_len, lens) = match packed {
            true => {
                stack.packed_sequences = Some(s.batch);
                let zeros = vec![0u32; s.batch];
                ([1, rows], None, Some(SeqLens::packed(ctx, &zeros, &zeros)?))
            }
            false => ([s.batch, rows], c.has_encoder().then_some(s.src_len), None),
        };
        Ok(Pass {
            target: c.embedding(ctx, params, "tgt", shape, tgt_positions)?,
            decoder: Decoder::new(ctx, params, "dec", &stack, shape, memory_len)?,
            rows,
            packed: lens,
        })
    }

    /// The first row of each sequence's new tokens `new` (`[batch, rows]` padded, or packed).
    fn starts(&self, new: &[u32]) -> Vec<usize> {
        let mut next = 0;
        (0..new.len())
            .map(|seq| match self.packed {
                Some(_) => {
                    let start = next;
                    next += new[seq] as usize;
                    start
                }
                None => seq * self.rows,
            })
            .collect()
    }
}

/// Whether prompts are prefilled in packed passes: decoder-only models whose self-attention
/// decodes packed rows (dot-product scores without cosine scores or key clipping, which transform
/// padded rows).
fn packs_prefill(c: &TransformerConfig) -> bool {
    let scores = c.scores();
    !c.has_encoder()
        && scores.additive.is_none()
        && scores.cosine.is_none()
        && scores.key_clip.is_none()
}

impl Generator {
    /// A generator over `model`'s parameters for `shape`. Refused: learned position tables shorter
    /// than the capacity or source length. Every score function decodes: additive-score layers cache
    /// their key projections and decode with [`wgpu_attention::kernels::additive::additive_decode_into`];
    /// cosine scores and key clipping transform the cached keys in decode attention.
    pub fn new(ctx: &Context, model: &Transformer, shape: GeneratorShape) -> Result<Self> {
        Self::with_layout(ctx, model, shape, CacheLayout::Contiguous)
    }

    /// [`Generator::new`] with the cache in `layout` (a paged one for many sequences of varied
    /// lengths: memory follows the tokens, sequences join, leave and fork), and with a
    /// [`CacheConfig`] in its storage format (int8: 3.76x less memory at head_dim 64).
    pub fn with_layout(
        ctx: &Context,
        model: &Transformer,
        shape: GeneratorShape,
        layout: impl Into<CacheConfig>,
    ) -> Result<Self> {
        let c = *model.config();
        // The model's learned position tables are as long as its training lengths.
        let trained = model.shape();
        let rows = [
            c.position_rows(trained.src_len),
            c.position_rows(trained.tgt_len),
        ];
        Self::build(ctx, c, model.params.shared(), rows, shape, layout.into())
    }

    /// A generator with a published checkpoint's weights and nothing else: its parameters are
    /// values only ([`Params::for_inference`]: no gradients, no optimizer arenas, no training
    /// activations), half the memory of [`Pretrained::model`] with a generator over it. The way to
    /// run a published model that is not trained further; `layout` as [`Generator::with_layout`].
    pub fn from_pretrained(
        ctx: &Context,
        checkpoint: &Pretrained,
        shape: GeneratorShape,
        layout: impl Into<CacheConfig>,
    ) -> Result<Self> {
        let c = *checkpoint.config();
        // Learned position tables have max_positions rows (GPT-2's n_positions).
        let rows = [
            c.position_rows(shape.src_len),
            c.position_rows(shape.capacity),
        ];
        let generator = Self::build(ctx, c, Params::for_inference(), rows, shape, layout.into())?;
        checkpoint.load_params(ctx, &generator.params)?;
        Ok(generator)
    }

    /// A generator of configuration `c` over `params`: a store shared with a model (whose
    /// parameters the layers find by name), or an empty [`Params::for_inference`] store the layers
    /// add their parameters to (the caller then loads the weights). `[src_positions,
    /// tgt_positions]` are the rows of learned source and target position tables (other
    /// positions are sized here).
    fn build(
        ctx: &Context,
        c: TransformerConfig,
        mut params: Params,
        [src_positions, tgt_positions]: [usize; 2],
        shape: GeneratorShape,
        cache: CacheConfig,
    ) -> Result<Self> {
        c.validate()?;
        // A chunk longer than the cache never fills: size the prefill pass by what it can hold.
        let shape = GeneratorShape {
            prefill_chunk: shape.prefill_chunk.min(shape.capacity),
            ..shape
        };
        let s = shape;
        if s.batch == 0 || s.capacity == 0 || s.prefill_chunk == 0 {
            return Err(Error::shape(
                "GeneratorShape",
                format!("{s:?}: batch, capacity and prefill_chunk must be positive"),
            ));
        }
        if c.has_encoder() && s.src_len == 0 {
            return Err(Error::shape(
                "GeneratorShape::src_len",
                "an encoder-decoder model needs a positive source length",
            ));
        }
        let learned = c.position_kind() == PositionKind::Learned;
        let (src_positions, tgt_positions) = match learned {
            true => (src_positions, tgt_positions),
            false => (s.src_len, s.capacity),
        };
        if learned && s.capacity > tgt_positions {
            return Err(Error::shape(
                "capacity",
                format!(
                    "is {} but the learned target position table has {tgt_positions} rows",
                    s.capacity
                ),
            ));
        }
        if learned && c.has_encoder() && s.src_len > src_positions {
            return Err(Error::shape(
                "src_len",
                format!(
                    "is {} but the learned source position table has {src_positions} rows",
                    s.src_len
                ),
            ));
        }
        let b = s.batch;
        let source = match c.has_encoder() {
            true => {
                let rows = [b, s.src_len];
                let embedding = c.embedding(ctx, &mut params, "src", rows, src_positions)?;
                let stack = c.stack(c.encoder_layers, s.src_len);
                let encoder = Encoder::new(ctx, &mut params, "enc", &stack, rows)?;
                let lens_host = vec![s.src_len as u32; b];
                Some(Source {
                    embedding,
                    encoder,
                    lens: SeqLens::new(ctx, Some(&lens_host), Some(&lens_host))?,
                    lens_host,
                })
            }
            false => None,
        };
        let pass = |params: &mut Params, rows: usize, packed: bool| {
            Pass::new(ctx, &c, params, &s, [rows, tgt_positions], packed)
        };
        let packs = packs_prefill(&c);
        // The prefill pass and the output head add every parameter to a store of their own; the
        // other passes then find them.
        let mut prefill = match packs {
            true => pass(&mut params, b * s.prefill_chunk, true)?,
            false => pass(&mut params, s.prefill_chunk, false)?,
        };
        let output = c.output_head(ctx, &mut params, &mut prefill.target)?;
        let mut params = params.shared();
        let short_prefill = match packs && b > 1 {
            true => Some(pass(&mut params, s.prefill_chunk, true)?),
            false => None,
        };
        let step = pass(&mut params, 1, false)?;
        let head_dim = c.d_model / c.heads;
        // Additive layers cache their key projections b (Da per head) instead of keys.
        let key_dim = c.additive_attention.unwrap_or(head_dim);
        if cache.format != KvFormat::F32 && c.additive_attention.is_some() {
            return Err(Error::shape(
                "cache format",
                format!(
                    "{} caches are read by the dot-product decode kernel; additive scores need an f32 cache",
                    cache.format.name()
                ),
            ));
        }
        let format = cache.format;
        let cache = match cache.layout {
            CacheLayout::Contiguous => Cache::Contiguous(Box::new(KvCache::with_format(
                ctx,
                c.decoder_layers,
                b,
                s.capacity,
                c.effective_kv_heads(),
                [key_dim, head_dim],
                format,
            )?)),
            CacheLayout::Paged { page, pool_blocks } => {
                if c.additive_attention.is_some() {
                    return Err(Error::shape(
                        "layout",
                        "additive scores decode from a contiguous cache; a paged one is not supported",
                    ));
                }
                let mut config = PagedKvCacheConfig::new(
                    c.decoder_layers,
                    c.effective_kv_heads(),
                    head_dim,
                    page,
                    pool_blocks,
                    b,
                    s.capacity,
                );
                config.dims = [key_dim, head_dim];
                let mut cache = Cache::Paged(Box::new(PagedKvCache::new(
                    ctx,
                    config.with_format(format),
                )?));
                cache.clear();
                cache
            }
        };
        let zeros = vec![0u32; b];
        let id_bytes = 4 * b as u64;
        Ok(Self {
            config: c,
            shape,
            params,
            source,
            prefill,
            short_prefill,
            step,
            output,
            cache,
            self_lens: SeqLens::new(ctx, Some(&zeros), Some(&zeros))?,
            cross_lens: SeqLens::new(ctx, Some(&zeros), Some(&zeros))?,
            last: GpuTensor::zeros(ctx, &[b, c.d_model])?,
            logits: GpuTensor::zeros(ctx, &[b, c.vocab])?,
            ids: ctx.create_uncounted_buffer(
                "sampled ids",
                id_bytes,
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            )?,
            ids_staging: ctx.create_uncounted_buffer(
                "sampled ids readback",
                id_bytes,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )?,
            draws: 0,
            rows: SamplingRows::new(ctx, b)?,
            bindings: BindingCache::default(),
            verify: None,
            tgt_positions,
        })
    }

    /// Bind groups created and reused so far: after the first prefill and the first step, decoding
    /// creates none (and no uniform buffer) until a longer cache changes the decode attention's
    /// split-KV plan.
    pub fn binding_counts(&self) -> (u64, u64) {
        self.bindings.counts()
    }

    /// The model configuration it decodes.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    /// The batch, capacity and chunk sizes it was built for.
    pub fn shape(&self) -> &GeneratorShape {
        &self.shape
    }

    /// Tokens cached per sequence.
    pub fn lens(&self) -> &[u32] {
        self.cache.lens()
    }

    /// The contiguous key/value cache and each sequence's length (`None` for a paged cache).
    pub fn cache(&self) -> Option<&KvCache> {
        match &self.cache {
            Cache::Contiguous(c) => Some(c),
            Cache::Paged(_) => None,
        }
    }

    /// The paged key/value cache (`None` for a contiguous one).
    pub fn paged_cache(&self) -> Option<&PagedKvCache> {
        match &self.cache {
            Cache::Paged(c) => Some(c),
            Cache::Contiguous(_) => None,
        }
    }

    /// Ends slot `slot`'s sequence (a finished request): its cache is forgotten (a paged cache's
    /// blocks freed) and it takes no tokens until [`Generator::admit`] starts another there.
    pub fn release(&mut self, slot: usize) -> Result<()> {
        if slot >= self.shape.batch {
            return Err(Error::shape(
                "slot",
                format!("is {slot}; the generator has {} slots", self.shape.batch),
            ));
        }
        self.cache.release(slot)?;
        Ok(())
    }

    /// Starts a new sequence in the empty slot `slot` (released, or never fed) while the others
    /// keep their caches (continuous batching): feeds `prompt` in prefill passes; the slot's
    /// logits are then its last token's, the others' unchanged. Decoder-only models. Checked
    /// first: on error nothing changes.
    pub fn admit(&mut self, ctx: &Context, slot: usize, prompt: &[u32]) -> Result<()> {
        self.admit_all(ctx, &[(slot, prompt)])
    }

    /// [`Generator::admit`] for several requests at once, each `(slot, prompt)` into its own
    /// empty slot: their prompts share the prefill passes (packed one after another where the
    /// model's attention takes packed rows), so requests admitted together cost one pass when
    /// their prompts fit it. Checked first: on error nothing changes.
    pub fn admit_all(&mut self, ctx: &Context, admissions: &[(usize, &[u32])]) -> Result<()> {
        let b = self.shape.batch;
        if self.source.is_some() {
            return Err(Error::shape(
                "admit",
                "starts decoder-only sequences; an encoder-decoder model prefills all with prefill",
            ));
        }
        let mut prompts = vec![Vec::new(); b];
        for &(slot, prompt) in admissions {
            if slot >= b || self.lens()[slot] != 0 || !prompts[slot].is_empty() {
                return Err(Error::shape(
                    "slot",
                    format!(
                        "is {slot}; it must be one of the {b} slots, empty (release it first) and \
                         admitted once"
                    ),
                ));
            }
            if prompt.is_empty() || prompt.len() > self.shape.capacity {
                return Err(Error::shape(
                    "prompt",
                    format!(
                        "of slot {slot} has {} tokens; it needs 1 to the capacity {}",
                        prompt.len(),
                        self.shape.capacity
                    ),
                ));
            }
            self.check_ids("prompt", prompt)?;
            prompts[slot] = prompt.to_vec();
        }
        // No sampling, nothing read back: ready at once.
        block_on("Generator::admit", self.feed_prompts(ctx, &prompts, None)).map(|_| ())
    }

    /// Starts in slot `child` a sequence that continues slot `parent`'s (beams, parallel samples,
    /// a shared system prompt): with a paged cache the two share every cached block until one
    /// writes into a shared block, which is then copied. `child`'s previous sequence ends; its
    /// logits stay as they were until it is fed. Paged caches only.
    pub fn fork(&mut self, parent: usize, child: usize) -> Result<()> {
        let b = self.shape.batch;
        if parent >= b || child >= b || parent == child {
            return Err(Error::shape(
                "fork",
                format!("parent {parent} and child {child} must be two of the {b} slots"),
            ));
        }
        let Cache::Paged(cache) = &mut self.cache else {
            return Err(Error::shape(
                "fork",
                "shares cached blocks; build the generator with CacheLayout::Paged",
            ));
        };
        cache.remove(child)?;
        cache.fork(parent, child)?;
        Ok(())
    }

    /// `[batch, vocab]` logits of each sequence's last fed token (after [`Generator::prefill`] or
    /// [`Generator::step`]).
    pub fn logits(&self) -> &GpuTensor {
        &self.logits
    }

    /// Starts a batch: forgets every cached sequence, encodes `sources` (encoder-decoder models,
    /// one per sequence, 1 to `src_len` tokens; `None` for decoder-only ones), and feeds each
    /// prompt (at least one token) in chunks of `prefill_chunk`. Validated first: on error the
    /// cache is unchanged.
    pub fn prefill(
        &mut self,
        ctx: &Context,
        prompts: &[Vec<u32>],
        sources: Option<&[Vec<u32>]>,
    ) -> Result<()> {
        // Without sampling nothing is read back, so nothing waits: the future is ready at once
        // (a browser may call this too).
        block_on(
            "Generator::prefill",
            self.prefill_then(ctx, prompts, sources, None),
        )
        .map(|_| ())
    }

    /// Feeds one token to each sequence given one (`None`: the sequence takes no token this step
    /// and keeps its logits). Validated first: on error the cache is unchanged.
    pub fn step(&mut self, ctx: &Context, tokens: &[Option<u32>]) -> Result<()> {
        // Nothing is read back: ready at once, as for `prefill`.
        block_on("Generator::step", self.step_then(ctx, tokens, None)).map(|_| ())
    }

    /// Compiles every pipeline [`Generator::prefill`], [`Generator::step`], [`Generator::sample`]
    /// (with `sampling`) and [`Generator::sample_each`] use, without running them: the source
    /// encoder, a prefill chunk, a decoding step and the samplers are recorded into a command
    /// buffer that is never submitted, so the cache, the logits and the draw count are unchanged.
    /// Returns how many pipelines were newly compiled. With
    /// [`wgpu_attention::ContextOptions::dump_pipelines`] this writes the decoding kernel set to disk.
    pub fn precompile(&mut self, ctx: &Context, sampling: &Sampling) -> Result<usize> {
        let before = ctx.cached_pipelines();
        let mut encoder = ctx
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("generator precompile (never submitted)"),
            });
        let b = self.shape.batch;
        // No binding cache: its slots belong to submitted recordings.
        self.record_source(ctx, &mut encoder)?;
        if self.prefill.packed.is_none() {
            let chunks = vec![self.shape.prefill_chunk as u32; b];
            self.record_pass(ctx, &mut encoder, PassKind::Prefill, &chunks, true)?;
        }
        // Packed passes choose the decode kernel's rows per workgroup by their longest sequence's
        // power of two (DecodePlan::packed), and the fused forward from PREFILL_FORWARD_ROWS rows:
        // one recording per power of two up to what a pass holds.
        let short = self.short_prefill.as_ref().map(|_| PassKind::ShortPrefill);
        for kind in [Some(PassKind::Prefill), short].into_iter().flatten() {
            if self.pass(kind).packed.is_none() {
                continue;
            }
            let rows = self.pass(kind).rows.min(self.shape.capacity);
            let mut longest = 1;
            loop {
                let n = longest.min(rows);
                let new: Vec<u32> = (0..b)
                    .map(|seq| if seq == 0 { n as u32 } else { 0 })
                    .collect();
                if let Some(lens) = &mut self.pass_mut(kind).packed {
                    lens.write(ctx, Some(&new), Some(&new))?;
                }
                self.record_pass(ctx, &mut encoder, kind, &new, true)?;
                if n == rows || n >= PREFILL_FORWARD_ROWS {
                    break;
                }
                longest *= 2;
            }
        }
        self.record_pass(ctx, &mut encoder, PassKind::Step, &vec![1; b], true)?;
        self.record_sample(ctx, &mut encoder, sampling, self.draws)?;
        // The per-sequence sampler of `sample_each` (a serving batch) too.
        sample_rows_into(
            ctx,
            &mut encoder,
            &self.logits,
            &self.rows,
            self.draws,
            &self.ids,
        )?;
        drop(encoder);
        Ok(ctx.cached_pipelines() - before)
    }

    /// Samples one token per sequence from [`Generator::logits`] on the GPU; only the ids are read
    /// back.
    pub fn sample(&mut self, ctx: &Context, sampling: &Sampling) -> Result<Vec<u32>> {
        block_on("Generator::sample", self.sample_async(ctx, sampling))
    }

    /// Async form of [`Generator::sample`] (what a browser must use).
    pub async fn sample_async(&mut self, ctx: &Context, sampling: &Sampling) -> Result<Vec<u32>> {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let mut bindings = std::mem::take(&mut self.bindings);
        let recorded = ctx.with_binding_cache(&mut bindings, || {
            self.record_sample(ctx, &mut encoder, sampling, self.draws)
        });
        self.bindings = bindings;
        recorded?;
        self.draws += 1;
        ctx.submit(encoder)?;
        self.read_ids(ctx).await
    }

    /// [`Generator::sample`] with each sequence's own settings (`samplings[b]` for sequence `b`:
    /// the requests of a serving batch), in one pass; sequence `b` draws what
    /// [`Generator::sample`] with its setting would draw.
    pub fn sample_each(&mut self, ctx: &Context, samplings: &[Sampling]) -> Result<Vec<u32>> {
        block_on(
            "Generator::sample_each",
            self.sample_each_async(ctx, samplings),
        )
    }

    /// Async form of [`Generator::sample_each`].
    pub async fn sample_each_async(
        &mut self,
        ctx: &Context,
        samplings: &[Sampling],
    ) -> Result<Vec<u32>> {
        self.rows.write(ctx, samplings)?;
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        sample_rows_into(
            ctx,
            &mut encoder,
            &self.logits,
            &self.rows,
            self.draws,
            &self.ids,
        )?;
        encoder.copy_buffer_to_buffer(&self.ids, 0, &self.ids_staging, 0, self.ids.size());
        self.draws += 1;
        ctx.submit(encoder)?;
        self.read_ids(ctx).await
    }

    /// Prefills `prompts` (and `sources`), then samples and feeds tokens until each sequence has
    /// `max_new_tokens` new ones, met `stop`, or filled the cache. Each decoding step is one
    /// submission that runs the decoder, samples, and reads back only the ids.
    pub fn generate(
        &mut self,
        ctx: &Context,
        prompts: &[Vec<u32>],
        sources: Option<&[Vec<u32>]>,
        options: &GenerateOptions,
    ) -> Result<Generated> {
        block_on(
            "Generator::generate",
            self.generate_async(ctx, prompts, sources, options),
        )
    }

    /// Async form of [`Generator::generate`] (what a browser must use).
    pub async fn generate_async(
        &mut self,
        ctx: &Context,
        prompts: &[Vec<u32>],
        sources: Option<&[Vec<u32>]>,
        options: &GenerateOptions,
    ) -> Result<Generated> {
        let b = self.shape.batch;
        let mut out = Generated {
            tokens: vec![Vec::new(); b],
            ..Default::default()
        };
        if options.max_new_tokens == 0 {
            self.prefill_then(ctx, prompts, sources, None).await?;
            return Ok(out);
        }
        let start = Instant::now();
        let mut ids = self
            .prefill_then(ctx, prompts, sources, Some(&options.sampling))
            .await?
            .expect("sampled");
        out.prefill_tokens = prompts.iter().map(Vec::len).sum();
        out.prefill_seconds = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let mut active = vec![true; b];
        loop {
            for (seq, &id) in ids.iter().enumerate() {
                if !active[seq] {
                    continue;
                }
                out.tokens[seq].push(id);
                let full = self.lens()[seq] as usize >= self.shape.capacity;
                if Some(id) == options.stop
                    || out.tokens[seq].len() >= options.max_new_tokens
                    || full
                {
                    active[seq] = false;
                }
            }
            if !active.contains(&true) {
                break;
            }
            let feed: Vec<Option<u32>> =
                (0..b).map(|seq| active[seq].then_some(ids[seq])).collect();
            out.decode_tokens += active.iter().filter(|&&a| a).count();
            out.decode_steps += 1;
            ids = self
                .step_then(ctx, &feed, Some(&options.sampling))
                .await?
                .expect("sampled");
        }
        out.decode_seconds = start.elapsed().as_secs_f64();
        Ok(out)
    }

    fn check_ids(&self, arg: &'static str, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&t| t as usize >= self.config.vocab) {
            Some(t) => Err(Error::shape(
                arg,
                format!("id {t} is not below vocab {}", self.config.vocab),
            )),
            None => Ok(()),
        }
    }

    async fn prefill_then(
        &mut self,
        ctx: &Context,
        prompts: &[Vec<u32>],
        sources: Option<&[Vec<u32>]>,
        sampling: Option<&Sampling>,
    ) -> Result<Option<Vec<u32>>> {
        let (b, s) = (self.shape.batch, self.shape);
        if prompts.len() != b {
            return Err(Error::shape(
                "prompts",
                format!("{} prompts for a generator of batch {b}", prompts.len()),
            ));
        }
        for (seq, prompt) in prompts.iter().enumerate() {
            if prompt.is_empty() || prompt.len() > s.capacity {
                return Err(Error::shape(
                    "prompts",
                    format!(
                        "prompt {seq} has {} tokens; it needs 1 to the capacity {}",
                        prompt.len(),
                        s.capacity
                    ),
                ));
            }
            self.check_ids("prompts", prompt)?;
        }
        match (&self.source, sources) {
            (Some(_), Some(sources)) => {
                if sources.len() != b {
                    return Err(Error::shape(
                        "sources",
                        format!("{} sources for a generator of batch {b}", sources.len()),
                    ));
                }
                for (seq, src) in sources.iter().enumerate() {
                    if src.is_empty() || src.len() > s.src_len {
                        return Err(Error::shape(
                            "sources",
                            format!(
                                "source {seq} has {} tokens; it needs 1 to src_len {}",
                                src.len(),
                                s.src_len
                            ),
                        ));
                    }
                    self.check_ids("sources", src)?;
                }
            }
            (Some(_), None) => {
                return Err(Error::shape(
                    "sources",
                    "an encoder-decoder model needs one source per sequence",
                ))
            }
            (None, Some(_)) => {
                return Err(Error::shape(
                    "sources",
                    "a decoder-only model takes no sources",
                ))
            }
            (None, None) => {}
        }

        if let Cache::Paged(c) = &self.cache {
            // What the prompts need once the cache is cleared, checked before it is.
            let lens: Vec<u32> = prompts.iter().map(|p| p.len() as u32).collect();
            c.check_room_when_empty(&lens)?;
        }
        self.cache.clear();
        if let (Some(source), Some(sources)) = (&mut self.source, sources) {
            let pad = self.config.pad_id;
            let mut tokens = vec![pad; b * s.src_len];
            for (seq, src) in sources.iter().enumerate() {
                tokens[seq * s.src_len..][..src.len()].copy_from_slice(src);
                source.lens_host[seq] = src.len() as u32;
            }
            source.embedding.tokens.write(ctx, &tokens)?;
            let lens = Some(source.lens_host.as_slice());
            source.lens.write(ctx, lens, lens)?;
            // The encoder is its own submission: each recording lent the binding cache is one
            // submission, so no parameter block is rewritten while a submission still needs it.
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            let mut bindings = std::mem::take(&mut self.bindings);
            let recorded =
                ctx.with_binding_cache(&mut bindings, || self.record_source(ctx, &mut encoder));
            self.bindings = bindings;
            recorded?;
            ctx.submit(encoder)?;
        }
        self.feed_prompts(ctx, prompts, sampling).await
    }

    /// Feeds each slot its prompt (none for an empty one) in prefill passes; the last pass
    /// computes the logits (and samples, with `sampling`). A packed pass takes the prompts' next
    /// tokens in slot order up to its rows (one long prompt may fill it), the short one when what
    /// is left fits it; a padded pass `prefill_chunk` tokens of each.
    async fn feed_prompts(
        &mut self,
        ctx: &Context,
        prompts: &[Vec<u32>],
        sampling: Option<&Sampling>,
    ) -> Result<Option<Vec<u32>>> {
        // Checked whole first: a pool too small for the prompts fails before any pass is fed.
        let lens: Vec<u32> = prompts.iter().map(|p| p.len() as u32).collect();
        self.cache.check_room(&lens)?;
        let mut fed = vec![0usize; self.shape.batch];
        let mut ids = None;
        loop {
            let left: Vec<usize> = fed.iter().zip(prompts).map(|(&f, p)| p.len() - f).collect();
            let remaining: usize = left.iter().sum();
            if remaining == 0 {
                break;
            }
            let kind = match &self.short_prefill {
                Some(short) if remaining <= short.rows => PassKind::ShortPrefill,
                _ => PassKind::Prefill,
            };
            let pass = self.pass(kind);
            let mut budget = pass.rows;
            let new: Vec<u32> = left
                .iter()
                .map(|&n| match pass.packed {
                    Some(_) => {
                        let n = n.min(budget);
                        budget -= n;
                        n as u32
                    }
                    None => n.min(pass.rows) as u32,
                })
                .collect();
            let mut tokens = vec![self.config.pad_id; pass.target.tokens.len()];
            for (seq, start) in pass.starts(&new).into_iter().enumerate() {
                let n = new[seq] as usize;
                tokens[start..][..n].copy_from_slice(&prompts[seq][fed[seq]..][..n]);
                fed[seq] += n;
            }
            let last = new.iter().map(|&n| n as usize).sum::<usize>() == remaining;
            let end = match last {
                true => PassEnd::after(sampling),
                false => PassEnd::Hidden,
            };
            let e = ctx.device().create_command_encoder(&Default::default());
            ids = self.run(ctx, e, kind, (&tokens, &new), end).await?;
        }
        Ok(ids)
    }

    async fn step_then(
        &mut self,
        ctx: &Context,
        tokens: &[Option<u32>],
        sampling: Option<&Sampling>,
    ) -> Result<Option<Vec<u32>>> {
        let b = self.shape.batch;
        if tokens.len() != b {
            return Err(Error::shape(
                "tokens",
                format!("{} tokens for a generator of batch {b}", tokens.len()),
            ));
        }
        let ids: Vec<u32> = tokens
            .iter()
            .map(|t| t.unwrap_or(self.config.pad_id))
            .collect();
        self.check_ids("tokens", &ids)?;
        let new: Vec<u32> = tokens.iter().map(|t| t.is_some() as u32).collect();
        let encoder = ctx.device().create_command_encoder(&Default::default());
        let end = PassEnd::after(sampling);
        self.run(ctx, encoder, PassKind::Step, (&ids, &new), end)
            .await
    }

    /// Runs one pass over `tokens` (`[batch, rows]`, `new[b]` of them real), copies each fed
    /// sequence's last row into `last`, then what `end` asks for; one submission. The cache
    /// advances once the pass is recorded.
    async fn run(
        &mut self,
        ctx: &Context,
        mut encoder: wgpu::CommandEncoder,
        kind: PassKind,
        (tokens, new): (&[u32], &[u32]),
        end: PassEnd<'_>,
    ) -> Result<Option<Vec<u32>>> {
        let logits = !matches!(end, PassEnd::Hidden);
        let sampling = match end {
            PassEnd::Sample(sampling) => Some(sampling),
            _ => None,
        };
        let step: StepLens = self.cache.step(ctx, new)?;
        let pass = self.pass_mut(kind);
        pass.target.tokens.write(ctx, tokens)?;
        let lens = match &mut pass.packed {
            Some(packed) => packed,
            None => &mut self.self_lens,
        };
        lens.write(ctx, Some(&step.new), Some(&step.total))?;
        if let Some(source) = &self.source {
            self.cross_lens
                .write(ctx, Some(&step.new), Some(&source.lens_host))?;
        }
        let mut bindings = std::mem::take(&mut self.bindings);
        let recorded = ctx.with_binding_cache(&mut bindings, || {
            self.record_pass(ctx, &mut encoder, kind, new, logits)?;
            match sampling {
                Some(sampling) => self.record_sample(ctx, &mut encoder, sampling, self.draws),
                None => Ok(()),
            }
        });
        self.bindings = bindings;
        recorded?;
        if sampling.is_some() {
            self.draws += 1;
        }
        ctx.submit(encoder)?;
        self.cache.advance(&step);
        match sampling {
            Some(_) => self.read_ids(ctx).await.map(Some),
            None => Ok(None),
        }
    }

    fn pass_mut(&mut self, kind: PassKind) -> &mut Pass {
        match kind {
            PassKind::Prefill => &mut self.prefill,
            PassKind::ShortPrefill => self.short_prefill.as_mut().unwrap_or(&mut self.prefill),
            PassKind::Step => &mut self.step,
            PassKind::Verify => match &mut self.verify {
                Some(v) => &mut v.pass,
                None => &mut self.step,
            },
        }
    }

    fn pass(&self, kind: PassKind) -> &Pass {
        match kind {
            PassKind::Prefill => &self.prefill,
            PassKind::ShortPrefill => self.short_prefill.as_ref().unwrap_or(&self.prefill),
            PassKind::Step => &self.step,
            PassKind::Verify => match &self.verify {
                Some(v) => &v.pass,
                None => &self.step,
            },
        }
    }

    /// The encoder over the sources, and every decoder layer's cross-attention keys and values.
    fn record_source(&self, ctx: &Context, encoder: &mut wgpu::CommandEncoder) -> Result<()> {
        let Some(source) = &self.source else {
            return Ok(());
        };
        let p = &self.params;
        ctx.with_one_pass(encoder, "source encoder", |encoder| {
            source
                .embedding
                .forward(&mut Recording::new(ctx, encoder, p))?;
            let x = &source.embedding.x;
            source
                .encoder
                .forward(&mut Recording::new(ctx, encoder, p), x, &source.lens)?;
            let memory = source.encoder.output(x);
            self.prefill
                .decoder
                .prepare_memory(&mut Recording::new(ctx, encoder, p), memory)?;
            if let Some(v) = &self.verify {
                v.pass
                    .decoder
                    .prepare_memory(&mut Recording::new(ctx, encoder, p), memory)?;
            }
            self.step
                .decoder
                .prepare_memory(&mut Recording::new(ctx, encoder, p), memory)
        })
    }

    /// One pass of the decoder over the tokens already written, each fed sequence's last row into
    /// `last`, and (if `logits`) the output layer.
    fn record_pass(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        kind: PassKind,
        new: &[u32],
        logits: bool,
    ) -> Result<()> {
        let lens = self.pass(kind).packed.as_ref().unwrap_or(&self.self_lens);
        self.record_pass_with(ctx, encoder, kind, new, logits, lens)
    }

    /// [`Generator::record_pass`] with the decoder's lengths `lens` (a tree step's).
    fn record_pass_with(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        kind: PassKind,
        new: &[u32],
        logits: bool,
        lens: &SeqLens,
    ) -> Result<()> {
        let pass = self.pass(kind);
        let p = &self.params;
        let cross = self.source.is_some().then_some(&self.cross_lens);
        let x = &pass.target.x;
        let caches = self.cache.layers();
        // The embedding and every decoder layer in one compute pass; the row copies below cannot
        // be recorded inside one.
        ctx.with_one_pass(encoder, "decoder layers", |encoder| -> Result<()> {
            pass.target
                .forward_cached(&mut Recording::new(ctx, encoder, p), lens)?;
            pass.decoder.forward_cached(
                &mut Recording::new(ctx, encoder, p),
                x,
                &caches,
                lens,
                cross,
            )
        })?;
        let h = pass.decoder.output(x);
        let row_bytes = 4 * self.config.d_model as u64;
        for ((seq, &n), start) in new.iter().enumerate().zip(pass.starts(new)) {
            if n > 0 {
                let row = (start + n as usize - 1) as u64;
                encoder.copy_buffer_to_buffer(
                    h.buffer(),
                    row * row_bytes,
                    self.last.buffer(),
                    seq as u64 * row_bytes,
                    row_bytes,
                );
            }
        }
        if logits {
            self.output.forward(
                &mut Recording::new(ctx, encoder, p),
                &self.last,
                &self.logits,
            )?;
        }
        Ok(())
    }

    fn record_sample(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        sampling: &Sampling,
        draw: u64,
    ) -> Result<()> {
        sample_into(ctx, encoder, &self.logits, sampling, draw, &self.ids)?;
        encoder.copy_buffer_to_buffer(&self.ids, 0, &self.ids_staging, 0, self.ids.size());
        Ok(())
    }

    async fn read_ids(&self, ctx: &Context) -> Result<Vec<u32>> {
        read_mapped::<u32>(ctx, &self.ids_staging).await
    }
}
