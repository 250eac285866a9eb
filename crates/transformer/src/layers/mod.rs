//! Layers: each composes ops from [`wgpu_attention::kernels`] into a forward that records into a caller's
//! command encoder and a backward that writes every parameter gradient. Activations and gradients
//! are allocated once, when a layer is built for its input shape, and reused on every call.
//! CPU counterparts live in [`crate::reference`] under the same names.

pub mod attention;
pub mod decoder;
pub mod embedding;
pub mod encoder;
pub mod feed_forward;
pub mod linear;
pub mod params;
pub mod residual;
pub mod scores;
pub mod stack;

use params::Params;
use wgpu_attention::device::Context;
use wgpu_attention::tensor::GpuTensor;

/// What a layer's forward and backward record into: the engine's context, the command encoder
/// (a whole pass goes into one submission) and the parameters the layer reads and whose gradients
/// it writes. Built with [`Recording::new`] (fields may be added).
#[non_exhaustive]
pub struct Recording<'a> {
    /// The device, its pipelines and buffers.
    pub ctx: &'a Context,
    /// Where the layer's passes are recorded.
    pub encoder: &'a mut wgpu::CommandEncoder,
    /// The parameter values and gradients.
    pub params: &'a Params,
    /// The Linear layers' products: f32, or mixed precision on the parameters' f16 copies.
    pub precision: Precision,
}

/// The arithmetic of a model's Linear layers (SPEC.md, "Mixed precision").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Precision {
    /// f32 operands, f32 accumulation: exact against the f64 reference within f32 tolerances.
    #[default]
    F32,
    /// PyTorch AMP's recipe for the products: each Linear layer multiplies the f16 copy of its f32
    /// master weight with its input or output gradient rounded to f16, accumulating in f32 (on
    /// tensor cores wherever the device's cooperative matrices qualify, unless the application
    /// chose the GEMM tiles; the adapter's GEMM elsewhere); activations, norms, softmax statistics,
    /// attention (in its family's precision), the loss, the gradients and the optimizer stay f32.
    /// Trained with dynamic loss scaling (`wgpu_attention::kernels::loss_scale`). Needs
    /// `SHADER_F16`.
    Mixed,
}

impl Precision {
    /// Its name on command lines: `f32`, `mixed`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Mixed => "mixed",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    /// Parses [`Precision::name`] (what the command-line options take).
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text {
            "f32" => Ok(Precision::F32),
            "mixed" => Ok(Precision::Mixed),
            _ => Err(format!("{text:?}: expected f32 or mixed")),
        }
    }
}

impl<'a> Recording<'a> {
    /// Records into `encoder` on `ctx`, with the parameters `params`.
    pub fn new(
        ctx: &'a Context,
        encoder: &'a mut wgpu::CommandEncoder,
        params: &'a Params,
    ) -> Self {
        Self {
            ctx,
            encoder,
            params,
            precision: Precision::F32,
        }
    }

    /// The same recording with the Linear layers' products in `precision`.
    pub fn with_precision(self, precision: Precision) -> Self {
        Self { precision, ..self }
    }
}

/// A sublayer backward's gradients at its edges: `dx = dF(dy) + residual`, with the output gradient
/// `dy`, the input gradient `dx` it writes, and what is added to it (the residual stream's
/// gradient, summed in the input-gradient GEMM instead of a pass of its own).
#[derive(Clone, Copy, Debug)]
pub struct InputGrad<'a> {
    /// The gradient at the sublayer's output.
    pub dy: &'a GpuTensor,
    /// Where the gradient at its input goes.
    pub dx: &'a GpuTensor,
    /// Added to `dx`; `None`: nothing.
    pub residual: Option<&'a GpuTensor>,
}
