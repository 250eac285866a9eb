//! Training: one step (forward, backward, AdamW) recorded into one compute pass and one submission
//! on buffers allocated once, a guard that stops updating at the first non-finite loss or gradient
//! norm, and atomic safetensors checkpoints of weights and optimizer state with periodic saves.

pub mod checkpoint;

use crate::model::transformer::{Batch, Transformer};
use wgpu_attention::device::{BindingCache, Context};
use wgpu_attention::error::Result;
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
    /// An optimizer with `config` over every parameter of `model`.
    pub fn new(ctx: &Context, model: Transformer, config: AdamWConfig) -> Result<Self> {
        let optimizer = AdamW::new(
            ctx,
            config,
            &model.params.values().iter().collect::<Vec<_>>(),
        )?;
        Ok(Self {
            model,
            optimizer,
            bindings: BindingCache::default(),
        })
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
                model.backward(ctx, encoder)?;
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
            model.backward(ctx, encoder)?;
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
