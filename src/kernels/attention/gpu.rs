//! The GPU kernel family of the fused attention (`shaders/attention/gpu/`): query and key
//! blocks of 8-64 rows, Q/K/V tiles staged in workgroup memory, register micro-tiles of four rows
//! by a few keys or head-dim columns, and split-KV in the forward. Same API and semantics as the
//! CPU-driver kernels in the parent module; [`Context::kernel_family`] chooses.

use super::backward::{encode_gradient, Gradient, GradientKernel};
use super::bias;
use super::binding::{
    base_params, bind_block_table, bind_kv, bind_tensor, bind_view, encode_fused, encode_kernel,
    inputs_on_vec4, seq_lens_buffer, set_grid, Binding, Bound, Kernel, Params, Shared, ViewParams,
    SIMPLE_WG, VIEW_DQ, VIEW_K, VIEW_O, VIEW_Q, VIEW_V,
};
use super::call::BackwardCall;
use super::call::ForwardCall;
use super::header::with_common_typed;
use super::options::AttentionOptions;
use super::variant::{FamilyBuild, FusedKernel, FusedVariant};
use crate::device::{Context, KernelChoice, TiledShape};
use crate::error::{Error, Result};
use crate::kernels::arguments::check_binding;
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, HeadsView};
use std::sync::OnceLock;

pub(super) const FORWARD_MERGE: &str =
    include_str!("../../../shaders/attention/forward_merge.wgsl");
pub(super) const DQ_STORE: &str = include_str!("../../../shaders/attention/gpu/dq_store.wgsl");

/// Shape of the tiled forward (`attention/gpu/forward.wgsl`, the GPU family): `wg` invocations own
/// `block_m` query rows and step over tiles of `block_n` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GpuForward {
    pub wg: u32,
    pub block_m: u32,
    pub block_n: u32,
}

/// Workgroups a forward grid should have before split-KV stops paying: about four resident
/// workgroups on each of an H100's 132 SMs. Smaller GPUs are oversubscribed a little, which costs
/// only the merge.
pub(super) const SPLIT_TARGET_WORKGROUPS: usize = 528;
/// Fewest key tiles a split covers, so the partial results and their merge stay a small fraction.
pub(super) const SPLIT_MIN_TILES: usize = 4;

impl GpuForward {
    /// The first candidate (largest first) that fits the adapter's workgroup storage and width. The
    /// query block shrinks as the head dim grows so that Q and a K/V tile fit the 48 KiB NVIDIA
    /// offers (32 KiB on lavapipe) and the O micro-tile stays within 64 registers.
    pub fn choose(ctx: &Context, s: &AttentionShape, wanted: Option<TiledShape>) -> Result<Self> {
        let widest = s.head_dim_qk.max(s.head_dim_v);
        let (wg, block_m, block_n) = first_fitting(
            ctx,
            "workgroup storage of the GPU-family forward",
            Tuning::Forward,
            widest,
            wanted,
            Self::candidates(widest),
            Self::bytes(s),
        )?;
        Ok(Self {
            wg,
            block_m,
            block_n,
        })
    }

    /// Every shape of [`GpuForward::candidates`] that fits `ctx` for `s`: the autotuner's.
    pub(super) fn fitting(ctx: &Context, s: &AttentionShape) -> Vec<TiledShape> {
        let widest = s.head_dim_qk.max(s.head_dim_v);
        fitting(ctx, Self::candidates(widest), Self::bytes(s))
    }

