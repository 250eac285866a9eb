//! Scaled dot-product attention (SPEC.md): the fused FlashAttention-2 style forward and backward in
//! three kernel families (`shaders/attention/{cpu,gpu,coop}/`) and the unfused baseline that
//! materialises the `Lq x Lk` scores (`matmul_strided.wgsl`, `shaders/attention/unfused/`).
//! CPU reference: [`crate::reference::attention`].
//!
//! Forward writes O and the row log-sum-exp `lse`; backward takes both plus dO and writes dQ, dK, dV,
//! into new tensors or into strided views of a caller's buffers (a packed dQKV projection gradient).
//!
//! One job per file: `options` (masks and score modifiers), `shape` (sizes and argument checks),
//! `binding` (uniforms, bindings, recording), `variant` (the key of every fused pipeline: its
//! source, constants and label), `forward` (the API and the CPU-driver family's forward),
//! `backward` (likewise), `gpu` and `coop` (the other two families), `unfused`, and one file per
//! score feature or variant (`bias`, `sinks`, `qk_norm`, `probs`, `decode`, `additive`). This file
//! lists the shader sources for the translation tests.

use crate::device::{grid_2d, Context, KernelFamily, StorageBinding};
use crate::error::{Error, Result};
use crate::kernels::dispatch::loop_chunks;
use crate::kernels::matmul::{encode_gemm, Elements, Epilogue, Gemm, Operand};
use crate::tensor::{BiasView, DType, GpuTensor, HeadsView, PackedSide, Region, SeqLens};

mod additive;
mod backward;
mod bias;
mod binding;
mod coop;
mod decode;
mod forward;
mod gpu;
mod options;
mod precompile;
mod probs;
mod qk_norm;
mod shape;
mod sinks;
mod unfused;
mod variant;

use crate::kernels::arguments::{
    check_binding, check_call, check_context, check_f32, check_packed_queries, check_packed_view,
    packed_lens_missing,
};
pub use crate::spec::{AttentionShape, RelativeBuckets};
pub use additive::{
    additive_backward, additive_backward_into, additive_backward_unfused,
    additive_backward_workspace, additive_decode_into, additive_forward, additive_forward_into,
    additive_forward_unfused, additive_probabilities, AdditiveGrads, AdditiveScores,
    ADDITIVE_BACKWARD_STORAGE_BUFFERS, MAX_ADDITIVE_DIM,
};
pub use backward::*;
pub use bias::attention_bias_backward_into;
pub use binding::MAX_ALIBI_SLOPES;
use binding::*;
pub use coop::{matrix_build, qualify_matrix_build, MatrixBuild};
pub use decode::{
    attention_decode, attention_decode_int8_into, attention_decode_into,
    attention_decode_paged_into, DecodePlan, PREFILL_FORWARD_ROWS,
};
pub use forward::*;
use gpu::{encode_forward_gpu, GpuForward};
pub use options::*;
pub use precompile::{additive_precompile, attention_precompile, AttentionPasses};
pub use probs::{attention_probabilities, attention_probabilities_into};
pub(crate) use shape::*;
pub use sinks::attention_sinks_backward_into;
pub use unfused::*;
use variant::{FamilyBuild, FusedKernel, FusedVariant};

const BACKWARD_PREPROCESS: &str =
    include_str!("../../../shaders/attention/backward_preprocess.wgsl");
const SOFTMAX: &str = include_str!("../../../shaders/attention/unfused/softmax.wgsl");
const SOFTMAX_BACKWARD: &str =
    include_str!("../../../shaders/attention/unfused/softmax_backward.wgsl");

/// The attention kernels' parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    let mut layouts = binding::uniform_layouts();
    layouts.extend(qk_norm::uniform_layouts());
    layouts
}

/// Largest head dimension (Dk or Dv) the fused kernels hold in registers.
pub const MAX_HEAD_DIM: usize = 256;

/// Largest head dim of the CPU-driver family's fused backward on GPU (non-CPU) adapters (the GPU family
/// takes every head dim). Its dK/dV kernel keeps four
/// keys' k, v, dK and dV rows per invocation (`16 * 2 * (Dk + Dv)` bytes): at 192 (12 KiB) the NVIDIA
/// Vulkan driver runs it, at 256 (16 KiB) it loses the device (measured on an H100, driver 580).
pub const MAX_FUSED_BACKWARD_HEAD_DIM_GPU: usize = 192;
/// Storage buffers the fused backward kernels bind in one dispatch with a score bias or relative
/// table (dK/dV: sequence lengths, score bias, Q, K, V, dO, stats, dK, dV; dQ: the same with dQ and
/// the relative table's row shares), one more than WebGPU's default limit of 8; without either,
/// one fewer ([`FUSED_BACKWARD_STORAGE_BUFFERS_WITHOUT_BIAS`]).
pub const FUSED_BACKWARD_STORAGE_BUFFERS: u32 = 9;
/// Storage buffers the fused backward kernels bind when the call has no score bias or relative
/// table: WebGPU's default limit.
pub const FUSED_BACKWARD_STORAGE_BUFFERS_WITHOUT_BIAS: u32 = 8;

