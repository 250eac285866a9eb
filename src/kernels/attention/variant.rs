//! The key of every fused attention pipeline, one place for what each compiles: the kernel (forward,
//! dQ, dK/dV), the family and its build (`shaders/attention/{cpu,gpu,coop}/`), the element types,
//! the input reads, the per-invocation array sizes, the override constants and what the call binds.
//! [`FusedVariant::source`] assembles the WGSL from whole files (no edit of source text),
//! [`FusedVariant::constants`] gives the override constants and [`FusedVariant::pipeline`] labels
//! the pipeline with the name and constants, e.g.
//! `attention_forward_gpu_subgroup_f16-WG128-BM64-BN32-DK64-DV64-VEC41`.
//!
//! Specialised by override constants: tile shapes, head dims, the relative buckets, `VEC4`,
//! `SUBGROUP`, `PACKED_VIEWS`, `SCORE_BIAS`, `PAGE` (the forward's K and V read through a paged
//! cache's block table), and `FIXED_FLAGS` for the GPU and tensor-core families' backward of a
//! call without masks or modifiers, or causal alone. Assembled from different files: the family
//! and kernel, the quad reads (CPU driver), the row maxima (GPU forward), the matrix build (tensor
//! cores), the input reads (element, vec4, or a cache's int8 or f16 words), the score-bias
//! binding, the block table. Declared as module constants: the array
//! sizes, which WGSL cannot take from overrides for arrays in functions. Everything else is a
//! uniform (`Params`): masks, windows, modifiers, scales, strides and lengths, so one pipeline
//! serves every mask and modifier. Fixing the flags by overrides instead removed code on RADV only
//! for calls with no mask at all, and ran no faster on lavapipe; on an H200 it halved the GPU
//! family's backward, unmasked and causal alike, and gained 4-5% in its forward
//! (`benchmarks/uniform-vs-override-2026-11-27/`), so that the backward alone has those builds
//! (the tensor-core family's too, by RADV's estimate).

use super::header::{with_sizes, COMMON, KV_PAGES, KV_PAGES_NONE, SCORE_BIAS, SCORE_BIAS_NONE};
use crate::device::{Context, PipelineSpec};
pub use crate::kernels::matrix::MatrixBuild;
use crate::tensor::DType;
use std::sync::Arc;

const OUTPUT_PAIR: &str = include_str!("../../../shaders/attention/output_pair.wgsl");
const INPUT_ROWS: &str = include_str!("../../../shaders/attention/input_rows.wgsl");
const INPUT_ROWS_VEC4: &str = include_str!("../../../shaders/attention/input_rows_vec4.wgsl");
const INPUT_ROWS_KV_WORDS: &str =
    include_str!("../../../shaders/attention/input_rows_kv_words.wgsl");
const DO_ROWS: &str = include_str!("../../../shaders/attention/do_rows.wgsl");
const DO_ROWS_VEC4: &str = include_str!("../../../shaders/attention/do_rows_vec4.wgsl");

const CPU_FORWARD: &str = include_str!("../../../shaders/attention/cpu/forward.wgsl");
const CPU_BACKWARD_DQ: &str = include_str!("../../../shaders/attention/cpu/backward_dq.wgsl");
const CPU_BACKWARD_DKDV: &str = include_str!("../../../shaders/attention/cpu/backward_dkdv.wgsl");
const CPU_BACKWARD_INPUTS: &str =
    include_str!("../../../shaders/attention/cpu/backward_inputs.wgsl");
const CPU_QUADS: &str = include_str!("../../../shaders/attention/cpu/quads.wgsl");
const CPU_VIEWS_KV: &str = include_str!("../../../shaders/attention/cpu/views_kv.wgsl");
const CPU_VIEWS_QDO: &str = include_str!("../../../shaders/attention/cpu/views_qdo.wgsl");
const CPU_QUADS_SUBGROUP: &str = include_str!("../../../shaders/attention/cpu/quads_subgroup.wgsl");
const CPU_QUADS_WORKGROUP: &str =
    include_str!("../../../shaders/attention/cpu/quads_workgroup.wgsl");

