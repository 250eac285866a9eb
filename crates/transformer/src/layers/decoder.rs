//! Decoder layer (causal self-attention, cross-attention over the encoder output when there is one,
//! feed-forward) and the decoder stack. Without an encoder (`memory_len = None`) the layers have no
//! cross-attention: the decoder-only language-model configuration.

use crate::layers::attention::{AttentionKind, LayerCache, MultiHeadAttention};
use crate::layers::feed_forward::FeedForward;
use crate::layers::params::Params;
use crate::layers::residual::Residual;
use crate::layers::stack::{Stack, StackConfig, StackLayer};
use crate::layers::Recording;
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::elementwise::add_into;
use wgpu_attention::tensor::{GpuTensor, SeqLens};

/// Cross-attention of one decoder layer, with the gradient it sends to the encoder output.
struct Cross {
    attention: MultiHeadAttention,
    block: Residual,
    d_memory: GpuTensor,
}

/// A decoder layer: causal self-attention, cross-attention over the encoder output (encoder-decoder
/// models), then the feed-forward block, each in a residual block.
pub struct DecoderLayer {
    self_attention: MultiHeadAttention,
    self_block: Residual,
    cross: Option<Cross>,
    feed_forward: FeedForward,
    feed_forward_block: Residual,
}

/// What every decoder layer reads besides its input: the sequence lengths it masks with, its own
/// (self-attention) and queries against the encoder's (cross-attention), and the encoder output.
#[derive(Clone, Copy)]
pub struct DecoderInputs<'a> {
    /// The decoder's own sequence lengths (self-attention).
    pub self_lens: &'a SeqLens,
    /// The encoder output and the cross-attention lengths; `None` for a decoder-only model.
    pub memory: Option<(&'a GpuTensor, &'a SeqLens)>,
}

impl DecoderLayer {
    /// Adds the layer's parameters under `name` and allocates its buffers for `rows = [batch,
    /// seq]`; `cross` adds cross-attention.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
        memory_len: Option<usize>,
    ) -> Result<Self> {
        let block = |params: &mut Params, ln: &str| {
            Residual::new(
                ctx,
                params,
                &format!("{name}.{ln}"),
                c.d_model,
                rows,
                c.pre_ln,
                c.norm,
            )
        };
        let self_block = block(params, "ln1")?;
        let self_attention = MultiHeadAttention::new(
            ctx,
            params,
            &format!("{name}.self_attn"),
            AttentionKind::SelfAttention { causal: true },
            c,
            rows,
            rows[1],
        )?
        .with_scores(ctx, params, c.scores, c.positions)?;
        let cross = match memory_len {
            Some(mem) => Some(Cross {
                block: block(params, "ln_cross")?,
                attention: MultiHeadAttention::new(
                    ctx,
                    params,
                    &format!("{name}.cross_attn"),
                    AttentionKind::Cross,
                    c,
                    rows,
                    mem,
                )?,
                d_memory: GpuTensor::zeros(ctx, &[rows[0], mem, c.d_model])?,
            }),
            None => None,
        };
        Ok(Self {
            self_block,
            self_attention,
            cross,
            feed_forward_block: block(params, "ln2")?,
            feed_forward: FeedForward::new(
                ctx,
                params,
                &format!("{name}.ff"),
                [c.d_model, c.d_ff],
                rows,
                c.feed_forward,
                c.bias,
            )?,
        })
    }

    /// The feed-forward block's input: the cross-attention block's output, or the self-attention's.
    fn ff_input(&self) -> &GpuTensor {
        self.cross
            .as_ref()
            .map_or(&self.self_block.y, |c| &c.block.y)
    }

    fn memory(inputs: DecoderInputs<'_>) -> Result<(&GpuTensor, &SeqLens)> {
        inputs.memory.ok_or_else(|| {
            Error::shape(
                "memory",
                "a decoder layer with cross-attention needs the encoder output and its lengths",
            )
        })
    }
}

impl DecoderLayer {
    /// The causal self-attention.
    pub fn self_attention(&self) -> &MultiHeadAttention {
        &self.self_attention
    }