    /// Workgroup memory of a shape `(wg, block_m, block_n)` for `s` ([`GpuForward::workgroup_bytes`]).
    fn bytes(s: &AttentionShape) -> impl Fn(u32, u32, u32) -> u32 + '_ {
        move |wg, block_m, block_n| {
            Self {
                wg,
                block_m,
                block_n,
            }
            .workgroup_bytes(s)
        }
    }

    /// The shapes the forward is written for at head dim `widest`, the measured choice first.
    fn candidates(widest: usize) -> &'static [TiledShape] {
        if widest <= 64 {
            // 256 invocations on a 64 x 32 tile first: faster than the 128-wide tile on an H200, and
            // fewer VGPRs and twice the waves on RADV (benchmarks/HISTORY.md, "Figures that code
            // comments carried"). It needs 38 KiB of workgroup storage at head dim 64,
            // so lavapipe (32 KiB) runs it only at smaller head dims.
            &[
                (256, 64, 32),
                (128, 64, 32),
                (128, 64, 16),
                (64, 32, 16),
                (32, 16, 8),
            ]
        } else if widest <= 128 {
            &[(128, 32, 32), (128, 32, 16), (64, 16, 16), (32, 16, 8)]
        } else {
            // The last fits WebGPU's default 16 KiB of workgroup storage at head dim 256.
            &[(64, 16, 16), (32, 16, 8), (16, 16, 4), (8, 8, 4)]
        }
    }

    /// Invocations sharing a row group of four query rows, keys of S and vec4 columns of O each
    /// owns.
    fn per_invocation(&self, s: &AttentionShape) -> (u32, u32, u32) {
        let tc = self.wg / (self.block_m / 4);
        let dv4 = s.head_dim_v.div_ceil(4) as u32;
        (tc, self.block_n / tc, dv4.div_ceil(tc))
    }

    /// Workgroup memory: Q, one K/V staging tile, P and the row reductions (the shader's arrays).
    fn workgroup_bytes(&self, s: &AttentionShape) -> u32 {
        let (q_stride, _) = strides(s);
        let kv_stride = q_stride.max(s.head_dim_v.div_ceil(4) as u32);
        let vec4s = self.block_m * q_stride
            + self.block_n * kv_stride
            + self.block_n * self.block_m / 4
            + self.wg;
        16 * vec4s
    }

    /// Loop iterations one invocation runs per key tile and outside the key loop, counted as if
    /// nothing were unrolled (for the loop budget of llvmpipe).
    fn loop_cost(&self, s: &AttentionShape) -> (usize, usize) {
        let (tc, sk, oc) = self.per_invocation(s);
        let (dk4, dv4) = (s.head_dim_qk.div_ceil(4), s.head_dim_v.div_ceil(4));
        let (wg, bm, bn) = (
            self.wg as usize,
            self.block_m as usize,
            self.block_n as usize,
        );
        let (tc, sk, oc) = (tc as usize, sk as usize, oc as usize);
        // Staging reads four elements per iteration (a loop of four in the element build).
        let staging = (bn * 5 * (dk4 + dv4)).div_ceil(wg) + 2;
        let per_tile = staging + dk4 * (sk + 1) + tc + 2 * sk + oc + bn * (oc + 1) + 8;
        let fixed = (bm * 5 * dk4).div_ceil(wg) + tc + 4 * oc * 5 + 32;
        (per_tile, fixed)
    }

    /// Whether the row maxima take the subgroup path: a row group must be a power-of-two run of
    /// lanes inside full subgroups.
    pub fn subgroups(&self, ctx: &Context, s: &AttentionShape) -> bool {
        let (tc, _, _) = self.per_invocation(s);
        ctx.subgroup_size().is_some_and(|size| {
            tc.is_power_of_two() && size.is_multiple_of(tc) && self.wg.is_multiple_of(size)
        })
    }

    /// Split-KV workgroups per query block: enough to fill a GPU, and as many as the loop budget
    /// needs on llvmpipe.
    pub fn splits(&self, ctx: &Context, s: &AttentionShape, wanted: Option<usize>) -> usize {
        let groups = s.q_seq.div_ceil(self.block_m as usize) * s.batch * s.heads;
        let kv_tiles = s.kv_seq.div_ceil(self.block_n as usize);
        let mut splits = 1;
        if let Some(tuned) = wanted {
            splits = tuned.min(kv_tiles).max(1);
        } else if !ctx.is_cpu() && groups < SPLIT_TARGET_WORKGROUPS {
            splits = SPLIT_TARGET_WORKGROUPS
                .div_ceil(groups)
                .min(kv_tiles / SPLIT_MIN_TILES)
                .max(1);
        }
        if let Some(budget) = ctx.loop_budget() {
            let (per_tile, fixed) = self.loop_cost(s);
            let max_tiles = ((budget as usize).saturating_sub(fixed) / per_tile).max(1);
            splits = splits.max(kv_tiles.div_ceil(max_tiles));
        }
        splits
    }
}

/// Records the GPU-family forward: the tiled kernel, and the split-KV merge when the key range is
/// split. Split partial results live in the context's scratch buffer.
pub(super) fn encode_forward_gpu(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    call: &ForwardCall<'_>,
) -> Result<()> {
    let s = &call.s;
    let config = GpuForward::choose(ctx, s, call.choice.tiles[0])?;
    let (_, sk, oc) = config.per_invocation(s);
    let subgroups = config.subgroups(ctx, s);
    let kernel = SplitForwardKernel {
        block_m: config.block_m as usize,
        splits: config.splits(ctx, s, call.choice.splits),
        key: &|input, written, vec4_inputs| {
            let mut key = FusedVariant::new(
                FusedKernel::Forward,
                FamilyBuild::Gpu {
                    subgroup_row_max: subgroups,
                },
            );
            (key.input, key.written, key.vec4_inputs) = (input, written, vec4_inputs);
            key.arrays = vec![("MAX_SK", sk), ("MAX_OC", oc)];
            key.constants = vec![
                ("WG", config.wg),
                ("BM", config.block_m),
                ("BN", config.block_n),
                ("DK", s.head_dim_qk as u32),
                ("DV", s.head_dim_v as u32),
            ];
            key
        },
    };
    encode_split_forward(ctx, encoder, &kernel, call)
}