/// Refuses devices created with fewer storage buffers per stage than the backward of this call binds
/// (wgpu would raise a validation error when the pipeline is created).
fn check_storage_buffer_limit(ctx: &Context, opts: &AttentionOptions<'_>) -> Result<()> {
    let have = ctx.limits().max_storage_buffers_per_shader_stage;
    let (needed, why) = match opts.bias.is_some() || opts.relative.is_some() {
        true => (
            FUSED_BACKWARD_STORAGE_BUFFERS,
            " with a score bias or relative-position table",
        ),
        false => (FUSED_BACKWARD_STORAGE_BUFFERS_WITHOUT_BIAS, ""),
    };
    if have < needed {
        return Err(Error::shape(
            "device limits",
            format!(
                "max_storage_buffers_per_shader_stage is {have}, but the fused attention backward{why} binds {needed} storage buffers per dispatch; request the adapter's limit (adapter.limits()) when creating the device"
            ),
        ));
    }
    Ok(())
}

/// Largest key tile of the forward kernel (`MAX_BN` in the shader).
const MAX_BLOCK_N: u32 = 64;

/// Every attention shader with the common header prepended, by name: what the pipelines compile and
/// what the naga tests validate and translate (with every other kernel's: [`crate::kernels::shaders`]).
/// The fused kernels by their key's name (`_vec4` added for the builds reading four elements per
/// access), with the largest array sizes their tests compile.
pub fn shader_sources() -> Vec<(String, String)> {
    [
        ("attention_forward_merge", gpu::FORWARD_MERGE),
        ("attention_backward_preprocess", BACKWARD_PREPROCESS),
        ("attention_softmax", SOFTMAX),
        ("attention_softmax_backward", SOFTMAX_BACKWARD),
        ("attention_sinks", sinks::FORWARD),
        ("attention_sinks_backward", sinks::BACKWARD),
        ("attention_bias_backward", bias::BACKWARD),
        ("attention_probs", probs::SOURCE),
        ("additive_param_grads", additive::PARAM_GRADS),
        ("additive_scores", additive::SCORES),
        ("additive_backward_unfused", additive::BACKWARD_UNFUSED),
    ]
    .into_iter()
    .map(|(name, body)| (name, with_common(body, true)))
    .chain([
        (
            "additive_backward_pack",
            with_common(
                &format!(
                    "{}\n{}",
                    additive::BACKWARD_WORKSPACE,
                    additive::BACKWARD_PACK
                ),
                true,
            ),
        ),
        ("attention_qk_norm", qk_norm::SOURCE.to_string()),
        ("attention_decode", decode::shader_source()),
        (
            "attention_forward_merge_f16",
            with_common_typed(gpu::FORWARD_MERGE, DType::F32, DType::F16, true),
        ),
        (
            "attention_backward_preprocess_f16",
            with_common_typed(BACKWARD_PREPROCESS, DType::F16, DType::F32, true),
        ),
    ])
    .chain(additive::shader_sources())
    .map(|(name, source)| (name.to_string(), source))
    .chain(fused_variants().into_iter().map(|key| {
        let vec4 = match key.vec4_inputs {
            true => "_vec4",
            false => "",
        };
        (format!("{}{vec4}", key.name()), key.source())
    }))
    .collect()
}