    /// The cross-attention over the encoder output, if the model has an encoder.
    pub fn cross_attention(&self) -> Option<&MultiHeadAttention> {
        self.cross.as_ref().map(|c| &c.attention)
    }

    /// Decoding: the layer's forward for new tokens after each sequence's cached ones (see
    /// [`MultiHeadAttention::forward_cached`]): self-attention over its key/value `cache`, then
    /// cross-attention over the memory prepared by [`DecoderLayer::prepare_memory`].
    pub fn forward_cached(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        cache: LayerCache<'_>,
        self_lens: &SeqLens,
        cross_lens: Option<&SeqLens>,
    ) -> Result<()> {
        self.self_block.forward(rec, x, |rec, h, y, r| {
            self.self_attention
                .forward_cached(rec, h, Some(cache), self_lens, y, Some(r))
        })?;
        if let Some(cross) = &self.cross {
            let lens = cross_lens.ok_or_else(|| {
                Error::shape(
                    "cross_lens",
                    "a decoder with cross-attention needs the memory lengths",
                )
            })?;
            cross
                .block
                .forward(rec, &self.self_block.y, |rec, h, y, r| {
                    cross
                        .attention
                        .forward_cached(rec, h, None, lens, y, Some(r))
                })?;
        }
        self.feed_forward_block
            .forward(rec, self.ff_input(), |rec, h, y, r| {
                self.feed_forward.forward(rec, h, y, Some(r))
            })
    }

    /// Decoding: projects the encoder output's keys and values for cross-attention, once per source.
    pub fn prepare_memory(&self, rec: &mut Recording<'_>, memory: &GpuTensor) -> Result<()> {
        match &self.cross {
            Some(cross) => cross.attention.prepare_memory(rec, memory),
            None => Ok(()),
        }
    }
}

impl StackLayer for DecoderLayer {
    type Inputs<'a> = DecoderInputs<'a>;

    fn output(&self) -> &GpuTensor {
        &self.feed_forward_block.y
    }

    fn d_input(&self) -> &GpuTensor {
        &self.self_block.dx
    }

    fn forward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        inputs: DecoderInputs<'_>,
    ) -> Result<()> {
        self.self_block.forward(rec, x, |rec, h, y, r| {
            self.self_attention
                .forward(rec, h, None, inputs.self_lens, y, Some(r))
        })?;
        if let Some(cross) = &self.cross {
            let (memory, cross_lens) = Self::memory(inputs)?;
            cross
                .block
                .forward(rec, &self.self_block.y, |rec, h, y, r| {
                    cross
                        .attention
                        .forward(rec, h, Some(memory), cross_lens, y, Some(r))
                })?;
        }
        self.feed_forward_block
            .forward(rec, self.ff_input(), |rec, h, y, r| {
                self.feed_forward.forward(rec, h, y, Some(r))
            })
    }

    /// Backward for `dy` at the output: the input gradient and, with cross-attention, this layer's
    /// share of the encoder output's gradient.
    fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        inputs: DecoderInputs<'_>,
        dy: &GpuTensor,
    ) -> Result<()> {
        self.feed_forward_block
            .backward(rec, self.ff_input(), dy, |rec, h, grad| {
                self.feed_forward.backward(rec, h, grad)
            })?;
        let mut d = &self.feed_forward_block.dx;
        if let Some(cross) = &self.cross {
            let (memory, cross_lens) = Self::memory(inputs)?;
            cross
                .block
                .backward(rec, &self.self_block.y, d, |rec, h, grad| {
                    let d_memory = Some(&cross.d_memory);
                    cross
                        .attention
                        .backward(rec, h, Some(memory), cross_lens, grad, d_memory)
                })?;
            d = &cross.block.dx;
        }
        self.self_block.backward(rec, x, d, |rec, h, grad| {
            self.self_attention
                .backward(rec, h, None, inputs.self_lens, grad, None)
        })
    }
}