/// A split-KV forward kernel of the GPU or tensor-core family: its query block, key splits, and its
/// key for (input type, type it writes: f32 partials when split, whether Q, K and V are read four
/// elements per access: where [`inputs_on_vec4`] holds).
pub(super) struct SplitForwardKernel<'a> {
    pub block_m: usize,
    pub splits: usize,
    pub key: &'a dyn Fn(DType, DType, bool) -> FusedVariant,
}

/// Records a split-KV forward `kernel` (the parameter block, Q/K/V, O and lse or the partial
/// results in the context's scratch buffer when split) and the merge of its splits.
pub(super) fn encode_split_forward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    kernel: &SplitForwardKernel<'_>,
    call: &ForwardCall<'_>,
) -> Result<()> {
    let ForwardCall {
        ref s,
        scale,
        q,
        k,
        v,
        out,
        lse,
        opts,
        ..
    } = *call;
    let splits = kernel.splits;
    let shared = Shared::scores(ctx, opts)?;
    let mut params = base_params(s, scale, opts);
    params.splits = splits as u32;
    let q_binding = bind_view(ctx, "q", q, VIEW_Q, &mut params)?;
    let [k_binding, v_binding] = bind_kv(ctx, [k, v], call.cache, &mut params)?;
    let vec4_inputs = inputs_on_vec4(&params, &[VIEW_Q, VIEW_K, VIEW_V], s);
    let blocks = s.q_seq.div_ceil(kernel.block_m);
    let grid = set_grid(ctx, &mut params, blocks, splits * s.batch * s.heads)?;
    let dtype = q.dtype();
    let mut pass = ctx.begin_pass(encoder, "attention_forward");
    let scratch = split_scratch(ctx, s, splits)?;
    // Split partial results stay f32 until the merge.
    let written = if scratch.is_some() { DType::F32 } else { dtype };
    let partials = scratch.as_ref().map(|scratch| scratch.bind(&mut params));
    let [o_binding, lse_binding] = match partials {
        Some(partials) => partials,
        None => [
            bind_view(ctx, "out", out, VIEW_O, &mut params)?,
            bind_tensor(ctx, "lse", lse)?,
        ],
    };
    let mut bindings = vec![q_binding, k_binding, v_binding, o_binding, lse_binding];
    bindings.extend(call.cache.table.map(|t| bind_block_table(t, &mut params)));
    let mut key = (kernel.key)(dtype, written, vec4_inputs);
    call.cache.specialise(&mut key);
    encode_fused(
        ctx,
        &mut pass,
        key,
        &params,
        Bound {
            shared,
            bindings: &bindings,
            grid,
        },
    );
    match partials {
        Some(partials) => encode_split_merge(
            ctx,
            &mut pass,
            s,
            scale,
            opts,
            (splits, partials),
            (out, lse),
        ),
        None => Ok(()),
    }
}

/// The scratch buffer holding split-KV partial results: O `[splits * B, Lq, H, Dv]` (contiguous)
/// and lse `[splits * B, H, Lq]` at `lse_offset`.
pub(super) struct SplitScratch {
    buffer: wgpu::Buffer,
    o_bytes: u64,
    lse_offset: u64,
    lse_bytes: u64,
    view: ViewParams,
}

impl SplitScratch {
    /// The partial O and lse bindings; points the kernel's O view at the partial layout.
    pub(super) fn bind(&self, params: &mut Params) -> [Binding<'_>; 2] {
        params.views[VIEW_O] = self.view;
        [
            Binding {
                buffer: &self.buffer,
                offset_bytes: 0,
                size_bytes: self.o_bytes,
            },
            Binding {
                buffer: &self.buffer,
                offset_bytes: self.lse_offset,
                size_bytes: self.lse_bytes,
            },
        ]
    }
}

