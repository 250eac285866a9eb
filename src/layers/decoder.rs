//! Decoder layer (causal self-attention, cross-attention over the encoder output when there is one,
//! feed-forward) and the decoder stack. Without an encoder (`memory_len = None`) the layers have no
//! cross-attention: the decoder-only language-model configuration.

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::elementwise::add_into;
use crate::layers::attention::{AttentionKind, MultiHeadAttention};
use crate::layers::encoder::{FinalNorm, StackConfig};
use crate::layers::feed_forward::FeedForward;
use crate::layers::params::Params;
use crate::layers::residual::Residual;
use crate::tensor::{GpuTensor, SeqLens};

/// Cross-attention of one decoder layer, with the gradient it sends to the encoder output.
struct Cross {
    attention: MultiHeadAttention,
    block: Residual,
    d_memory: GpuTensor,
}

pub struct DecoderLayer {
    self_attention: MultiHeadAttention,
    self_block: Residual,
    cross: Option<Cross>,
    feed_forward: FeedForward,
    feed_forward_block: Residual,
}

/// Sequence lengths a decoder layer masks with: its own (self-attention) and queries against the
/// encoder's (cross-attention).
pub struct DecoderLens<'a> {
    pub self_lens: &'a SeqLens,
    pub cross_lens: Option<&'a SeqLens>,
}

impl DecoderLayer {
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
            )
        };
        let self_block = block(params, "ln1")?;
        let self_attention = MultiHeadAttention::new(
            ctx,
            params,
            &format!("{name}.self_attn"),
            AttentionKind::SelfAttention { causal: true },
            c.d_model,
            c.heads,
            rows,
            rows[1],
        )?;
        let cross = match memory_len {
            Some(mem) => Some(Cross {
                block: block(params, "ln_cross")?,
                attention: MultiHeadAttention::new(
                    ctx,
                    params,
                    &format!("{name}.cross_attn"),
                    AttentionKind::Cross,
                    c.d_model,
                    c.heads,
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
                c.d_model,
                c.d_ff,
                rows,
            )?,
        })
    }

    pub fn output(&self) -> &GpuTensor {
        &self.feed_forward_block.y
    }

    pub fn d_input(&self) -> &GpuTensor {
        &self.self_block.dx
    }

    /// The feed-forward block's input: the cross-attention block's output, or the self-attention's.
    fn ff_input(&self) -> &GpuTensor {
        self.cross
            .as_ref()
            .map_or(&self.self_block.y, |c| &c.block.y)
    }

    fn memory_and_lens<'a>(
        &self,
        memory: Option<&'a GpuTensor>,
        lens: &DecoderLens<'a>,
    ) -> Result<(&'a GpuTensor, &'a SeqLens)> {
        match (memory, lens.cross_lens) {
            (Some(m), Some(l)) => Ok((m, l)),
            _ => Err(Error::shape(
                "memory",
                "a decoder layer with cross-attention needs the encoder output and its lengths",
            )),
        }
    }

    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        memory: Option<&GpuTensor>,
        lens: &DecoderLens<'_>,
    ) -> Result<()> {
        self.self_block.forward(ctx, encoder, p, x, |e, h, y| {
            self.self_attention
                .forward(ctx, e, p, h, None, lens.self_lens, y)
        })?;
        if let Some(cross) = &self.cross {
            let (memory, cross_lens) = self.memory_and_lens(memory, lens)?;
            cross
                .block
                .forward(ctx, encoder, p, &self.self_block.y, |e, h, y| {
                    cross
                        .attention
                        .forward(ctx, e, p, h, Some(memory), cross_lens, y)
                })?;
        }
        self.feed_forward_block
            .forward(ctx, encoder, p, self.ff_input(), |e, h, y| {
                self.feed_forward.forward(ctx, e, p, h, y)
            })
    }

    /// Backward for `dy` at [`DecoderLayer::output`]: [`DecoderLayer::d_input`] and, with
    /// cross-attention, this layer's share of the encoder output's gradient.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        memory: Option<&GpuTensor>,
        lens: &DecoderLens<'_>,
        dy: &GpuTensor,
    ) -> Result<()> {
        self.feed_forward_block.backward(
            ctx,
            encoder,
            p,
            self.ff_input(),
            dy,
            |e, h, d_out, d_in| self.feed_forward.backward(ctx, e, p, h, d_out, d_in),
        )?;
        let mut d = &self.feed_forward_block.dx;
        if let Some(cross) = &self.cross {
            let (memory, cross_lens) = self.memory_and_lens(memory, lens)?;
            cross.block.backward(
                ctx,
                encoder,
                p,
                &self.self_block.y,
                d,
                |e, h, d_out, d_in| {
                    cross.attention.backward(
                        ctx,
                        e,
                        p,
                        h,
                        Some(memory),
                        cross_lens,
                        d_out,
                        d_in,
                        Some(&cross.d_memory),
                    )
                },
            )?;
            d = &cross.block.dx;
        }
        self.self_block
            .backward(ctx, encoder, p, x, d, |e, h, d_out, d_in| {
                self.self_attention
                    .backward(ctx, e, p, h, None, lens.self_lens, d_out, d_in, None)
            })
    }
}