/// Decoder layers, then a final LayerNorm when pre-LN, and the encoder output's gradient summed
/// over the layers.
pub struct Decoder {
    stack: Stack<DecoderLayer>,
    /// Running sums of the layers' encoder-output gradients, in layer order (deterministic).
    d_memory_sums: Vec<GpuTensor>,
}

impl Decoder {
    /// Adds the layers' parameters and allocates their buffers.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
        memory_len: Option<usize>,
    ) -> Result<Self> {
        let stack = Stack::build(ctx, params, name, c, rows, |params, name| {
            DecoderLayer::new(ctx, params, name, c, rows, memory_len)
        })?;
        // One running sum per layer after the first.
        let d_memory_sums = match memory_len {
            Some(mem) => (1..c.layers)
                .map(|_| GpuTensor::zeros(ctx, &[rows[0], mem, c.d_model]))
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        Ok(Self {
            stack,
            d_memory_sums,
        })
    }

    /// The decoder layers, in order.
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.stack.layers
    }

    /// See [`Stack::output`].
    pub fn output<'a>(&'a self, x: &'a GpuTensor) -> &'a GpuTensor {
        self.stack.output(x)
    }

    /// See [`Stack::d_input`].
    pub fn d_input<'a>(&'a self, dy: &'a GpuTensor) -> &'a GpuTensor {
        self.stack.d_input(dy)
    }

    /// The gradient at the encoder output after [`Decoder::backward`]: the sum over the layers'
    /// cross-attention, or `None` without cross-attention.
    pub fn d_memory(&self) -> Option<&GpuTensor> {
        match self.d_memory_sums.last() {
            Some(sum) => Some(sum),
            None => self
                .stack
                .layers
                .first()
                .and_then(|l| l.cross.as_ref())
                .map(|c| &c.d_memory),
        }
    }

    /// Records every layer's forward from `x`.
    pub fn forward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        inputs: DecoderInputs<'_>,
    ) -> Result<()> {
        self.stack.forward(rec, x, inputs)
    }

    /// Decoding: the stack's forward for new tokens `x` after each sequence's cached ones, layer
    /// `i` over `caches[i]` (keys, values); `cross_lens` gives the new tokens and the memory
    /// lengths when there is cross-attention.
    pub fn forward_cached(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        caches: &[LayerCache<'_>],
        self_lens: &SeqLens,
        cross_lens: Option<&SeqLens>,
    ) -> Result<()> {
        if caches.len() != self.stack.layers.len() {
            return Err(Error::shape(
                "caches",
                format!(
                    "has {} layers' caches for {} layers",
                    caches.len(),
                    self.stack.layers.len()
                ),
            ));
        }
        self.stack.forward_each(rec, x, |rec, i, layer, h| {
            layer.forward_cached(rec, h, caches[i], self_lens, cross_lens)
        })
    }

    /// Decoding: projects the encoder output for every layer's cross-attention, once per source.
    pub fn prepare_memory(&self, rec: &mut Recording<'_>, memory: &GpuTensor) -> Result<()> {
        for layer in &self.stack.layers {
            layer.prepare_memory(rec, memory)?;
        }
        Ok(())
    }

    /// Records every layer's backward for `dy` at the output, after a forward from the same `x`.
    pub fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        inputs: DecoderInputs<'_>,
        dy: &GpuTensor,
    ) -> Result<()> {
        let ctx = rec.ctx;
        self.stack.backward(rec, x, inputs, dy)?;
        // sum_0 = d_0 + d_1, sum_k = sum_{k-1} + d_{k+1}.
        let parts: Vec<&GpuTensor> = self
            .stack
            .layers
            .iter()
            .filter_map(|l| l.cross.as_ref().map(|c| &c.d_memory))
            .collect();
        for (k, sum) in self.d_memory_sums.iter().enumerate() {
            let previous = if k == 0 {
                parts[0]
            } else {
                &self.d_memory_sums[k - 1]
            };
            add_into(ctx, rec.encoder, previous, parts[k + 1], sum)?;
        }
        Ok(())
    }
}