/// The context's split-KV scratch for `splits` partial results of `s`, or `None` for one split (the
/// kernel then writes O and lse itself).
pub(super) fn split_scratch(
    ctx: &Context,
    s: &AttentionShape,
    splits: usize,
) -> Result<Option<SplitScratch>> {
    if splits <= 1 {
        return Ok(None);
    }
    let rows = (splits * s.batch * s.heads * s.q_seq) as u64;
    let o_bytes = rows * s.head_dim_v as u64 * 4;
    let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
    let lse_offset = o_bytes.div_ceil(align) * align;
    check_binding(ctx, "split-KV partial outputs", o_bytes)?;
    let buffer = ctx.scratch_buffer("attention split-KV partials", lse_offset + rows * 4)?;
    let row_stride = (s.heads * s.head_dim_v) as u32;
    Ok(Some(SplitScratch {
        buffer,
        o_bytes,
        lse_offset,
        lse_bytes: rows * 4,
        view: ViewParams {
            offset: 0,
            stride_b: s.q_seq as u32 * row_stride,
            stride_s: row_stride,
            stride_h: s.head_dim_v as u32,
        },
    }))
}

/// Records the merge of `splits` partial results (O and lse bindings) into `out` and `lse`, in
/// split order.
pub(super) fn encode_split_merge(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    scale: f32,
    opts: &AttentionOptions<'_>,
    (splits, [partial_o, partial_lse]): (usize, [Binding<'_>; 2]),
    (out, lse): (&HeadsView, &GpuTensor),
) -> Result<()> {
    let mut merge = base_params(s, scale, opts);
    merge.splits = splits as u32;
    let elements = s.batch * s.q_seq * s.heads * s.head_dim_v;
    let grid = set_grid(ctx, &mut merge, elements.div_ceil(SIMPLE_WG as usize), 1)?;
    let bindings = [
        partial_o,
        partial_lse,
        bind_view(ctx, "out", out, VIEW_O, &mut merge)?,
        bind_tensor(ctx, "lse", lse)?,
    ];
    encode_kernel(
        ctx,
        pass,
        Kernel {
            name: match out.dtype() {
                DType::F32 => "attention_forward_merge",
                DType::F16 => "attention_forward_merge_f16",
            },
            source: |score_bias| {
                with_common_typed(FORWARD_MERGE, DType::F32, out.dtype(), score_bias)
            },
            constants: &[("WG", SIMPLE_WG)],
        },
        &merge,
        Bound {
            shared: Shared::lens(seq_lens_buffer(ctx, opts)),
            bindings: &bindings,
            grid,
        },
    );
    Ok(())
}

/// The tiled kernels' shapes and split count can be overridden for tuning on a new GPU (benchmarks
/// only; the defaults are the measured choices): [`crate::ContextOptions::tiled_shapes`] and
/// [`crate::ContextOptions::forward_splits`] (`WGPU_ATTENTION_TILED_*` and `WGPU_ATTENTION_SPLITS`
/// through `ContextOptions::from_env`). A shape the kernel cannot take (divisibility, workgroup
/// storage, width) is logged once and ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tuning {
    Forward,
    DkDv,
    Dq,
}

impl Tuning {
    fn name(self) -> &'static str {
        match self {
            Tuning::Forward => "tiled forward",
            Tuning::DkDv => "tiled dK/dV",
            Tuning::Dq => "tiled dQ",
        }
    }

    /// Whether the kernel's register tiling divides evenly: four-row groups of the first block
    /// (`a`) spread the `wg` invocations over the second block (`b`).
    fn divides(self, wg: u32, a: u32, b: u32) -> bool {
        let groups = a / 4;
        a.is_multiple_of(4)
            && groups > 0
            && b > 0
            && wg >= groups
            && wg.is_multiple_of(groups)
            && b.is_multiple_of(wg / groups)
    }
}

/// The `(wg, a, b)` candidates whose workgroup memory (`bytes`) and width fit the adapter.
fn fitting(
    ctx: &Context,
    candidates: &[TiledShape],
    bytes: impl Fn(u32, u32, u32) -> u32,
) -> Vec<TiledShape> {
    candidates
        .iter()
        .copied()
        .filter(|&shape| fits(ctx, &bytes, shape))
        .collect()
}

/// Whether shape `(wg, a, b)`'s workgroup memory (`bytes`) and width fit the adapter.
fn fits(ctx: &Context, bytes: &impl Fn(u32, u32, u32) -> u32, (wg, a, b): TiledShape) -> bool {
    let limits = ctx.limits();
    bytes(wg, a, b) <= limits.max_compute_workgroup_storage_size
        && wg <= limits.max_compute_invocations_per_workgroup
}

