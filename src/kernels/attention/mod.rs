//! Scaled dot-product attention (SPEC.md): the fused FlashAttention-2 style forward and backward in
//! three kernel families (`shaders/attention/{cpu,gpu,coop}/`) and the unfused baseline that
//! materialises the `Lq x Lk` scores (`matmul_strided.wgsl`, `shaders/attention/unfused/`).
//! CPU reference: [`crate::reference::attention`].
//!
//! Forward writes O and the row log-sum-exp `lse`; backward takes both plus dO and writes dQ, dK,
//! dV, into new tensors or into strided views of a caller's buffers (a packed dQKV projection
//! gradient).
//!
//! One job per file: `options` (masks and score modifiers), `shape` (sizes and argument checks),
//! `binding` (uniforms, bindings, recording), `variant` (the key of every fused pipeline: its
//! source, constants and label), `forward` (the API and the CPU-driver family's forward),
//! `backward` (likewise), `gpu` and `coop` (the other two families), `unfused`, and one file per
//! score feature or variant (`bias`, `sinks`, `qk_norm`, `probs`, `decode`), and `tune` (the autotuner's keys and candidates). Additive attention,
//! which shares the masks, options and bindings, is [`crate::kernels::additive`]. This file
//! lists the shader sources for the translation tests.

mod backward;
mod bias;
pub(crate) mod binding;
pub(crate) mod call;
mod coop;
pub(crate) mod decode;
pub(crate) mod forward;
mod gpu;
pub(crate) mod header;
mod options;
mod precompile;
mod probs;
mod qk_norm;
pub(crate) mod shape;
mod sinks;
mod sources;
pub(crate) mod tune;
pub(crate) mod unfused;
mod variant;

pub use crate::spec::{AttentionShape, RelativeBuckets};
pub use backward::*;
pub use bias::attention_bias_backward_into;
pub use binding::MAX_ALIBI_SLOPES;
pub use call::{AttentionOutput, BackwardViews, ForwardViews};
pub use coop::{matrix_build, qualify_backward_build, qualify_matrix_build};
pub use decode::{
    attention_decode, attention_decode_f16_into, attention_decode_int8_into, attention_decode_into,
    attention_decode_paged_into, DecodePlan, HalfCache, QuantizedCache, PREFILL_FORWARD_ROWS,
};
pub use forward::*;
pub use options::*;
pub use precompile::{attention_precompile, AttentionPasses};
pub use probs::{attention_probabilities, attention_probabilities_into};
pub use shape::{
    FUSED_BACKWARD_STORAGE_BUFFERS, FUSED_BACKWARD_STORAGE_BUFFERS_WITHOUT_BIAS,
    MAX_FUSED_BACKWARD_HEAD_DIM_GPU, MAX_HEAD_DIM,
};
pub use sinks::attention_sinks_backward_into;
pub use sources::shader_sources;
pub use unfused::*;
pub use variant::MatrixBuild;

/// The attention kernels' parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    let mut layouts = binding::uniform_layouts();
    layouts.extend(qk_norm::uniform_layouts());
    layouts
}