const GPU_FORWARD: &str = include_str!("../../../shaders/attention/gpu/forward.wgsl");
const GPU_BACKWARD_DQ: &str = include_str!("../../../shaders/attention/gpu/backward_dq.wgsl");
const GPU_KEY_PRODUCTS: &str = include_str!("../../../shaders/attention/gpu/key_products.wgsl");
const GPU_TILES: &str = include_str!("../../../shaders/attention/gpu/tiles.wgsl");
const GPU_BACKWARD_TILES: &str = include_str!("../../../shaders/attention/gpu/backward_tiles.wgsl");
const GPU_BACKWARD_DKDV: &str = include_str!("../../../shaders/attention/gpu/backward_dkdv.wgsl");
const GPU_DQ_SUMS: &str = include_str!("../../../shaders/attention/gpu/dq_sums.wgsl");
const GPU_DQ_SUMS_NONE: &str = include_str!("../../../shaders/attention/gpu/dq_sums_none.wgsl");
const GPU_ROW_MAX_SUBGROUP: &str =
    include_str!("../../../shaders/attention/gpu/row_max_subgroup.wgsl");
const GPU_ROW_MAX_WORKGROUP: &str =
    include_str!("../../../shaders/attention/gpu/row_max_workgroup.wgsl");

const COOP_SHAPE: &str = include_str!("../../../shaders/attention/coop/shape.wgsl");
const COOP_FORWARD: &str = include_str!("../../../shaders/attention/coop/forward.wgsl");
const COOP_BACKWARD_DQ: &str = include_str!("../../../shaders/attention/coop/backward_dq.wgsl");
const COOP_BACKWARD_DKDV: &str = include_str!("../../../shaders/attention/coop/backward_dkdv.wgsl");
const COOP_BACKWARD_TILES: &str =
    include_str!("../../../shaders/attention/coop/backward_tiles.wgsl");
const COOP_DQ_SUMS: &str = include_str!("../../../shaders/attention/coop/dq_sums.wgsl");
const COOP_DQ_SUMS_NONE: &str = include_str!("../../../shaders/attention/coop/dq_sums_none.wgsl");

/// The kernels of the fused attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum FusedKernel {
    /// O and lse.
    Forward,
    /// dQ over query blocks.
    BackwardDq,
    /// dK and dV over key blocks.
    BackwardDkDv,
}

/// A kernel family with the build choices that change its code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum FamilyBuild {
    /// The CPU-driver family (`cpu/`) and how it reads the quads of its staged tiles.
    Cpu(QuadReads),
    /// The GPU family (`gpu/`); the forward's row maxima by subgroup shuffles or in workgroup
    /// memory (always the latter in the backward).
    Gpu { subgroup_row_max: bool },
    /// The tensor-core family (`coop/`): the matrix build, the element type of its staged tiles,
    /// and the accumulator slots per invocation (the portable build's).
    Coop {
        build: MatrixBuild,
        tiles: DType,
        slots: u32,
    },
}

/// Everything one fused attention pipeline compiles from. Two calls with equal keys share a
/// pipeline; the label, the source and the constants all derive from the key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct FusedVariant {
    pub kernel: FusedKernel,
    pub family: FamilyBuild,
    /// Element type of Q, K, V and dO as stored.
    pub input: DType,
    /// Element type of what the kernel writes (f32 partials of a split f16 forward).
    pub written: DType,
    /// Q, K, V (and dO) read four elements per access (`input_rows_vec4.wgsl`), where every row
    /// of those views starts on a four-element boundary and the head dims are multiples of four.
    pub vec4_inputs: bool,
    /// Per-invocation array sizes, declared as module constants.
    pub arrays: Vec<(&'static str, u32)>,
    /// Override constants of the kernel's shape: tiles, head dims, relative buckets.
    pub constants: Vec<(&'static str, u32)>,
    /// Strides of packed views (`PACKED_VIEWS`): of the call, set when it is recorded.
    pub packed_views: u32,
    /// Whether the call binds a score bias or relative table (else `score_bias_none.wgsl`, one
    /// storage buffer fewer): of the call, set when it is recorded.
    pub score_bias: bool,
    /// Whether a call without masks or modifiers, or causal alone, gets a pipeline with its flags
    /// fixed (`FIXED_FLAGS`) instead of read from the uniform: the kernel's choice.
    pub fixed_flags_build: bool,
    /// The flags fixed at pipeline creation (`FIXED_FLAGS`): of the call, set when it is recorded
    /// where `fixed_flags_build` applies.
    pub fixed_flags: Option<u32>,
    /// The dK/dV kernel (GPU or tensor-core family) also adds dQ to f32 sums with atomics
    /// (`attention/{gpu,coop}/dq_sums.wgsl`; [`crate::ContextOptions::atomic_gradients`]): the
    /// call's.
    pub dq_sums: bool,
    /// Rows per block of a paged cache whose K and V the forward reads through its block table
    /// (`attention/kv_pages.wgsl`, `PAGE`, the table bound after the kernel's own bindings); 0
    /// for contiguous K and V (`attention/kv_pages_none.wgsl`): the call's.
    pub page: u32,
    /// K and V are a decoding step's cache stored in words, int8 or f16, which the forward
    /// dequantises as it stages them (`attention/input_rows_kv_words.wgsl`); `None` for values of
    /// `input`: the call's.
    pub kv_words: Option<KvWords>,
}

/// How a KV cache stored in words holds its values (`attention/input_rows_kv_words.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum KvWords {
    /// int8 rows with an f32 scale each (`KV_INT8`).
    Int8,
    /// Pairs of f16.
    F16,
}