/// The first `(wg, a, b)` candidate whose workgroup memory (`bytes`) and width fit the adapter,
/// after `wanted` (the context's override or the tuned shape) where it divides and fits.
fn first_fitting(
    ctx: &Context,
    what: &'static str,
    tuning: Tuning,
    widest: usize,
    wanted: Option<TiledShape>,
    candidates: &[TiledShape],
    bytes: impl Fn(u32, u32, u32) -> u32,
) -> Result<(u32, u32, u32)> {
    if let Some(shape) = wanted {
        if fits(ctx, &bytes, shape) && tuning.divides(shape.0, shape.1, shape.2) {
            return Ok(shape);
        }
        static WARNED: [OnceLock<()>; 3] = [const { OnceLock::new() }; 3];
        WARNED[tuning as usize].get_or_init(|| {
            log::warn!(
                "wgpu-attention: ignoring the {} shape {shape:?} for head dim {widest}: it does not divide or fit",
                tuning.name()
            )
        });
    }
    let fitting = candidates
        .iter()
        .copied()
        .find(|&shape| fits(ctx, &bytes, shape));
    fitting.ok_or_else(|| {
        let least = candidates
            .iter()
            .map(|&(wg, a, b)| bytes(wg, a, b))
            .min()
            .unwrap_or(0);
        Error::Unsupported {
            arg: what,
            value: u64::from(least),
            limit: u64::from(ctx.limits().max_compute_workgroup_storage_size),
            hint: " (bytes of workgroup storage at this head dim); use the CPU-driver kernels (Context::set_kernel_family) or a device with more workgroup storage",
        }
    })
}

/// Vec4 row strides of staged Q/K and dO/V tiles: odd, for conflict-free column reads.
fn strides(s: &AttentionShape) -> (u32, u32) {
    (
        s.head_dim_qk.div_ceil(4) as u32 | 1,
        s.head_dim_v.div_ceil(4) as u32 | 1,
    )
}

/// Shape of the tiled dK/dV kernel: `wg` invocations own `block_n` keys and step over tiles of
/// `block_m` query rows.
#[derive(Clone, Copy, Debug)]
pub(super) struct GpuDkDv {
    wg: u32,
    block_n: u32,
    block_m: u32,
}

impl GpuDkDv {
    /// `(wg, block_n, block_m)`.
    pub(super) fn shape(&self) -> TiledShape {
        (self.wg, self.block_n, self.block_m)
    }

    pub(super) fn choose(
        ctx: &Context,
        s: &AttentionShape,
        wanted: Option<TiledShape>,
    ) -> Result<Self> {
        let widest = s.head_dim_qk.max(s.head_dim_v);
        let (wg, block_n, block_m) = first_fitting(
            ctx,
            "workgroup storage of the GPU-family dK/dV",
            Tuning::DkDv,
            widest,
            wanted,
            Self::candidates(widest),
            Self::bytes(s),
        )?;
        Ok(Self {
            wg,
            block_n,
            block_m,
        })
    }

    /// Every shape of [`GpuDkDv::candidates`] that fits `ctx` for `s`: the autotuner's.
    pub(super) fn fitting(ctx: &Context, s: &AttentionShape) -> Vec<TiledShape> {
        let widest = s.head_dim_qk.max(s.head_dim_v);
        fitting(ctx, Self::candidates(widest), Self::bytes(s))
    }

