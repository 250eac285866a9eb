//! Encoder layer (self-attention block, feed-forward block) and the encoder: a [`Stack`] of them.
//! One layer's f64 counterpart is [`crate::reference::transformer_layer`]; the whole encoder's is part
//! of [`crate::reference::transformer`].

use crate::layers::attention::{AttentionKind, MultiHeadAttention};
use crate::layers::feed_forward::FeedForward;
use crate::layers::params::Params;
use crate::layers::residual::Residual;
use crate::layers::stack::{Stack, StackConfig, StackLayer};
use crate::layers::Recording;
use wgpu_attention::device::Context;
use wgpu_attention::error::Result;
use wgpu_attention::tensor::{GpuTensor, SeqLens};

/// An encoder layer: bidirectional self-attention with key padding, then the feed-forward block,
/// each in a residual block.
pub struct EncoderLayer {
    attention: MultiHeadAttention,
    feed_forward: FeedForward,
    attention_block: Residual,
    feed_forward_block: Residual,
}

impl EncoderLayer {
    /// Adds the layer's parameters under `name` and allocates its buffers for `rows = [batch,
    /// seq]`.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
    ) -> Result<Self> {
        Self::with_mask(ctx, params, name, c, rows, false)
    }

    /// A layer whose self-attention is causal when `causal` (a decoder-only block without
    /// cross-attention; the benchmark's causal layer case).
    pub fn with_mask(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
        causal: bool,
    ) -> Result<Self> {
        let kind = AttentionKind::SelfAttention { causal };
        Ok(Self {
            attention_block: Residual::new(
                ctx,
                params,
                &format!("{name}.ln1"),
                c.d_model,
                rows,
                c.pre_ln,
                c.norm,
            )?,
            attention: MultiHeadAttention::new(
                ctx,
                params,
                &format!("{name}.attn"),
                kind,
                c,
                rows,
                rows[1],
            )?
            .with_scores(ctx, params, c.scores, c.positions)?,
            feed_forward_block: Residual::new(
                ctx,
                params,
                &format!("{name}.ln2"),
                c.d_model,
                rows,
                c.pre_ln,
                c.norm,
            )?,
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
}

impl EncoderLayer {
    /// The self-attention.
    pub fn attention(&self) -> &MultiHeadAttention {
        &self.attention
    }
}

impl StackLayer for EncoderLayer {
    /// The encoder's sequence lengths (key padding).
    type Inputs<'a> = &'a SeqLens;

    fn output(&self) -> &GpuTensor {
        &self.feed_forward_block.y
    }

    fn d_input(&self) -> &GpuTensor {
        &self.attention_block.dx
    }

    fn forward(&self, rec: &mut Recording<'_>, x: &GpuTensor, lens: &SeqLens) -> Result<()> {
        self.attention_block.forward(rec, x, |rec, h, y, r| {
            self.attention.forward(rec, h, None, lens, y, Some(r))
        })?;
        let x1 = &self.attention_block.y;
        self.feed_forward_block.forward(rec, x1, |rec, h, y, r| {
            self.feed_forward.forward(rec, h, y, Some(r))
        })
    }

    fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        lens: &SeqLens,
        dy: &GpuTensor,
    ) -> Result<()> {
        let x1 = &self.attention_block.y;
        self.feed_forward_block
            .backward(rec, x1, dy, |rec, h, grad| {
                self.feed_forward.backward(rec, h, grad)
            })?;
        let d_x1 = &self.feed_forward_block.dx;
        self.attention_block.backward(rec, x, d_x1, |rec, h, grad| {
            self.attention.backward(rec, h, None, lens, grad, None)
        })
    }
}

/// Encoder layers, then a final LayerNorm when pre-LN.
pub type Encoder = Stack<EncoderLayer>;

impl Encoder {
    /// `c.layers` encoder layers named `{name}.{i}` for `rows = [batch, seq]`.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
    ) -> Result<Self> {
        Stack::build(ctx, params, name, c, rows, |params, name| {
            EncoderLayer::new(ctx, params, name, c, rows)
        })
    }
}
