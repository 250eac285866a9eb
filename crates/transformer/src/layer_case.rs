//! One [`EncoderLayer`] (causal or not, pre- or post-LN) on preallocated buffers, forward and
//! backward recorded into one submission, with its parameters and results in the order of the f64
//! reference layer ([`crate::reference::transformer_layer`]) it is checked by: what the layer's
//! test and the benchmark's layer case run.

use crate::layers::encoder::EncoderLayer;
use crate::layers::params::{ParamId, Params};
use crate::layers::stack::{StackConfig, StackLayer};
use crate::layers::Recording;
use crate::reference::transformer_layer::{param_shapes, TransformerLayerConfig};
use wgpu_attention::device::Context;
use wgpu_attention::error::Result;
use wgpu_attention::tensor::{GpuTensor, SeqLens};

/// The layer's parameter prefix.
const NAME: &str = "layer";

/// One encoder layer, its parameters, inputs and output gradient, ready to run forward and backward
/// (the layer benchmark and its validation).
pub struct LayerCase {
    /// The layer's sizes and score options.
    pub config: TransformerLayerConfig,
    params: Params,
    layer: EncoderLayer,
    lens: SeqLens,
    x: GpuTensor,
    dy: GpuTensor,
}

/// What one forward and backward produced, read back in the reference's order.
pub struct LayerResults {
    /// The layer's output `[B, L, d_model]`.
    pub y: Vec<f32>,
    /// The gradient at the layer's input.
    pub dx: Vec<f32>,
    /// Parameter gradients, in [`param_shapes`] order.
    pub grads: Vec<Vec<f32>>,
}

impl LayerCase {
    /// A layer with parameters initialised from `seed`, over `x` and output gradient `dy`
    /// (`[batch, seq, d_model]` each).
    pub fn new(
        ctx: &Context,
        config: TransformerLayerConfig,
        batch: usize,
        seq: usize,
        x: &[f32],
        dy: &[f32],
        seed: u64,
    ) -> Result<Self> {
        let stack = StackConfig {
            d_model: config.d_model,
            heads: config.heads,
            d_ff: config.d_ff,
            layers: 1,
            pre_ln: config.pre_ln,
            norm: Default::default(),
            feed_forward: Default::default(),
            kv_heads: config.heads,
            bias: true,
            scores: Default::default(),
            positions: seq,
            packed_sequences: None,
        };
        let mut params = Params::new(seed);
        let rows = [batch, seq];
        let layer = EncoderLayer::with_mask(ctx, &mut params, NAME, &stack, rows, config.causal)?;
        let lens = vec![seq as u32; batch];
        let shape = [batch, seq, config.d_model];
        Ok(Self {
            config,
            lens: SeqLens::new(ctx, Some(&lens), Some(&lens))?,
            x: GpuTensor::from_slice(ctx, x, &shape)?,
            dy: GpuTensor::from_slice(ctx, dy, &shape)?,
            params,
            layer,
        })
    }

    /// Records the forward and the backward into one command buffer and submits it.
    pub fn run(&self, ctx: &Context) -> Result<()> {
        let mut encoder = ctx
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("layer forward + backward"),
            });
        let rec = &mut Recording::new(ctx, &mut encoder, &self.params);
        self.layer.forward(rec, &self.x, &self.lens)?;
        self.layer.backward(rec, &self.x, &self.lens, &self.dy)?;
        ctx.queue().submit([encoder.finish()]);
        Ok(())
    }

    /// The parameter values in [`param_shapes`] order, widened for the reference.
    pub fn reference_params(&self, ctx: &Context) -> Result<Vec<Vec<f64>>> {
        self.in_reference_order(ctx, |id| self.params.value(id))?
            .into_iter()
            .map(|v| Ok(v.iter().map(|&x| f64::from(x)).collect()))
            .collect()
    }

    /// The results of the last [`LayerCase::run`].
    pub fn results(&self, ctx: &Context) -> Result<LayerResults> {
        Ok(LayerResults {
            y: self.layer.output().to_vec(ctx)?,
            dx: self.layer.d_input().to_vec(ctx)?,
            grads: self.in_reference_order(ctx, |id| self.params.grad(id))?,
        })
    }

    fn in_reference_order<'a>(
        &'a self,
        ctx: &Context,
        pick: impl Fn(ParamId) -> &'a GpuTensor,
    ) -> Result<Vec<Vec<f32>>> {
        param_shapes(&self.config)
            .iter()
            .map(|(name, _)| {
                let id = self
                    .params
                    .find(&format!("{NAME}.{name}"))
                    .expect("EncoderLayer names its parameters as the reference does");
                pick(id).to_vec(ctx)
            })
            .collect()
    }
}