    /// The shapes `(wg, block_n, block_m)` the kernel is written for at head dim `widest`, the
    /// measured choice first. The last of each list fits WebGPU's default 16 KiB of workgroup
    /// storage (head dims up to 128).
    fn candidates(widest: usize) -> &'static [TiledShape] {
        if widest <= 64 {
            &[(128, 32, 32), (64, 16, 32), (32, 8, 16)]
        } else if widest <= 128 {
            // (32, 8, 16) before (32, 16, 8): two keys' dK and dV rows per invocation instead of
            // four, 64 floats where 128 spilled on RDNA3 (RADV gfx1100; BENCHMARKS.md).
            &[(64, 16, 16), (32, 8, 16), (32, 16, 8), (8, 4, 8)]
        } else {
            &[(16, 8, 8), (8, 4, 8)]
        }
    }

    /// Workgroup memory of a shape: K, V, Q and dO tiles, P and dS, the rows' statistics.
    fn bytes(s: &AttentionShape) -> impl Fn(u32, u32, u32) -> u32 {
        let (ks, vs) = strides(s);
        move |_, bn, bm| 16 * (bn * (ks + vs) + bm * (ks + vs) + 2 * bm * bn / 4) + 8 * bm
    }

    /// Query rows of S^T and vec4 columns of dK and dV per invocation.
    fn per_invocation(&self, s: &AttentionShape) -> (u32, u32, u32) {
        let tq = self.wg / (self.block_n / 4);
        (
            self.block_m / tq,
            (s.head_dim_qk.div_ceil(4) as u32).div_ceil(tq),
            (s.head_dim_v.div_ceil(4) as u32).div_ceil(tq),
        )
    }

    /// Loop iterations per query row and outside the row loop (for the loop budget).
    fn loop_cost(&self, s: &AttentionShape) -> (usize, usize) {
        let (sq, ock, ocv) = self.per_invocation(s);
        let (sq, ock, ocv) = (sq as usize, ock as usize, ocv as usize);
        let (dk4, dv4) = (s.head_dim_qk.div_ceil(4), s.head_dim_v.div_ceil(4));
        let (wg, bm, bn) = (
            self.wg as usize,
            self.block_m as usize,
            self.block_n as usize,
        );
        // Staging reads four elements per iteration (a loop of four in the element build).
        let per_tile = (bm * 5 * (dk4 + dv4) + bm).div_ceil(wg)
            + 3
            + (dk4 + dv4) * (sq + 1)
            + 2 * sq
            + bm * (ock + ocv + 1)
            + 8;
        let fixed = (bn * 5 * (dk4 + dv4)).div_ceil(wg) + 5 * 4 * (ock + ocv) + 64;
        (per_tile.div_ceil(bm) + 1, fixed)
    }
}

/// Shape of the tiled dQ kernel: `wg` invocations own `block_m` query rows and step over tiles of
/// `block_n` keys.
#[derive(Clone, Copy, Debug)]
pub(super) struct GpuDq {
    wg: u32,
    block_m: u32,
    block_n: u32,
    /// Relative-table buckets whose gradient the kernel sums (0: none).
    rel_buckets: u32,
}

impl GpuDq {
    /// `(wg, block_m, block_n)`.
    pub(super) fn shape(&self) -> TiledShape {
        (self.wg, self.block_m, self.block_n)
    }

    pub(super) fn choose(
        ctx: &Context,
        s: &AttentionShape,
        rel_buckets: u32,
        wanted: Option<TiledShape>,
    ) -> Result<Self> {
        let widest = s.head_dim_qk.max(s.head_dim_v);
        let (wg, block_m, block_n) = first_fitting(
            ctx,
            "workgroup storage of the GPU-family dQ",
            Tuning::Dq,
            widest,
            wanted,
            Self::candidates(widest),
            Self::bytes(s, rel_buckets),
        )?;
        Ok(Self {
            wg,
            block_m,
            block_n,
            rel_buckets,
        })
    }

    /// Every shape of [`GpuDq::candidates`] that fits `ctx` for `s` without relative buckets: the
    /// autotuner's.
    pub(super) fn fitting(ctx: &Context, s: &AttentionShape) -> Vec<TiledShape> {
        let widest = s.head_dim_qk.max(s.head_dim_v);
        fitting(ctx, Self::candidates(widest), Self::bytes(s, 0))
    }