/// The fused kernels' builds the naga tests translate: each family's kernels in every build, dtype
/// and input read the host picks.
fn fused_variants() -> Vec<FusedVariant> {
    use DType::{F16, F32};
    use FusedKernel::{BackwardDkDv, BackwardDq, Forward};
    let mut keys = Vec::new();
    for quads in [QuadReads::Workgroup, QuadReads::Subgroup] {
        for kernel in [Forward, BackwardDq, BackwardDkDv] {
            let mut key = FusedVariant::new(kernel, FamilyBuild::Cpu(quads));
            key.arrays = cpu_family_arrays(MAX_HEAD_DIM, (kernel == BackwardDq).then_some(132));
            keys.push(key);
        }
    }
    let gpu = |kernel, subgroup_row_max, input, written, vec4_inputs| {
        let mut key = FusedVariant::new(kernel, FamilyBuild::Gpu { subgroup_row_max });
        (key.input, key.written, key.vec4_inputs) = (input, written, vec4_inputs);
        key.arrays = match kernel {
            BackwardDkDv => vec![("MAX_SQ", 4), ("MAX_OCK", 16), ("MAX_OCV", 16)],
            Forward | BackwardDq => vec![("MAX_SK", 4), ("MAX_OC", 16)],
        };
        key
    };
    for subgroups in [false, true] {
        for (input, written) in [(F32, F32), (F16, F16), (F16, F32)] {
            keys.push(gpu(Forward, subgroups, input, written, false));
        }
    }
    keys.push(gpu(Forward, false, F32, F32, true));
    keys.push(gpu(Forward, true, F16, F16, true));
    for (dtype, vec4) in [(F32, false), (F32, true), (F16, false), (F16, true)] {
        keys.push(gpu(BackwardDkDv, false, dtype, dtype, vec4));
        if !(dtype == F16 && vec4) {
            keys.push(gpu(BackwardDq, false, dtype, dtype, vec4));
        }
    }
    keys.extend(coop::shader_variants());
    keys
}

/// `body` with the common header, reading and writing f32; its score-bias terms read the binding
/// (`score_bias`) or are zero (`score_bias_none.wgsl`, for calls without a bias or relative table).
fn with_common(body: &str, score_bias: bool) -> String {
    with_common_typed(body, DType::F32, DType::F32, score_bias)
}

/// `body` with the common header, reading its inputs as `InElem` = `input` and writing its outputs as
/// `OutElem` = `output` (the typed kernels of the GPU family: f16 storage, f32 arithmetic), and its
/// score-bias terms as [`with_common`]'s.
fn with_common_typed(body: &str, input: DType, output: DType, score_bias: bool) -> String {
    let enable = match input == DType::F16 || output == DType::F16 {
        true => "enable f16;\n",
        false => "",
    };
    let (i, o) = (input.name(), output.name());
    let common = variant::COMMON;
    let terms = match score_bias {
        true => variant::SCORE_BIAS,
        false => variant::SCORE_BIAS_NONE,
    };
    format!("{enable}alias InElem = {i};\nalias OutElem = {o};\n{common}\n{terms}\n{body}")
}

/// `body` after module constants declaring `sizes` (`const NAME: u32 = value;`): how kernels size
/// their per-invocation arrays, which WGSL cannot take from override constants.
fn with_sizes(sizes: &[(&str, u32)], body: &str) -> String {
    let mut text = String::new();
    for (name, value) in sizes {
        text.push_str(&format!("const {name}: u32 = {value}u;\n"));
    }
    text.push_str(body);
    text
}

/// The CPU-driver family's per-invocation arrays: sized for head dims up to `max_dim` (rounded up to
/// whole quads of eight) instead of [`MAX_HEAD_DIM`], and for `relative` buckets (the dQ kernel's).
/// Real GPUs back private arrays with registers or per-thread local memory sized by the
/// declaration: 256-entry arrays cost the dK/dV kernel 16 KiB per invocation, which the NVIDIA
/// Vulkan driver fails on (device lost).
fn cpu_family_arrays(max_dim: usize, relative: Option<u32>) -> Vec<(&'static str, u32)> {
    let mut arrays = vec![("MAX_D", max_dim.div_ceil(8) as u32 * 8)];
    arrays.extend(relative.map(|buckets| ("MAX_REL", buckets.max(1))));
    arrays
}

/// How the CPU-driver kernels read the quads of their staged tiles (`attention/cpu/quads.wgsl`): every
/// invocation from workgroup memory, or one vec4 per lane shared by subgroup broadcasts, which
/// llvmpipe runs as register shuffles instead of a load loop per lane. Same bits either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum QuadReads {
    Workgroup,
    Subgroup,
}

/// The subgroup size the subgroup build's quad layout assumes (`SUBGROUP` in
/// `attention/cpu/quads_subgroup.wgsl`): lane l reads row l / 2, dims 4 (l % 2) .. + 3.
const QUAD_LANES: u32 = 8;

impl QuadReads {
    /// Subgroup broadcasts where the device runs subgroups of exactly eight
    /// ([`Context::subgroup_size`]: lavapipe on AVX2) and the workgroup is whole subgroups.
    pub(super) fn choose(ctx: &Context, wg: u32) -> Self {
        match ctx.subgroup_size() == Some(QUAD_LANES) && wg.is_multiple_of(QUAD_LANES) {
            true => Self::Subgroup,
            false => Self::Workgroup,
        }
    }

    /// The subgroup build's override constant (the workgroup build has none).
    pub(super) fn constant(self) -> Option<(&'static str, u32)> {
        (self == Self::Subgroup).then_some(("SUBGROUP", QUAD_LANES))
    }
}
