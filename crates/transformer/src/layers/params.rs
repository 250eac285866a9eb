//! A model's parameters and their gradients: one GPU tensor each, named, allocated once. Layers hold
//! [`ParamId`]s into a [`Params`] store, so the optimizer and checkpoints see every tensor in one
//! ordered list and the CPU model can look them up by name. [`Params::pack`] moves the values into
//! one arena buffer and the gradients into another, so the optimizer updates all of them in one
//! dispatch. Mixed precision keeps an f16 copy of each weight a Linear layer multiplies by
//! ([`Params::mark_product_weight`], [`Params::enable_half_copies`]), cast from the f32 values at
//! the start of each forward ([`Params::record_half_copies`]).

use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::elementwise::cast_f16_into;
use wgpu_attention::tensor::{zeros_in_arenas, GpuTensor, GpuTensorF16};

/// Index of a parameter in its [`Params`] store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamId(usize);

/// How a parameter starts.
#[derive(Clone, Copy, Debug)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Every element this value.
    Constant(f32),
    /// Uniform in `[-bound, bound]`.
    Uniform(f32),
}

/// Named parameters with a gradient tensor of the same shape for each.
pub struct Params {
    names: Vec<String>,
    values: Vec<GpuTensor>,
    grads: Vec<GpuTensor>,
    rng: u64,
    /// A store made by [`Params::shared`]: `add` finds existing parameters instead of adding.
    shared: bool,
    /// Values and gradients are in arenas ([`Params::pack`]).
    packed: bool,
    /// A store made by [`Params::for_inference`]: values only, zero at first, no gradients.
    inference: bool,
    /// Values start at zero whatever their [`Init`] ([`Params::zeroed`], [`Params::for_inference`]).
    zeroed: bool,
    /// The weights Linear layers multiply by ([`Params::mark_product_weight`]).
    product_weights: Vec<ParamId>,
    /// Their f16 copies, by parameter, once [`Params::enable_half_copies`] made them.
    half: Vec<Option<GpuTensorF16>>,
}

