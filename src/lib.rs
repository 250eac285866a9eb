//! # wgpu-attention
//!
//! Fused, tiled scaled-dot-product attention (FlashAttention-2 style), forward and backward, on any
//! GPU through wgpu: Vulkan, Metal, DX12 and GL. Every kernel is checked against the CPU reference
//! in [`reference`](mod@reference).
//!
//! ```no_run
//! use wgpu_attention::{Context, GpuTensor, AttentionOptions, attention_forward};
//! # fn main() -> Result<(), wgpu_attention::Error> {
//! let ctx = Context::new()?;
//! let (b, l, h, d) = (1, 128, 8, 64);
//! // A fused QKV projection [B, L, 3 * H * D]: Q, K and V are strided views, not copies.
//! let qkv = GpuTensor::from_slice(&ctx, &vec![0.1; b * l * 3 * h * d], &[b, l, 3 * h * d])?;
//! let (q, k, v) = (qkv.split_heads(0, h, d)?, qkv.split_heads(h * d, h, d)?, qkv.split_heads(2 * h * d, h, d)?);
//! let fwd = attention_forward(&ctx, &q, &k, &v, &AttentionOptions::new().causal(true))?;
//! let out: Vec<f32> = fwd.out.to_vec(&ctx)?; // [B, L, H, D]
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod bench;
pub mod device;
pub mod error;
pub mod kernels;
pub mod reference;
pub mod spec;
pub mod tensor;

pub use device::{
    enumerate_adapters, parse_backends, quiet_headless_start_up, AdapterReport, CandidateRecord,
    Context, ContextId, ContextOptions, GemmTiles, KernelChoice, KernelFamily, MemoryStats,
    Qualification, RecordedCounts, TiledShape, TuningBudget, TuningMode, TuningRecord,
    TuningSource, ENVIRONMENT_VARIABLES,
};
pub use error::{Error, PretrainedProblem, Result};
pub use kernels::additive::{
    additive_backward, additive_backward_into, additive_backward_unfused,
    additive_backward_workspace, additive_forward, additive_forward_into, additive_forward_unfused,
    additive_precompile, additive_probabilities, AdditiveGrads, AdditiveScores,
};
pub use kernels::attention::{
    attention_backward, attention_backward_family, attention_backward_into,
    attention_backward_plan, attention_backward_unfused, attention_backward_workspace,
    attention_bias_backward_into, attention_decode, attention_decode_f16_into,
    attention_decode_int8_into, attention_decode_into, attention_decode_paged_into,
    attention_forward, attention_forward_into, attention_forward_out_into, attention_forward_plan,
    attention_forward_unfused, attention_precompile, attention_probabilities,
    attention_probabilities_into, attention_sinks_backward_into, AttentionGrads, AttentionOptions,
    AttentionOutput, AttentionPasses, AttentionShape, BackwardPlan, BackwardViews, DecodePlan,
    ForwardPlan, ForwardViews, HalfCache, LearnedScale, QuantizedCache, RelativeBuckets, ScoreBias,
};
pub use tensor::{
    BiasView, DType, GpuTensor, GpuTensorF16, GpuTensorQ8, GpuTokens, HeadsView, PackedSide,
    SeqLens,
};

/// The README's code, compiled as doc tests (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The library guide's code (`docs/library.md`), compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/library.md")]
pub struct LibraryGuideDoctests;