impl KvWords {
    /// Values per 32-bit word: the kernels address such a cache in values (bytes or halves).
    pub(crate) fn per_word(self) -> u32 {
        match self {
            Self::Int8 => 4,
            Self::F16 => 2,
        }
    }
}

impl FusedVariant {
    /// A key of `kernel` in `family` with f32 inputs and outputs, element reads, no arrays or
    /// constants yet, and the call's bindings unset.
    pub fn new(kernel: FusedKernel, family: FamilyBuild) -> Self {
        Self {
            kernel,
            family,
            input: DType::F32,
            written: DType::F32,
            vec4_inputs: false,
            arrays: Vec::new(),
            constants: Vec::new(),
            packed_views: 0,
            score_bias: true,
            fixed_flags_build: false,
            fixed_flags: None,
            dq_sums: false,
            page: 0,
            kv_words: None,
        }
    }

    /// The kernel's name: op, family and the builds and types that change its code
    /// (`attention_backward_dq_gpu_f16`). A name with `subgroup` needs subgroups, one with `f16`
    /// the device's f16, one with `coop` but not `portable` cooperative matrices.
    pub fn name(&self) -> String {
        let op = match self.kernel {
            FusedKernel::Forward => "attention_forward",
            FusedKernel::BackwardDq => "attention_backward_dq",
            FusedKernel::BackwardDkDv => "attention_backward_dkdv",
        };
        let mut name = String::from(op);
        match self.family {
            FamilyBuild::Cpu(quads) => {
                name.push_str("_cpu");
                if quads == QuadReads::Subgroup {
                    name.push_str("_subgroup");
                }
            }
            FamilyBuild::Gpu { subgroup_row_max } => {
                name.push_str("_gpu");
                if subgroup_row_max {
                    name.push_str("_subgroup");
                }
            }
            FamilyBuild::Coop { build, .. } => {
                name.push_str("_coop");
                if build == MatrixBuild::Portable {
                    name.push_str("_portable");
                }
            }
        }
        if self.dq_sums {
            name.push_str("_dqsums");
        }
        if self.page > 0 {
            name.push_str("_paged");
        }
        match self.kv_words {
            Some(KvWords::Int8) => name.push_str("_kvint8"),
            Some(KvWords::F16) => name.push_str("_kvf16"),
            None => {}
        }
        if self.input == DType::F16 {
            name.push_str("_f16");
            if self.written == DType::F32 {
                name.push_str("_split");
            }
        } else if matches!(self.family, FamilyBuild::Coop { build: MatrixBuild::Portable, tiles, .. } if tiles == DType::F16)
        {
            name.push_str("_f16tiles");
        }
        name
    }

    /// The override constants: the shape's, then `SUBGROUP` (the CPU family's subgroup quads),
    /// `VEC4`, `PACKED_VIEWS` where the call has packed views, `SCORE_BIAS = 0` where it binds no
    /// score bias and `FIXED_FLAGS` where its flags are fixed.
    pub fn constants(&self) -> Vec<(&'static str, u32)> {
        let mut all = self.constants.clone();
        if let FamilyBuild::Cpu(quads) = self.family {
            all.extend(quads.constant());
        }
        all.push(("VEC4", self.vec4_inputs as u32));
        if self.packed_views != 0 {
            all.push(("PACKED_VIEWS", self.packed_views));
        }
        if !self.score_bias {
            all.push(("SCORE_BIAS", 0));
        }
        if let Some(flags) = self.fixed_flags {
            all.push(("FIXED_FLAGS", flags));
        }
        if self.page > 0 {
            all.push(("PAGE", self.page));
        }
        if self.kv_words == Some(KvWords::Int8) {
            all.push(("KV_INT8", 1));
        }
        all
    }

