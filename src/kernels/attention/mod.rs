//! Scaled dot-product attention (SPEC.md): the fused FlashAttention-2 style forward and backward
//! (`shaders/attention_forward.wgsl`, `attention_backward_*.wgsl`) and the unfused baseline that
//! materialises the `Lq x Lk` scores (`matmul_strided.wgsl`, `attention_softmax*.wgsl`).
//! CPU reference: [`crate::reference::attention`].
//!
//! Forward writes O and the row log-sum-exp `lse`; backward takes both plus dO and writes dQ, dK, dV,
//! into new tensors or into strided views of a caller's buffers (a packed dQKV projection gradient).
//!
//! One job per file: `options` (masks and score modifiers), `shape` (sizes and argument checks),
//! `binding` (uniforms, bindings, recording), `forward`, `backward`, `unfused`, `tiled` (the GPU
//! kernel family), and one file per score feature or variant (`bias`, `sinks`, `qk_norm`, `probs`,
//! `decode`, `additive`). This file holds the shader sources and their common header.

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
mod options;
mod precompile;
mod probs;
mod qk_norm;
mod shape;
mod sinks;
mod tiled;
mod unfused;

use crate::kernels::arguments::check_binding;
use crate::kernels::arguments::{check_call, check_context};
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
pub use options::*;
pub use precompile::{additive_precompile, attention_precompile, AttentionPasses};
pub use probs::{attention_probabilities, attention_probabilities_into};
pub(crate) use shape::*;
pub use sinks::attention_sinks_backward_into;
use tiled::{encode_forward_tiled, TiledForward};
pub use unfused::*;

const COMMON: &str = include_str!("../../../shaders/attention_common.wgsl");
const FORWARD: &str = include_str!("../../../shaders/attention_forward.wgsl");
const BACKWARD_PREPROCESS: &str =
    include_str!("../../../shaders/attention_backward_preprocess.wgsl");
const BACKWARD_DQ: &str = include_str!("../../../shaders/attention_backward_dq.wgsl");
const BACKWARD_DKDV: &str = concat!(
    include_str!("../../../shaders/attention_backward_dkdv.wgsl"),
    include_str!("../../../shaders/output_pair.wgsl")
);
const SOFTMAX: &str = include_str!("../../../shaders/attention_softmax.wgsl");
const SOFTMAX_BACKWARD: &str = include_str!("../../../shaders/attention_softmax_backward.wgsl");

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
pub fn shader_sources() -> Vec<(&'static str, String)> {
    [
        ("attention_forward_merge", tiled::FORWARD_MERGE),
        ("attention_backward_preprocess", BACKWARD_PREPROCESS),
        ("attention_softmax", SOFTMAX),
        ("attention_softmax_backward", SOFTMAX_BACKWARD),
        ("attention_sinks", sinks::FORWARD),
        ("attention_sinks_backward", sinks::BACKWARD),
        ("attention_bias_backward", bias::BACKWARD),
        ("attention_probs", probs::SOURCE),
        ("attention_decode", decode::SOURCE),
        ("additive_param_grads", additive::PARAM_GRADS),
        ("additive_scores", additive::SCORES),
        ("additive_backward_unfused", additive::BACKWARD_UNFUSED),
    ]
    .into_iter()
    .map(|(name, body)| (name, with_common(body)))
    // The CPU-driver family, with either quad build (names with "subgroup": no GLSL).
    .chain(
        [
            ("attention_forward", FORWARD, QuadReads::Workgroup),
            ("attention_forward_subgroup", FORWARD, QuadReads::Subgroup),
            ("attention_backward_dq", BACKWARD_DQ, QuadReads::Workgroup),
            (
                "attention_backward_dq_subgroup",
                BACKWARD_DQ,
                QuadReads::Subgroup,
            ),
            (
                "attention_backward_dkdv",
                BACKWARD_DKDV,
                QuadReads::Workgroup,
            ),
            (
                "attention_backward_dkdv_subgroup",
                BACKWARD_DKDV,
                QuadReads::Subgroup,
            ),
        ]
        .into_iter()
        .map(|(name, body, quads)| (name, quads.source(&with_common(body)))),
    )
    // The GPU family's backward, reading its inputs element by element or (vec4) four per access.
    .chain(
        [
            ("attention_backward_dkdv_tiled", tiled::BACKWARD_DKDV, false),
            ("attention_backward_dq_tiled", tiled::BACKWARD_DQ, false),
            (
                "attention_backward_dkdv_tiled_vec4",
                tiled::BACKWARD_DKDV,
                true,
            ),
            ("attention_backward_dq_tiled_vec4", tiled::BACKWARD_DQ, true),
        ]
        .into_iter()
        .map(|(name, body, vec4)| (name, with_common(&tiled::backward_source(body, vec4)))),
    )
    .chain([
        (
            "additive_forward",
            with_common(&additive::with_shared(additive::FORWARD)),
        ),
        (
            "additive_decode",
            with_common(&additive::with_shared(additive::DECODE)),
        ),
        (
            "additive_backward_da",
            with_common(&additive::backward_source(additive::BACKWARD_DA)),
        ),
        (
            "additive_backward_db",
            with_common(&additive::backward_source(additive::BACKWARD_DB)),
        ),
        (
            "additive_backward_pack",
            with_common(&format!(
                "{}\n{}",
                additive::BACKWARD_WORKSPACE,
                additive::BACKWARD_PACK
            )),
        ),
        ("attention_qk_norm", qk_norm::SOURCE.to_string()),
    ])
    // The tiled forward with either row-group maximum, in f32 and f16 (names with "subgroup": no
    // GLSL, wgpu's GL back end has no subgroups).
    .chain(
        [
            ("attention_forward_tiled", false, DType::F32, DType::F32),
            (
                "attention_forward_tiled_subgroup",
                true,
                DType::F32,
                DType::F32,
            ),
            ("attention_forward_tiled_f16", false, DType::F16, DType::F16),
            (
                "attention_forward_tiled_subgroup_f16",
                true,
                DType::F16,
                DType::F16,
            ),
            (
                "attention_forward_tiled_f16_split",
                false,
                DType::F16,
                DType::F32,
            ),
            (
                "attention_forward_tiled_subgroup_f16_split",
                true,
                DType::F16,
                DType::F32,
            ),
        ]
        .into_iter()
        .map(|(name, subgroups, input, output)| {
            let source = tiled::forward_source(subgroups, false);
            (name, with_common_typed(&source, input, output))
        }),
    )
    // The builds reading Q, K and V four elements per access.
    .chain(
        [
            ("attention_forward_tiled_vec4", DType::F32),
            ("attention_forward_tiled_subgroup_f16_vec4", DType::F16),
        ]
        .into_iter()
        .map(|(name, dtype)| {
            let source = tiled::forward_source(name.contains("subgroup"), true);
            (name, with_common_typed(&source, dtype, dtype))
        }),
    )
    // The f16 variants of the GPU family (names ending in _f16: no GLSL, GL has no f16).
    .chain(
        [
            (
                "attention_backward_dkdv_tiled_f16",
                tiled::BACKWARD_DKDV,
                false,
            ),
            ("attention_backward_dq_tiled_f16", tiled::BACKWARD_DQ, false),
            (
                "attention_backward_dkdv_tiled_f16_vec4",
                tiled::BACKWARD_DKDV,
                true,
            ),
        ]
        .into_iter()
        .map(|(name, body, vec4)| {
            let source = tiled::backward_source(body, vec4);
            (name, with_common_typed(&source, DType::F16, DType::F16))
        })
        .chain(coop::shader_sources())
        .chain([
            (
                "attention_forward_merge_f16",
                with_common_typed(tiled::FORWARD_MERGE, DType::F32, DType::F16),
            ),
            (
                "attention_backward_preprocess_f16",
                with_common_typed(BACKWARD_PREPROCESS, DType::F16, DType::F32),
            ),
        ]),
    )
    .collect()
}