/// Decoder layers, then a final LayerNorm when pre-LN.
pub struct Decoder {
    pub layers: Vec<DecoderLayer>,
    final_norm: Option<FinalNorm>,
    /// Running sums of the layers' encoder-output gradients, in layer order (deterministic).
    d_memory_sums: Vec<GpuTensor>,
}

impl Decoder {
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
        memory_len: Option<usize>,
    ) -> Result<Self> {
        let layers = (0..c.layers)
            .map(|i| DecoderLayer::new(ctx, params, &format!("{name}.{i}"), c, rows, memory_len))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = c
            .pre_ln
            .then(|| FinalNorm::new(ctx, params, &format!("{name}.norm"), c.d_model, rows))
            .transpose()?;
        // One running sum per layer after the first.
        let d_memory_sums = match memory_len {
            Some(mem) => (1..c.layers)
                .map(|_| GpuTensor::zeros(ctx, &[rows[0], mem, c.d_model]))
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        Ok(Self {
            layers,
            final_norm,
            d_memory_sums,
        })
    }

    pub fn output<'a>(&'a self, x: &'a GpuTensor) -> &'a GpuTensor {
        match (&self.final_norm, self.layers.last()) {
            (Some(n), _) => &n.y,
            (None, Some(l)) => l.output(),
            (None, None) => x,
        }
    }

    pub fn d_input<'a>(&'a self, dy: &'a GpuTensor) -> &'a GpuTensor {
        match (self.layers.first(), &self.final_norm) {
            (Some(l), _) => l.d_input(),
            (None, Some(n)) => &n.dx,
            (None, None) => dy,
        }
    }

    /// The gradient at the encoder output after [`Decoder::backward`]: the sum over the layers'
    /// cross-attention, or `None` without cross-attention.
    pub fn d_memory(&self) -> Option<&GpuTensor> {
        match self.d_memory_sums.last() {
            Some(sum) => Some(sum),
            None => self
                .layers
                .first()
                .and_then(|l| l.cross.as_ref())
                .map(|c| &c.d_memory),
        }
    }

    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        memory: Option<&GpuTensor>,
        lens: &DecoderLens<'_>,
    ) -> Result<()> {
        let mut h = x;
        for layer in &self.layers {
            layer.forward(ctx, encoder, p, h, memory, lens)?;
            h = layer.output();
        }
        if let Some(n) = &self.final_norm {
            n.forward(ctx, encoder, p, h)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        memory: Option<&GpuTensor>,
        lens: &DecoderLens<'_>,
        dy: &GpuTensor,
    ) -> Result<()> {
        let mut d = dy;
        if let Some(n) = &self.final_norm {
            let last = self.layers.last().map_or(x, DecoderLayer::output);
            n.backward(ctx, encoder, p, last, d)?;
            d = &n.dx;
        }
        for (i, layer) in self.layers.iter().enumerate().rev() {
            let input = if i == 0 {
                x
            } else {
                self.layers[i - 1].output()
            };
            layer.backward(ctx, encoder, p, input, memory, lens, d)?;
            d = layer.d_input();
        }
        // sum_0 = d_0 + d_1, sum_k = sum_{k-1} + d_{k+1}.
        let parts: Vec<&GpuTensor> = self
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
            add_into(ctx, encoder, previous, parts[k + 1], sum)?;
        }
        Ok(())
    }
}