impl Params {
    /// An empty store whose uniform initialisations draw from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            names: Vec::new(),
            values: Vec::new(),
            grads: Vec::new(),
            rng: seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407),
            shared: false,
            packed: false,
            inference: false,
            zeroed: false,
            product_weights: Vec::new(),
            half: Vec::new(),
        }
    }

    /// A trainable store whose values start at zero whatever the layers ask for: weights are
    /// loaded into it right after (a published checkpoint), so nothing is drawn or uploaded.
    pub fn zeroed() -> Self {
        Self {
            zeroed: true,
            ..Self::new(0)
        }
    }

    /// A store for weights loaded from elsewhere and only run forward (decoding a published
    /// checkpoint): [`Params::add`] allocates the values zeroed (no initialisation drawn) and no
    /// gradient, halving the memory of a trainable store. Its [`Params::grad`] answers with the
    /// value: the forward passes that name a gradient (learned score terms) only read their values.
    pub fn for_inference() -> Self {
        Self {
            inference: true,
            zeroed: true,
            ..Self::new(0)
        }
    }

    /// Whether this store keeps gradients (not one made by [`Params::for_inference`]).
    pub fn has_grads(&self) -> bool {
        !self.inference
    }

    /// A store over the same tensors (the GPU buffers are shared, not copied) whose
    /// [`Params::add`] returns the existing parameter of that name and shape instead of adding one:
    /// layers built with it for other input shapes (the decoding path) use the model's parameters,
    /// and their [`ParamId`]s index this store and the original alike.
    pub fn shared(&self) -> Params {
        Params {
            names: self.names.clone(),
            values: self.values.clone(),
            grads: self.grads.clone(),
            rng: self.rng,
            shared: true,
            packed: self.packed,
            inference: self.inference,
            zeroed: self.zeroed,
            product_weights: self.product_weights.clone(),
            half: self.half.clone(),
        }
    }

    /// Adds `name` with `shape`, initialised on the host and uploaded, and a zero gradient.
    pub fn add(
        &mut self,
        ctx: &Context,
        name: impl Into<String>,
        shape: &[usize],
        init: Init,
    ) -> Result<ParamId> {
        let name = name.into();
        if self.shared {
            let id = self.find(&name).ok_or_else(|| {
                Error::shape(
                    "param",
                    format!("{name} is not a parameter of the model this store shares"),
                )
            })?;
            if self.values[id.0].shape() != shape {
                return Err(Error::shape(
                    "param",
                    format!(
                        "{name} has shape {:?} in the model, {shape:?} here",
                        self.values[id.0].shape()
                    ),
                ));
            }
            return Ok(id);
        }
        if self.names.contains(&name) {
            return Err(Error::shape("param", format!("{name} is defined twice")));
        }
        if self.zeroed {
            self.values.push(GpuTensor::zeros(ctx, shape)?);
            if !self.inference {
                self.grads.push(GpuTensor::zeros(ctx, shape)?);
            }
            self.names.push(name);
            self.packed = false;
            return Ok(ParamId(self.names.len() - 1));
        }
        let n: usize = shape.iter().product();
        let data: Vec<f32> = match init {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Constant(x) => vec![x; n],
            Init::Uniform(bound) => (0..n).map(|_| bound * self.uniform()).collect(),
        };
        self.values.push(GpuTensor::from_slice(ctx, &data, shape)?);
        self.grads.push(GpuTensor::zeros(ctx, shape)?);
        self.names.push(name);
        self.packed = false;
        Ok(ParamId(self.names.len() - 1))
    }

    /// Uniform in [-1, 1) from a 64-bit LCG: deterministic across platforms.
    fn uniform(&mut self) -> f32 {
        self.rng = self
            .rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.rng >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The parameter's values.
    pub fn value(&self, id: ParamId) -> &GpuTensor {
        &self.values[id.0]
    }

    /// The parameter's gradient (its value in a [`Params::for_inference`] store).
    pub fn grad(&self, id: ParamId) -> &GpuTensor {
        match self.inference {
            true => &self.values[id.0],
            false => &self.grads[id.0],
        }
    }

    /// Every parameter's name, in the order added.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Every parameter's values, in the order added.
    pub fn values(&self) -> &[GpuTensor] {
        &self.values
    }

    /// Every parameter's gradient, in the order added (none in a [`Params::for_inference`] store).
    pub fn grads(&self) -> &[GpuTensor] {
        &self.grads
    }

    /// How many parameter tensors there are.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Total number of parameter elements.
    pub fn elements(&self) -> usize {
        self.values.iter().map(GpuTensor::len).sum()
    }

    /// Moves the values into one arena buffer and the gradients into another, each tensor at a
    /// multiple of [`wgpu_attention::tensor::TENSOR_ALIGN`] elements (bindable on its own), so
    /// [`wgpu_attention::kernels::optimizer::AdamW`] finds them contiguous and updates every parameter in one
    /// dispatch. Contents are copied on the GPU and the per-tensor buffers freed. A new arena
    /// begins where one would exceed what the adapter can bind. Layers keep their [`ParamId`]s;
    /// call it once all parameters are added (a second call changes nothing; one after more were
    /// added packs them all again).
    pub fn pack(&mut self, ctx: &Context) -> Result<()> {
        // An inference store has no optimizer to serve and keeps its tensors where they are.
        if self.packed || self.inference {
            return Ok(());
        }
        let shapes: Vec<&[usize]> = self.values.iter().map(GpuTensor::shape).collect();
        let values = zeros_in_arenas(ctx, &shapes)?;
        let grads = zeros_in_arenas(ctx, &shapes)?;
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        for (old, new) in self
            .values
            .iter()
            .chain(&self.grads)
            .zip(values.iter().chain(&grads))
        {
            new.copy_from_into(&mut encoder, old)?;
        }
        ctx.submit(encoder)?;
        (self.values, self.grads) = (values, grads);
        self.packed = true;
        Ok(())
    }

    /// Whether [`Params::pack`] has arranged every tensor added so far.
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// Notes that a Linear layer multiplies by `id` (`[out, in]`): mixed precision keeps an f16
    /// copy of it ([`Params::enable_half_copies`]). Marking twice (a tied weight) changes nothing.
    pub fn mark_product_weight(&mut self, id: ParamId) {
        if !self.product_weights.contains(&id) {
            self.product_weights.push(id);
        }
    }

    /// Allocates an f16 copy of every weight marked by [`Params::mark_product_weight`] (for mixed
    /// precision; needs `SHADER_F16`). Their values are written by
    /// [`Params::record_half_copies`]. A second call keeps the copies it made.
    pub fn enable_half_copies(&mut self, ctx: &Context) -> Result<()> {
        self.half.resize(self.values.len(), None);
        for &id in &self.product_weights {
            if self.half[id.0].is_none() {
                self.half[id.0] = Some(GpuTensorF16::zeros(ctx, self.values[id.0].shape())?);
            }
        }
        Ok(())
    }

    /// The f16 copy of a weight, if it has one ([`Params::enable_half_copies`]).
    pub fn half(&self, id: ParamId) -> Option<&GpuTensorF16> {
        self.half.get(id.0).and_then(Option::as_ref)
    }

    /// Records the f16 copies' refresh from the f32 values: what a mixed-precision forward does
    /// first, so the copies always follow the weights (optimizer steps, checkpoint loads).
    pub fn record_half_copies(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
    ) -> Result<()> {
        for (value, half) in self.values.iter().zip(&self.half) {
            if let Some(half) = half {
                cast_f16_into(ctx, encoder, value, half)?;
            }
        }
        Ok(())
    }

    /// Index of `name`.
    pub fn find(&self, name: &str) -> Option<ParamId> {
        self.names.iter().position(|n| n == name).map(ParamId)
    }
}
