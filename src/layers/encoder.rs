//! Encoder layer (self-attention block, feed-forward block) and the encoder stack; a pre-LN stack
//! ends with a final LayerNorm.

use crate::device::Context;
use crate::error::Result;
use crate::layers::attention::{AttentionKind, MultiHeadAttention};
use crate::layers::feed_forward::FeedForward;
use crate::layers::params::Params;
use crate::layers::residual::{LayerNorm, Residual};
use crate::tensor::{GpuTensor, SeqLens};

/// Sizes shared by the layers of a stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackConfig {
    pub d_model: usize,
    pub heads: usize,
    pub d_ff: usize,
    pub layers: usize,
    pub pre_ln: bool,
}

pub struct EncoderLayer {
    attention: MultiHeadAttention,
    feed_forward: FeedForward,
    attention_block: Residual,
    feed_forward_block: Residual,
}

impl EncoderLayer {
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
    ) -> Result<Self> {
        let kind = AttentionKind::SelfAttention { causal: false };
        Ok(Self {
            attention_block: Residual::new(
                ctx,
                params,
                &format!("{name}.ln1"),
                c.d_model,
                rows,
                c.pre_ln,
            )?,
            attention: MultiHeadAttention::new(
                ctx,
                params,
                &format!("{name}.attn"),
                kind,
                c.d_model,
                c.heads,
                rows,
                rows[1],
            )?,
            feed_forward_block: Residual::new(
                ctx,
                params,
                &format!("{name}.ln2"),
                c.d_model,
                rows,
                c.pre_ln,
            )?,
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
        &self.attention_block.dx
    }

    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        lens: &SeqLens,
    ) -> Result<()> {
        self.attention_block
            .forward(ctx, encoder, p, x, |e, h, y| {
                self.attention.forward(ctx, e, p, h, None, lens, y)
            })?;
        let x1 = &self.attention_block.y;
        self.feed_forward_block
            .forward(ctx, encoder, p, x1, |e, h, y| {
                self.feed_forward.forward(ctx, e, p, h, y)
            })
    }

    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        lens: &SeqLens,
        dy: &GpuTensor,
    ) -> Result<()> {
        let x1 = &self.attention_block.y;
        self.feed_forward_block
            .backward(ctx, encoder, p, x1, dy, |e, h, d_out, d_in| {
                self.feed_forward.backward(ctx, e, p, h, d_out, d_in)
            })?;
        let d_x1 = &self.feed_forward_block.dx;
        self.attention_block
            .backward(ctx, encoder, p, x, d_x1, |e, h, d_out, d_in| {
                self.attention
                    .backward(ctx, e, p, h, None, lens, d_out, d_in, None)
            })
    }
}

/// Encoder layers, then a final LayerNorm when pre-LN.
pub struct Encoder {
    pub layers: Vec<EncoderLayer>,
    final_norm: Option<FinalNorm>,
}

/// The last LayerNorm of a pre-LN stack, with its buffers.
pub(crate) struct FinalNorm {
    norm: LayerNorm,
    pub y: GpuTensor,
    stats: GpuTensor,
    pub dx: GpuTensor,
}

impl FinalNorm {
    pub(crate) fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        d_model: usize,
        rows: [usize; 2],
    ) -> Result<Self> {
        let shape = [rows[0], rows[1], d_model];
        Ok(Self {
            norm: LayerNorm::new(ctx, params, name, d_model)?,
            y: GpuTensor::zeros(ctx, &shape)?,
            stats: GpuTensor::zeros(ctx, &[rows[0] * rows[1], 2])?,
            dx: GpuTensor::zeros(ctx, &shape)?,
        })
    }

    pub(crate) fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
    ) -> Result<()> {
        self.norm.forward(ctx, encoder, p, x, &self.y, &self.stats)
    }

    pub(crate) fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<()> {
        self.norm
            .backward(ctx, encoder, p, x, &self.stats, dy, &self.dx)
    }
}

impl Encoder {
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
    ) -> Result<Self> {
        let layers = (0..c.layers)
            .map(|i| EncoderLayer::new(ctx, params, &format!("{name}.{i}"), c, rows))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = c
            .pre_ln
            .then(|| FinalNorm::new(ctx, params, &format!("{name}.norm"), c.d_model, rows))
            .transpose()?;
        Ok(Self { layers, final_norm })
    }

    /// The stack's output (after the final LayerNorm when pre-LN).
    pub fn output<'a>(&'a self, x: &'a GpuTensor) -> &'a GpuTensor {
        match (&self.final_norm, self.layers.last()) {
            (Some(n), _) => &n.y,
            (None, Some(l)) => l.output(),
            (None, None) => x,
        }
    }

    /// The gradient at the stack's input after [`Encoder::backward`].
    pub fn d_input<'a>(&'a self, dy: &'a GpuTensor) -> &'a GpuTensor {
        match (self.layers.first(), &self.final_norm) {
            (Some(l), _) => l.d_input(),
            (None, Some(n)) => &n.dx,
            (None, None) => dy,
        }
    }

    pub fn forward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        lens: &SeqLens,
    ) -> Result<()> {
        let mut h = x;
        for layer in &self.layers {
            layer.forward(ctx, encoder, p, h, lens)?;
            h = layer.output();
        }
        if let Some(n) = &self.final_norm {
            n.forward(ctx, encoder, p, h)?;
        }
        Ok(())
    }

    /// Backward for the gradient `dy` at [`Encoder::output`], layers in reverse order.
    pub fn backward(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        p: &Params,
        x: &GpuTensor,
        lens: &SeqLens,
        dy: &GpuTensor,
    ) -> Result<()> {
        let mut d = dy;
        if let Some(n) = &self.final_norm {
            let last = self.layers.last().map_or(x, EncoderLayer::output);
            n.backward(ctx, encoder, p, last, d)?;
            d = &n.dx;
        }
        for (i, layer) in self.layers.iter().enumerate().rev() {
            let input = if i == 0 {
                x
            } else {
                self.layers[i - 1].output()
            };
            layer.backward(ctx, encoder, p, input, lens, d)?;
            d = layer.d_input();
        }
        Ok(())
    }
}
