//! Dynamic loss scaling for mixed-precision training (SPEC.md, "Mixed precision"), as PyTorch's
//! `GradScaler` does it: the loss gradient is multiplied by a scale `S` so that small gradients
//! survive the products' f16 rounding; the optimizer unscales them, and a step whose gradients
//! overflowed (a non-finite gradient norm) is skipped, its scale halved; after
//! [`LossScaling::growth_interval`] clean steps in a row the scale doubles. The state lives on the
//! GPU ([`LossScale`]): the cross-entropy backward reads `S`
//! ([`crate::kernels::cross_entropy::LossGradient::scaled`]), the gradient-norm
//! kernel decides skip and scale, AdamW unscales and skips, and nothing is read back per step.

use crate::device::{Allocation, Context};
use crate::error::{Error, Result};
use std::sync::Arc;

/// Loss-scaling hyper-parameters: `LossScaling::default()` with setters.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct LossScaling {
    /// The first step's scale, a power of two from 1 to [`LossScaling::MAX_SCALE`] (PyTorch's
    /// default: 2^16).
    pub initial_scale: f32,
    /// Clean steps in a row after which the scale doubles (PyTorch's default: 2000).
    pub growth_interval: u32,
}

crate::config_setters!(LossScaling {
    initial_scale: f32,
    growth_interval: u32,
});

impl Default for LossScaling {
    fn default() -> Self {
        Self {
            initial_scale: 65536.0,
            growth_interval: 2000,
        }
    }
}

impl LossScaling {
    /// The largest scale: growth stops here (2^24). The smallest is 1: a step whose gradients
    /// overflow at scale 1 is skipped and the scale stays 1.
    pub const MAX_SCALE: f32 = 16_777_216.0;

    /// Whether `scale` is one a [`LossScale`] can hold: a power of two from 1 to
    /// [`LossScaling::MAX_SCALE`] (scaling by a power of two changes no bit of the gradients but
    /// their exponent).
    pub fn is_scale(scale: f32) -> bool {
        (1.0..=Self::MAX_SCALE).contains(&scale) && scale.to_bits() & 0x007f_ffff == 0
    }

    fn validate(&self) -> Result<()> {
        let s = self.initial_scale;
        if !Self::is_scale(s) {
            return Err(Error::shape(
                "initial_scale",
                format!(
                    "is {s}; it must be a power of two from 1 to 2^24 (scaling by a power of two \
                     changes no bit of the gradients but their exponent)"
                ),
            ));
        }
        if self.growth_interval == 0 {
            return Err(Error::shape(
                "growth_interval",
                "is 0; give the clean steps after which the scale doubles (at least 1)",
            ));
        }
        Ok(())
    }
}

/// The loss scale's state after the steps submitted so far, read back with
/// [`LossScale::state`]; saved in checkpoints (as JSON).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaleState {
    /// The scale the next step multiplies the loss gradient by.
    pub scale: f32,
    /// Clean steps since the scale last changed.
    pub clean_steps: u32,
    /// Steps skipped so far because their gradients overflowed.
    pub skipped_steps: u32,
    /// Whether the last step was skipped.
    pub last_step_skipped: bool,
}

impl LossScaleState {
    /// The GPU words (`shaders/grad_norm_finalize.wgsl`): scale bits, clean steps, skipped steps,
    /// last step skipped.
    fn words(self) -> [u32; 4] {
        [
            self.scale.to_bits(),
            self.clean_steps,
            self.skipped_steps,
            self.last_step_skipped as u32,
        ]
    }
}

/// The loss scale on the GPU: four words (scale, clean steps, skipped steps, last step skipped)
/// that the loss gradient, the gradient norm and the optimizer read and update within each step.
/// Cheap to clone (the buffer is shared).
#[derive(Clone, Debug)]
pub struct LossScale {
    config: LossScaling,
    buffer: wgpu::Buffer,
    _allocation: Arc<Allocation>,
}

impl LossScale {
    /// A scale at `config.initial_scale`, no step taken.
    pub fn new(ctx: &Context, config: LossScaling) -> Result<Self> {
        config.validate()?;
        let (buffer, allocation) = ctx.create_buffer(
            "loss scale",
            16,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        )?;
        let scale = Self {
            config,
            buffer,
            _allocation: Arc::new(allocation),
        };
        scale.set_state(
            ctx,
            LossScaleState {
                scale: config.initial_scale,
                clean_steps: 0,
                skipped_steps: 0,
                last_step_skipped: false,
            },
        )?;
        Ok(scale)
    }

    /// Its hyper-parameters.
    pub fn config(&self) -> &LossScaling {
        &self.config
    }

    /// The state after the submitted steps (waits for them: 16 bytes read back).
    pub fn state(&self, ctx: &Context) -> Result<LossScaleState> {
        crate::device::block_on("LossScale::state", self.state_async(ctx))
    }

    /// Async form of [`LossScale::state`] (what a browser must use).
    pub async fn state_async(&self, ctx: &Context) -> Result<LossScaleState> {
        let words = crate::tensor::read_buffer(ctx, &self.buffer, 0, 4).await?;
        Ok(LossScaleState {
            scale: words[0],
            clean_steps: words[1].to_bits(),
            skipped_steps: words[2].to_bits(),
            last_step_skipped: words[3].to_bits() != 0,
        })
    }

    /// Restores a state (a checkpoint's), checked as [`LossScaling::initial_scale`] is.
    pub fn set_state(&self, ctx: &Context, state: LossScaleState) -> Result<()> {
        if !LossScaling::is_scale(state.scale) {
            return Err(Error::shape(
                "scale",
                format!("is {}; a power of two from 1 to 2^24", state.scale),
            ));
        }
        ctx.check_lost()?;
        ctx.queue()
            .write_buffer(&self.buffer, 0, bytemuck::cast_slice(&state.words()));
        Ok(())
    }

    /// The state's buffer, bound by the kernels that read or update it.
    pub(crate) fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }
}