    /// The WGSL: enables, element types and array sizes first, then the common header, the
    /// score-bias terms, the kernel and the pieces its build takes.
    pub fn source(&self) -> String {
        let mut text = String::new();
        let coop = match self.family {
            FamilyBuild::Coop { build, tiles, .. } => Some((build, tiles)),
            _ => None,
        };
        let f16 = [Some(self.input), Some(self.written), coop.map(|(_, t)| t)]
            .contains(&Some(DType::F16));
        if f16 {
            text.push_str("enable f16;\n");
        }
        if let Some((build, _)) = coop {
            text.push_str(build.enable());
        }
        text.push_str(&format!(
            "alias InElem = {};\nalias OutElem = {};\n",
            self.input.name(),
            self.written.name()
        ));
        if let Some((_, tiles)) = coop {
            text.push_str(&format!("alias MatElem = {};\n", tiles.name()));
        }
        text.push_str(&with_sizes(&self.arrays_declared(), ""));
        let score_bias = match self.score_bias {
            true => SCORE_BIAS,
            false => SCORE_BIAS_NONE,
        };
        let (rows, do_rows) = match (self.kv_words, self.vec4_inputs) {
            (Some(_), _) => (INPUT_ROWS_KV_WORDS, DO_ROWS),
            (None, true) => (INPUT_ROWS_VEC4, DO_ROWS_VEC4),
            (None, false) => (INPUT_ROWS, DO_ROWS),
        };
        let pieces: Vec<&str> = match (self.family, self.kernel) {
            (FamilyBuild::Cpu(quads), kernel) => {
                let body = match kernel {
                    FusedKernel::Forward => CPU_FORWARD,
                    FusedKernel::BackwardDq => CPU_BACKWARD_DQ,
                    FusedKernel::BackwardDkDv => CPU_BACKWARD_DKDV,
                };
                let reads = match quads {
                    QuadReads::Workgroup => CPU_QUADS_WORKGROUP,
                    QuadReads::Subgroup => CPU_QUADS_SUBGROUP,
                };
                let mut pieces = vec![body, rows];
                if kernel != FusedKernel::Forward {
                    pieces.extend([CPU_BACKWARD_INPUTS, do_rows]);
                }
                if kernel == FusedKernel::BackwardDkDv {
                    pieces.extend([OUTPUT_PAIR, CPU_VIEWS_QDO]);
                } else {
                    pieces.push(CPU_VIEWS_KV);
                }
                pieces.extend([CPU_QUADS, reads]);
                pieces
            }
            (FamilyBuild::Gpu { subgroup_row_max }, FusedKernel::Forward) => {
                let row_max = match subgroup_row_max {
                    true => GPU_ROW_MAX_SUBGROUP,
                    false => GPU_ROW_MAX_WORKGROUP,
                };
                vec![GPU_FORWARD, GPU_TILES, GPU_KEY_PRODUCTS, rows, row_max]
            }
            // The backward's tiles go ahead of the kernel: workgroup memory is laid out in
            // declaration order, and with the tiles after dS ACO's LDS offsets cost dQ at 32-key
            // tiles 7% more instructions on RDNA (benchmarks/gpu-tiles-2026-11-27).
            (FamilyBuild::Gpu { .. }, FusedKernel::BackwardDq) => {
                vec![
                    GPU_BACKWARD_TILES,
                    GPU_BACKWARD_DQ,
                    GPU_TILES,
                    GPU_KEY_PRODUCTS,
                    rows,
                    do_rows,
                ]
            }
            (FamilyBuild::Gpu { .. }, FusedKernel::BackwardDkDv) => {
                let dq = match self.dq_sums {
                    true => GPU_DQ_SUMS,
                    false => GPU_DQ_SUMS_NONE,
                };
                vec![
                    GPU_BACKWARD_TILES,
                    GPU_BACKWARD_DKDV,
                    GPU_TILES,
                    OUTPUT_PAIR,
                    rows,
                    do_rows,
                    dq,
                ]
            }
            (FamilyBuild::Coop { build, .. }, kernel) => {
                let matrix = build.interface();
                match kernel {
                    FusedKernel::Forward => vec![COOP_SHAPE, COOP_FORWARD, matrix, rows],
                    FusedKernel::BackwardDq => vec![
                        COOP_SHAPE,
                        COOP_BACKWARD_DQ,
                        COOP_BACKWARD_TILES,
                        matrix,
                        rows,
                        do_rows,
                    ],
                    FusedKernel::BackwardDkDv => vec![
                        COOP_SHAPE,
                        COOP_BACKWARD_DKDV,
                        COOP_BACKWARD_TILES,
                        OUTPUT_PAIR,
                        matrix,
                        rows,
                        do_rows,
                        match self.dq_sums {
                            true => COOP_DQ_SUMS,
                            false => COOP_DQ_SUMS_NONE,
                        },
                    ],
                }
            }
        };
        let pages = match self.page {
            0 => KV_PAGES_NONE,
            _ => KV_PAGES,
        };
        text.push_str(COMMON);
        text.push('\n');
        text.push_str(score_bias);
        text.push('\n');
        text.push_str(pages);
        for piece in pieces {
            text.push('\n');
            text.push_str(piece);
        }
        text
    }