fn with_common(body: &str) -> String {
    with_common_typed(body, DType::F32, DType::F32)
}

/// `body` with the common header, reading its inputs as `InElem` = `input` and writing its outputs as
/// `OutElem` = `output` (the typed kernels of the GPU family: f16 storage, f32 arithmetic).
fn with_common_typed(body: &str, input: DType, output: DType) -> String {
    let enable = match input == DType::F16 || output == DType::F16 {
        true => "enable f16;\n",
        false => "",
    };
    let (i, o) = (input.name(), output.name());
    format!("{enable}alias InElem = {i};\nalias OutElem = {o};\n{COMMON}\n{body}")
}

/// A CPU-driver kernel (`body`) with the common header, its per-invocation arrays sized for head
/// dims up to `max_dim` (rounded up to whole quads of eight) instead of the 256 the validated source
/// declares, and the quad reads of its staged tiles. Real GPUs back private arrays with registers
/// or per-thread local memory sized by the declaration: 256-entry arrays cost the dK/dV kernel
/// 16 KiB per invocation, which the NVIDIA Vulkan driver fails on (device lost). The pipeline key
/// holds DK, DV and the quad build, so one key always gets one source.
fn cpu_family_source(body: &str, max_dim: usize, quads: QuadReads) -> String {
    const DECLARED: &str = "const MAX_D: u32 = 256u;";
    debug_assert!(body.contains(DECLARED));
    let sized = body.replace(
        DECLARED,
        &format!("const MAX_D: u32 = {}u;", max_dim.div_ceil(8) * 8),
    );
    quads.source(&with_common(&sized))
}

const QUADS: &str = include_str!("../../../shaders/attention_quads.wgsl");
const QUADS_SUBGROUP: &str = include_str!("../../../shaders/attention_quads_subgroup.wgsl");
const QUADS_WORKGROUP: &str = include_str!("../../../shaders/attention_quads_workgroup.wgsl");

/// How the CPU-driver kernels read the quads of their staged tiles (`attention_quads.wgsl`): every
/// invocation from workgroup memory, or one vec4 per lane shared by subgroup broadcasts, which
/// llvmpipe runs as register shuffles instead of a load loop per lane. Same bits either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum QuadReads {
    Workgroup,
    Subgroup,
}

/// The subgroup size the subgroup build's quad layout assumes (`SUBGROUP` in
/// `attention_quads_subgroup.wgsl`): lane l reads row l / 2, dims 4 (l % 2) .. + 3.
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

    /// `source` with the quad reads of this build appended.
    pub(super) fn source(self, source: &str) -> String {
        let reads = match self {
            Self::Workgroup => QUADS_WORKGROUP,
            Self::Subgroup => QUADS_SUBGROUP,
        };
        format!("{source}\n{QUADS}\n{reads}")
    }

    /// `constants` with the subgroup build's key (the workgroup build adds none).
    pub(super) fn constants(self, constants: &[(&'static str, u32)]) -> Vec<(&'static str, u32)> {
        let mut all = constants.to_vec();
        if self == Self::Subgroup {
            all.push(("SUBGROUP", QUAD_LANES));
        }
        all
    }
}