    /// The shapes `(wg, block_m, block_n)` the kernel is written for at head dim `widest`, the
    /// measured choice first. As for dK/dV, the last of the first two lists fits 16 KiB; (64, 16,
    /// 16) is for learned relative buckets at D <= 64 on 32 KiB (their sums take 6 KiB).
    fn candidates(widest: usize) -> &'static [TiledShape] {
        if widest <= 64 {
            &[(128, 32, 32), (128, 32, 16), (64, 16, 16), (32, 16, 8)]
        } else if widest <= 128 {
            &[(64, 16, 16), (32, 8, 16), (8, 8, 4)]
        } else {
            &[(16, 8, 8), (8, 8, 4)]
        }
    }

    /// Workgroup memory of a shape: Q, dO, K, V and dS tiles; with relative buckets, each row's
    /// bucket sums and the tile's d_score.
    fn bytes(s: &AttentionShape, rel_buckets: u32) -> impl Fn(u32, u32, u32) -> u32 {
        let (ks, vs) = strides(s);
        move |_, bm, bn| {
            let rel_sums = 4 * (bm * rel_buckets + 1);
            let rel_ds = 16 * if rel_buckets > 0 { bn * bm / 4 } else { 1 };
            16 * ((bm + bn) * (ks + vs) + bn * bm / 4) + rel_sums + rel_ds
        }
    }

    /// Keys of S and vec4 columns of dQ per invocation.
    fn per_invocation(&self, s: &AttentionShape) -> (u32, u32) {
        let tc = self.wg / (self.block_m / 4);
        (
            self.block_n / tc,
            (s.head_dim_qk.div_ceil(4) as u32).div_ceil(tc),
        )
    }

    /// Loop iterations per key and outside the key loop (for the loop budget).
    fn loop_cost(&self, s: &AttentionShape) -> (usize, usize) {
        let (sk, oc) = self.per_invocation(s);
        let (sk, oc) = (sk as usize, oc as usize);
        let (dk4, dv4) = (s.head_dim_qk.div_ceil(4), s.head_dim_v.div_ceil(4));
        let (wg, bm, bn) = (
            self.wg as usize,
            self.block_m as usize,
            self.block_n as usize,
        );
        // The owners of the rows' relative sums add each key of the tile (`rows` rows each).
        let rel = self.rel_buckets as usize;
        let rel_per_tile = if rel > 0 {
            bm.div_ceil(wg) * (bn * 12 + 1)
        } else {
            0
        };
        // Staging reads four elements per iteration (a loop of four in the element build).
        let per_tile = (bn * 5 * (dk4 + dv4)).div_ceil(wg)
            + 2
            + (dk4 + dv4) * (sk + 1)
            + 2 * sk
            + bn * (oc + 1)
            + rel_per_tile
            + 8;
        let fixed =
            (bm * 5 * (dk4 + dv4)).div_ceil(wg) + 4 + 5 * 4 * oc + 2 * (bm * rel).div_ceil(wg) + 64;
        (per_tile.div_ceil(bn) + 1, fixed)
    }
}

/// The GPU family's backward kernels (their row maxima are not the forward's).
const GPU_BACKWARD: FamilyBuild = FamilyBuild::Gpu {
    subgroup_row_max: false,
};

/// Records steps 2 and 3 of the backward with the GPU family: dK/dV over key blocks, dQ over query
/// blocks, each split into accumulating dispatches under a loop budget. `stats` holds (lse, D). A
/// call without masks or modifiers, or causal alone, runs builds with its flags fixed
/// (`FusedVariant::fixed_flags_build`).
pub(super) fn encode_backward_gpu(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    call: &BackwardCall<'_>,
) -> Result<()> {
    let (s, dtype) = (&call.s, call.dtype);
    let dims = [("DK", s.head_dim_qk as u32), ("DV", s.head_dim_v as u32)];
    let rel = bias::RelativeRows::new(ctx, s, call.opts)?;
    let dq_sums = DqSums::new(ctx, call, rel.buckets())?;
    let config = GpuDkDv::choose(ctx, s, call.choice.tiles[1])?;
    let (sq, ock, ocv) = config.per_invocation(s);
    let (per_row, fixed) = config.loop_cost(s);
    encode_gradient(
        ctx,
        encoder,
        call,
        Gradient::DkDv {
            dq_sums: dq_sums.as_ref().map(DqSums::binding),
        },
        GradientKernel {
            key: &|vec4_inputs| {
                let mut key = FusedVariant::new(FusedKernel::BackwardDkDv, GPU_BACKWARD);
                (key.input, key.written, key.vec4_inputs) = (dtype, dtype, vec4_inputs);
                key.fixed_flags_build = true;
                key.dq_sums = dq_sums.is_some();
                key.arrays = vec![("MAX_SQ", sq), ("MAX_OCK", ock), ("MAX_OCV", ocv)];
                key.constants = vec![
                    ("WG", config.wg),
                    ("BN", config.block_n),
                    ("BM", config.block_m),
                    dims[0],
                    dims[1],
                ];
                key
            },
            block: config.block_n as usize,
            cost: (per_row, fixed),
            align: config.block_m as usize,
        },
    )?;
    if let Some(sums) = &dq_sums {
        sums.encode_store(ctx, encoder, call);
        return rel.encode_sums(ctx, encoder, s, call.opts);
    }
    let config = GpuDq::choose(ctx, s, rel.constant().1, call.choice.tiles[2])?;
    let (sk, oc) = config.per_invocation(s);
    let (per_key, fixed) = config.loop_cost(s);
    encode_gradient(
        ctx,
        encoder,
        call,
        Gradient::Dq { rel: Some(&rel) },
        GradientKernel {
            key: &|vec4_inputs| {
                let mut key = FusedVariant::new(FusedKernel::BackwardDq, GPU_BACKWARD);
                (key.input, key.written, key.vec4_inputs) = (dtype, dtype, vec4_inputs);
                key.fixed_flags_build = true;
                key.arrays = vec![("MAX_SK", sk), ("MAX_OC", oc)];
                key.constants = vec![
                    ("WG", config.wg),
                    ("BM", config.block_m),
                    ("BN", config.block_n),
                    dims[0],
                    dims[1],
                    rel.constant(),
                ];
                key
            },
            block: config.block_m as usize,
            cost: (per_key, fixed),
            align: config.block_n as usize,
        },
    )?;
    rel.encode_sums(ctx, encoder, s, call.opts)
}

