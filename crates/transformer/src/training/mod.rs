//! Training: one step (forward, backward, AdamW) recorded into one compute pass and one submission
//! on buffers allocated once, a guard that stops updating at the first non-finite loss or gradient
//! norm, and atomic safetensors checkpoints of weights and optimizer state with periodic saves.
//! Mixed precision ([`Trainer::with_precision`]): f16 products, f32 master weights and optimizer
//! state, and dynamic loss scaling whose skipped steps [`Trainer::loss_scale_state`] reports and
//! checkpoints keep.

pub mod checkpoint;

use crate::layers::Precision;
use crate::model::transformer::{Batch, Transformer};
use wgpu_attention::device::{BindingCache, Context};
use wgpu_attention::error::Result;
use wgpu_attention::kernels::loss_scale::{LossScaleState, LossScaling};
use wgpu_attention::kernels::optimizer::{AdamW, AdamWConfig};

/// A model and its AdamW optimizer: one `step` records the forward, the backward and the update in
/// one compute pass and one submission.
pub struct Trainer {
    /// The model trained.
    pub model: Transformer,
    /// Its optimizer (moments, step count, learning rate).
    pub optimizer: AdamW,
    /// Bind groups and parameter blocks of the recorded kernels, reused from the second step on.
    bindings: BindingCache,
}

impl Trainer {
    /// An optimizer with `config` over every parameter of `model`, trained in the model's
    /// precision (f32 unless set otherwise).
    pub fn new(ctx: &Context, model: Transformer, config: AdamWConfig) -> Result<Self> {
        let precision = model.precision();
        Self::with_precision(ctx, model, config, precision)
    }

    /// [`Trainer::new`] in `precision`. [`Precision::Mixed`] is PyTorch AMP's recipe: the Linear
    /// layers multiply f16 copies of the f32 master weights (refreshed every step) with f16-rounded
    /// inputs and gradients in f32 accumulation; the optimizer's state and the weights stay f32;
    /// the loss is scaled dynamically ([`LossScaling::default`]: 2^16, doubling after 2000 clean
    /// steps, halved and the step skipped when the gradients overflow; change it with
    /// `trainer.optimizer.enable_loss_scaling`). Needs `SHADER_F16`.
    pub fn with_precision(
        ctx: &Context,
        mut model: Transformer,
        config: AdamWConfig,
        precision: Precision,
    ) -> Result<Self> {
        model.set_precision(ctx, precision)?;
        let mut optimizer = AdamW::new(
            ctx,
            config,
            &model.params.values().iter().collect::<Vec<_>>(),
        )?;
        if precision == Precision::Mixed {
            optimizer.enable_loss_scaling(ctx, LossScaling::default())?;
        }
        Ok(Self {
            model,
            optimizer,
            bindings: BindingCache::default(),
        })
    }

    /// The loss scale after the submitted steps (waits for them): its value, the clean steps since
    /// it changed and the steps skipped because their gradients overflowed. `None` in f32.
    pub fn loss_scale_state(&self, ctx: &Context) -> Result<Option<LossScaleState>> {
        self.optimizer
            .loss_scale()
            .map(|scale| scale.state(ctx))
            .transpose()
    }

    /// Writes `batch` and submits forward, backward and the optimizer update as one command buffer.
    /// Nothing is read back: the loss of the step is in [`Transformer::loss`].
    pub fn step(&mut self, ctx: &Context, batch: &Batch) -> Result<()> {
        self.model.set_batch(ctx, batch)?;
        let mut encoder = ctx
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("training step"),
            });
        let (model, optimizer) = (&self.model, &mut self.optimizer);
        ctx.with_binding_cache(&mut self.bindings, || -> Result<()> {
            // Forward, backward and update in one compute pass (see `Context::with_one_pass`).
            ctx.with_one_pass(&mut encoder, "training step", |encoder| {
                model.forward(ctx, encoder)?;
                model.backward_scaled(ctx, encoder, optimizer.loss_scale())?;
                let (params, grads) = model.parameters();
                optimizer.step_into_guarded(ctx, encoder, &params, &grads, model.loss())
            })
        })?;
        ctx.submit(encoder)?;
        Ok(())
    }

    /// Compiles every pipeline a [`Trainer::step`] at the model's batch shape uses, without running
    /// one: the step is recorded into a command buffer that is never submitted, so weights, moments
    /// and the step count are unchanged. Returns how many pipelines were newly compiled. With
    /// [`wgpu_attention::ContextOptions::dump_pipelines`] this writes the training kernel set to disk.
    pub fn precompile(&mut self, ctx: &Context) -> Result<usize> {
        let before = ctx.cached_pipelines();
        let mut encoder = ctx
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("training step precompile (never submitted)"),
            });
        let (model, optimizer) = (&self.model, &mut self.optimizer);
        // No binding cache: its slots belong to submitted recordings.
        ctx.with_one_pass(&mut encoder, "training step", |encoder| {
            model.forward(ctx, encoder)?;
            model.backward_scaled(ctx, encoder, optimizer.loss_scale())?;
            let (params, grads) = model.parameters();
            optimizer.record_unsubmitted_step(ctx, encoder, &params, &grads, model.loss())
        })?;
        drop(encoder);
        Ok(ctx.cached_pipelines() - before)
    }

    /// `Err(`[`wgpu_attention::Error::NonFinite`]`)` if a step since the last checkpoint load had a non-finite
    /// loss or gradient norm (from then on the optimizer changes nothing). Waits for submitted steps.
    pub fn check_finite(&self, ctx: &Context) -> Result<()> {
        self.optimizer.check_finite(ctx)
    }

    /// Async form of [`Trainer::check_finite`] (what a browser must use).
    pub async fn check_finite_async(&self, ctx: &Context) -> Result<()> {
        self.optimizer.check_finite_async(ctx).await
    }

    /// Bind groups created and reused so far: after the first step (and the first forward-only
    /// call) the created count stays put.
    pub fn binding_counts(&self) -> (u64, u64) {
        self.bindings.counts()
    }

    /// Forward only (for evaluation), submitted.
    pub fn forward(&mut self, ctx: &Context, batch: &Batch) -> Result<()> {
        self.model.set_batch(ctx, batch)?;
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let model = &self.model;
        ctx.with_binding_cache(&mut self.bindings, || model.forward(ctx, &mut encoder))?;
        ctx.submit(encoder)?;
        Ok(())
    }
}
