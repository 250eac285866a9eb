//! A stack of layers (the encoder's, the decoder's) with the final norm a pre-LN stack ends
//! with: forward through the layers in order, backward in reverse, each layer reading the previous
//! layer's output buffer and leaving its input gradient in its own.

use crate::layers::feed_forward::FeedForwardConfig;
use crate::layers::params::Params;
use crate::layers::residual::{LayerNorm, NormConfig};
use crate::layers::scores::ScoreOptions;
use crate::layers::Recording;
use wgpu_attention::device::Context;
use wgpu_attention::error::Result;
use wgpu_attention::tensor::GpuTensor;

/// Sizes shared by the layers of a stack, and the score modifiers of their self-attention. Made by
/// [`crate::TransformerConfig::stack`]; `StackConfig::default()` is the default model's encoder
/// stack over 512 positions, with setters (`.layers(2).positions(128)`).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct StackConfig {
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Feed-forward width.
    pub d_ff: usize,
    /// Layers in the stack.
    pub layers: usize,
    /// Pre-LN (with a final LayerNorm) or post-LN.
    pub pre_ln: bool,
    /// The blocks' normalisation (LayerNorm or RMSNorm) and its epsilon.
    pub norm: NormConfig,
    /// The feed-forward block: activation, gated or not.
    pub feed_forward: FeedForwardConfig,
    /// Key and value heads of self-attention (GQA when below `heads`; `heads` for multi-head).
    pub kv_heads: usize,
    /// Biases in the attention and feed-forward projections.
    pub bias: bool,
    /// Self-attention score options of every layer.
    pub scores: ScoreOptions,
    /// The longest sequence the layers see, in positions (the size of rotary tables; a decoding
    /// stack's is its cache capacity).
    pub positions: usize,
    /// Packed variable-length batches: the layers' rows (a batch of 1) hold up to this many
    /// sequences one after another (`SeqLens::packed` lengths select the layout per call). `None`:
    /// padded batches only.
    pub packed_sequences: Option<usize>,
}

impl Default for StackConfig {
    fn default() -> Self {
        let model = crate::TransformerConfig::default();
        model.stack(model.encoder_layers, model.max_positions.unwrap_or(512))
    }
}

wgpu_attention::config_setters!(StackConfig {
    d_model: usize,
    heads: usize,
    d_ff: usize,
    layers: usize,
    pre_ln: bool,
    norm: NormConfig,
    feed_forward: FeedForwardConfig,
    kv_heads: usize,
    bias: bool,
    scores: ScoreOptions,
    positions: usize,
    packed_sequences: Option<usize>,
});

/// A layer a [`Stack`] can hold: `[rows, d_model]` in, the same out, into buffers the layer owns.
pub trait StackLayer {
    /// What every layer of the stack reads besides its input (sequence lengths, encoder output).
    type Inputs<'a>: Copy;

    /// The output of the last [`StackLayer::forward`].
    fn output(&self) -> &GpuTensor;

    /// The gradient at the input after the last [`StackLayer::backward`].
    fn d_input(&self) -> &GpuTensor;

    /// Records the layer's forward from `x` into its own output buffer.
    fn forward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        inputs: Self::Inputs<'_>,
    ) -> Result<()>;

    /// Backward for `dy` at [`StackLayer::output`], after a forward from the same `x`.
    fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        inputs: Self::Inputs<'_>,
        dy: &GpuTensor,
    ) -> Result<()>;
}

/// Layers, then a final LayerNorm when pre-LN.
pub struct Stack<L> {
    /// The layers, input first.
    pub layers: Vec<L>,
    final_norm: Option<FinalNorm>,
}

impl<L: StackLayer> Stack<L> {
    /// `c.layers` layers named `{name}.{i}` made by `layer`, and `{name}.norm` when pre-LN.
    pub fn build(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
        mut layer: impl FnMut(&mut Params, &str) -> Result<L>,
    ) -> Result<Self> {
        let layers = (0..c.layers)
            .map(|i| layer(params, &format!("{name}.{i}")))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = c
            .pre_ln
            .then(|| FinalNorm::new(ctx, params, &format!("{name}.norm"), c, rows))
            .transpose()?;
        Ok(Self { layers, final_norm })
    }