    /// The array sizes the source declares: the key's, and the portable matrix build's
    /// accumulator slots.
    fn arrays_declared(&self) -> Vec<(&'static str, u32)> {
        let mut arrays = self.arrays.clone();
        if let FamilyBuild::Coop {
            build: MatrixBuild::Portable,
            slots,
            ..
        } = self.family
        {
            arrays.push(("MAT_SLOTS", slots));
        }
        arrays
    }

    /// wgpu's runtime checks the kernel goes without where the context trusts its kernels: the
    /// loop counters, whose loops all end at bounds from uniforms (lengths the host checked below
    /// 2^31, chunk ranges), overrides and the workgroup id. They cost every family's kernels
    /// measurably, most the GPU family's backward (benchmarks/HISTORY.md); index clamps
    /// stay (dropping them gained nothing more). Except the GPU family's dQ on 16-key tiles at head
    /// dims up to 64 (what 32 KiB of workgroup storage picks): without counters ACO unrolls its
    /// loops past the register file and spills on gfx1100, where the checked build does not
    /// (benchmarks/HISTORY.md).
    pub fn relaxed_checks(&self) -> Option<wgpu::ShaderRuntimeChecks> {
        let constant = |wanted: &str| {
            self.constants
                .iter()
                .find(|(c, _)| *c == wanted)
                .map(|&(_, v)| v)
        };
        let dq_short_tiles = matches!(self.family, FamilyBuild::Gpu { .. })
            && self.kernel == FusedKernel::BackwardDq
            && constant("BN").is_some_and(|keys| keys < 32)
            && constant("DK").is_some_and(|dim| dim <= 64);
        if dq_short_tiles {
            return None;
        }
        let mut checks = wgpu::ShaderRuntimeChecks::checked();
        checks.force_loop_bounding = false;
        Some(checks)
    }

    /// The cached pipeline of this key on `ctx`, compiled at first use (labelled with the name and
    /// each override constant as `-NAMEvalue`), and the name.
    pub fn pipeline(&self, ctx: &Context) -> (Arc<wgpu::ComputePipeline>, String) {
        let (name, constants) = (self.name(), self.constants());
        let pipeline = ctx.compiled(PipelineSpec {
            name: name.clone(),
            sizes: &self.arrays_declared(),
            source: || self.source(),
            constants: &constants,
            relaxed_checks: self.relaxed_checks(),
        });
        (pipeline, name)
    }
}

/// The CPU-driver family's per-invocation arrays: sized for head dims up to `max_dim` (rounded up to
/// whole quads of eight) instead of [`super::shape::MAX_HEAD_DIM`], and for `relative` buckets (the dQ kernel's).
/// Real GPUs back private arrays with registers or per-thread local memory sized by the
/// declaration: 256-entry arrays cost the dK/dV kernel 16 KiB per invocation, which the NVIDIA
/// Vulkan driver fails on (device lost).
pub(super) fn cpu_family_arrays(max_dim: usize, relative: Option<u32>) -> Vec<(&'static str, u32)> {
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

    /// Quads of query rows per step of the CPU-driver dK/dV (`STEP_QUADS` in
    /// `attention/cpu/backward_dkdv.wgsl`, which says why): 4 with subgroup broadcasts, else 1.
    pub(super) fn dkdv_step_quads(self) -> u32 {
        match self {
            Self::Subgroup => 4,
            Self::Workgroup => 1,
        }
    }

    /// Quads of keys per step of the CPU-driver dQ (`STEP_QUADS` in
    /// `attention/cpu/backward_dq.wgsl`): 2 with subgroup broadcasts, else 1.
    pub(super) fn dq_step_quads(self) -> u32 {
        match self {
            Self::Subgroup => 2,
            Self::Workgroup => 1,
        }
    }
}