/// Whether the family's backward adds dQ with atomics from its dK/dV kernel: where the context
/// allows it ([`Context::atomic_gradients`]), the choice does not name the dQ kernel (the tuner's
/// `dq_atomic: Some(false)`) and that kernel has nothing else to write (no gradient of a learned
/// relative table, `relative_buckets` 0).
pub(super) fn adds_dq_atomically(
    ctx: &Context,
    choice: &KernelChoice,
    relative_buckets: u32,
) -> bool {
    ctx.atomic_gradients() && choice.dq_atomic != Some(false) && relative_buckets == 0
}

/// The f32 sums the dK/dV kernel adds dQ to with atomics (`attention/gpu/dq_sums.wgsl`), `[B, H,
/// Lq, DK]` in the context's scratch, and the store of them into the dq view, which zeroes them
/// again (`attention/gpu/dq_store.wgsl`).
pub(super) struct DqSums<'a> {
    buffer: wgpu::Buffer,
    bytes: u64,
    /// The store's parameters, dq binding and grid, checked before the backward records its first
    /// pass.
    params: Params,
    dq: Binding<'a>,
    grid: (u32, u32),
}

impl<'a> DqSums<'a> {
    /// The sums for `call` where the family adds dQ with atomics ([`adds_dq_atomically`]); `None`
    /// where the dQ kernel runs.
    pub(super) fn new(
        ctx: &'a Context,
        call: &BackwardCall<'a>,
        relative_buckets: u32,
    ) -> Result<Option<Self>> {
        if !adds_dq_atomically(ctx, &call.choice, relative_buckets) {
            return Ok(None);
        }
        let s = &call.s;
        let elements = s.batch * s.heads * s.q_seq * s.head_dim_qk;
        let bytes = elements as u64 * 4;
        check_binding(ctx, "dQ sums", bytes)?;
        let mut params = base_params(s, call.scale, call.opts);
        let dq = bind_view(ctx, "dq", call.views.dq, VIEW_DQ, &mut params)?;
        let grid = set_grid(ctx, &mut params, elements.div_ceil(SIMPLE_WG as usize), 1)?;
        Ok(Some(Self {
            buffer: ctx.scratch_buffer("attention dQ sums", bytes)?,
            bytes,
            params,
            dq,
            grid,
        }))
    }

    pub(super) fn binding(&self) -> Binding<'_> {
        Binding {
            buffer: &self.buffer,
            offset_bytes: 0,
            size_bytes: self.bytes,
        }
    }

    /// Records the store of the sums into the dq view.
    pub(super) fn encode_store(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        call: &BackwardCall<'_>,
    ) {
        let dtype = call.views.dq.dtype();
        let mut pass = ctx.begin_pass(encoder, "attention_backward_dq_store");
        encode_kernel(
            ctx,
            &mut pass,
            Kernel {
                name: match dtype {
                    DType::F32 => "attention_backward_dq_store",
                    DType::F16 => "attention_backward_dq_store_f16",
                },
                source: |score_bias| with_common_typed(DQ_STORE, DType::F32, dtype, score_bias),
                constants: &[("WG", SIMPLE_WG)],
            },
            &self.params,
            Bound {
                shared: Shared::lens(seq_lens_buffer(ctx, call.opts)),
                bindings: &[self.binding(), self.dq],
                grid: self.grid,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::Tuning;

    #[test]
    fn tuning_overrides_must_divide_the_register_tiling() {
        assert!(Tuning::Forward.divides(128, 64, 32));
        assert!(Tuning::Forward.divides(256, 64, 32));
        assert!(Tuning::DkDv.divides(64, 16, 16));
        // Rows not in groups of four, more row groups than invocations, keys not spread evenly.
        assert!(!Tuning::Forward.divides(128, 62, 32));
        assert!(!Tuning::Forward.divides(8, 64, 32));
        assert!(!Tuning::Forward.divides(128, 64, 12));
        assert!(!Tuning::Dq.divides(96, 64, 32));
        assert!(!Tuning::Forward.divides(128, 0, 32));
        assert!(!Tuning::Forward.divides(128, 64, 0));
    }
}