    /// The stack's output (after the final LayerNorm when pre-LN) for input `x`.
    pub fn output<'a>(&'a self, x: &'a GpuTensor) -> &'a GpuTensor {
        match (&self.final_norm, self.layers.last()) {
            (Some(n), _) => &n.y,
            (None, Some(l)) => l.output(),
            (None, None) => x,
        }
    }

    /// The gradient at the stack's input after [`Stack::backward`] from `dy`.
    pub fn d_input<'a>(&'a self, dy: &'a GpuTensor) -> &'a GpuTensor {
        match (self.layers.first(), &self.final_norm) {
            (Some(l), _) => l.d_input(),
            (None, Some(n)) => &n.dx,
            (None, None) => dy,
        }
    }

    /// The input of layer `i`: `x` for the first, the previous layer's output after it.
    fn layer_input<'a>(&'a self, i: usize, x: &'a GpuTensor) -> &'a GpuTensor {
        match i {
            0 => x,
            _ => self.layers[i - 1].output(),
        }
    }

    /// Records every layer's forward from `x`, then the final LayerNorm (pre-LN).
    pub fn forward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        inputs: L::Inputs<'_>,
    ) -> Result<()> {
        self.forward_each(rec, x, |rec, _, layer, h| layer.forward(rec, h, inputs))
    }

    /// A forward in which `layer(i, layer, x)` runs layer `i` on its input (the decoding path, where
    /// each layer also reads its own cache), then the final LayerNorm.
    pub fn forward_each(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        mut layer: impl FnMut(&mut Recording<'_>, usize, &L, &GpuTensor) -> Result<()>,
    ) -> Result<()> {
        for (i, l) in self.layers.iter().enumerate() {
            layer(rec, i, l, self.layer_input(i, x))?;
        }
        if let Some(n) = &self.final_norm {
            n.forward(rec, self.layer_input(self.layers.len(), x))?;
        }
        Ok(())
    }

    /// Backward for the gradient `dy` at [`Stack::output`], layers in reverse order.
    pub fn backward(
        &self,
        rec: &mut Recording<'_>,
        x: &GpuTensor,
        inputs: L::Inputs<'_>,
        dy: &GpuTensor,
    ) -> Result<()> {
        let mut d = dy;
        if let Some(n) = &self.final_norm {
            n.backward(rec, self.layer_input(self.layers.len(), x), d)?;
            d = &n.dx;
        }
        for (i, layer) in self.layers.iter().enumerate().rev() {
            layer.backward(rec, self.layer_input(i, x), inputs, d)?;
            d = layer.d_input();
        }
        Ok(())
    }
}

/// The last LayerNorm of a pre-LN stack, with its buffers.
struct FinalNorm {
    norm: LayerNorm,
    y: GpuTensor,
    stats: GpuTensor,
    dx: GpuTensor,
}

impl FinalNorm {
    fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        c: &StackConfig,
        rows: [usize; 2],
    ) -> Result<Self> {
        let shape = [rows[0], rows[1], c.d_model];
        Ok(Self {
            norm: LayerNorm::with_config(ctx, params, name, c.d_model, c.norm)?,
            y: GpuTensor::zeros(ctx, &shape)?,
            stats: GpuTensor::zeros(ctx, &[rows[0] * rows[1], 2])?,
            dx: GpuTensor::zeros(ctx, &shape)?,
        })
    }

    fn forward(&self, rec: &mut Recording<'_>, x: &GpuTensor) -> Result<()> {
        self.norm.forward(rec, x, &self.y, &self.stats)
    }

    fn backward(&self, rec: &mut Recording<'_>, x: &GpuTensor, dy: &GpuTensor) -> Result<()> {
        self.norm.backward(rec, x, &self.stats, dy, None, &self.dx)
    }
}
