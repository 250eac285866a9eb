//! The fused backward: gradient tensors, the entry points, the workspace, and the kernels of both
//! families after the shared preprocess.

use super::bias::attention_bias_backward_into;
use super::binding::{
    attention_grid, base_params, bind_backward_inputs, bind_output_pair, bind_tensor, bind_view,
    encode_fused_chunks, encode_kernel, inputs_on_vec4, seq_lens_buffer, set_grid, tile_rows,
    workgroup_size, Binding, Bound, Kernel, Shared, ROWS, SIMPLE_WG, VIEW_DK, VIEW_DO, VIEW_DQ,
    VIEW_DV, VIEW_K, VIEW_O, VIEW_Q, VIEW_V,
};
use super::call::{AttentionOutput, BackwardCall, BackwardViews};
use super::header::with_common_typed;
use super::options::AttentionOptions;
use super::shape::{
    allocating_f16, check_distinct, check_options, check_packed, check_storage_buffer_limit,
    check_tensor, check_view_typed, common_dtype, output_like, view_like,
    MAX_FUSED_BACKWARD_HEAD_DIM_GPU,
};
use super::sinks::attention_sinks_backward_into;
use super::tune::{self, Tuned};
use super::variant::{
    cpu_family_arrays, FamilyBuild, FusedKernel, FusedVariant, MatrixBuild, QuadReads,
};
use super::{bias, coop, gpu, qk_norm};
use crate::device::{Context, KernelChoice, KernelFamily};
use crate::error::{Error, Result};
use crate::kernels::arguments::check_f32;
use crate::kernels::dispatch::loop_chunks;
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, HeadsView, PackedSide};

pub(super) const BACKWARD_PREPROCESS: &str =
    include_str!("../../../shaders/attention/backward_preprocess.wgsl");

/// dQ, dK, dV of a backward pass, shaped like Q, K, V; `d_sinks [H]` when the options have sinks;
/// `d_bias` (shaped like the bias view) for a learnable bias; `d_relative [H, buckets]` with
/// relative buckets whose options name no destination (`relative_buckets_learned` writes there).
#[derive(Clone, Debug)]
pub struct AttentionGrads {
    /// `[B, Lq, H, Dk]` (packed `[rows, H, Dk]` where Q is: [`HeadsView::packed`]).
    pub dq: GpuTensor,
    /// `[B, Lk, Hkv, Dk]` (packed where K is), summed over the query heads of each kv head.
    pub dk: GpuTensor,
    /// `[B, Lk, Hkv, Dv]`, summed likewise.
    pub dv: GpuTensor,
    /// The sinks' gradient `[H]`, with sinks.
    pub d_sinks: Option<GpuTensor>,
    /// The bias's gradient (its view's shape, reduced over broadcast dims), with a learnable bias.
    pub d_bias: Option<GpuTensor>,
    /// The relative table's gradient `[H, buckets]`, with relative buckets.
    pub d_relative: Option<GpuTensor>,
}

/// Fused attention backward into new tensors, submitted to the queue. `out` and `lse` are the
/// forward's outputs for the same inputs and options.
pub fn attention_backward(
    ctx: &Context,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    forward: &AttentionOutput,
    d_out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionGrads> {
    let s = AttentionShape::of(q, k, v)?;
    check_f32(&[("q", q), ("k", k), ("v", v), ("d_out", d_out)]).map_err(allocating_f16)?;
    use PackedSide::{Keys, Queries};
    let (dq, dq_view) = output_like(ctx, "dq", q, Queries, [s.heads, s.head_dim_qk], opts)?;
    let (dk, dk_view) = output_like(ctx, "dk", k, Keys, [s.kv_heads, s.head_dim_qk], opts)?;
    let (dv, dv_view) = output_like(ctx, "dv", v, Keys, [s.kv_heads, s.head_dim_v], opts)?;
    let workspace = attention_backward_workspace(ctx, &s)?;
    // The relative table's gradient, unless the caller named a destination.
    let d_relative = match (opts.relative, opts.relative_grad) {
        (Some((buckets, _)), None) => Some(GpuTensor::uninit(
            ctx,
            "d_relative",
            &[s.heads, buckets.buckets],
        )?),
        _ => None,
    };
    let mut with_grad = *opts;
    if let Some(grad) = &d_relative {
        with_grad.relative_grad = Some(grad);
    }
    let opts = &with_grad;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    let out = view_like(&forward.out, q, Queries, opts)?;
    let views = BackwardViews {
        q,
        k,
        v,
        out: &out,
        lse: &forward.lse,
        d_out,
        dq: &dq_view,
        dk: &dk_view,
        dv: &dv_view,
        workspace: &workspace,
    };
    attention_backward_into(ctx, &mut encoder, &views, opts)?;
    let d_sinks = match opts.sinks {
        Some(sinks) => {
            let d_sinks = GpuTensor::uninit(ctx, "d_sinks", &[s.heads])?;
            attention_sinks_backward_into(
                ctx,
                &mut encoder,
                &s,
                sinks,
                &workspace,
                &d_sinks,
                opts,
            )?;
            Some(d_sinks)
        }
        None => None,
    };
    let d_bias = match opts.bias {
        Some(bias) if bias.learnable => {
            let grad = GpuTensor::uninit(ctx, "d_bias", &bias.view.shape())?;
            attention_bias_backward_into(ctx, &mut encoder, &views, &grad, opts)?;
            Some(grad)
        }
        _ => None,
    };
    ctx.submit(encoder)?;
    Ok(AttentionGrads {
        dq,
        dk,
        dv,
        d_sinks,
        d_bias,
        d_relative,
    })
}

/// The scratch tensor [`attention_backward_into`] needs: `(lse, D)` per query row, `[B, H, Lq, 2]`.
pub fn attention_backward_workspace(ctx: &Context, shape: &AttentionShape) -> Result<GpuTensor> {
    GpuTensor::uninit(
        ctx,
        "attention backward stats",
        &[shape.batch, shape.heads, shape.q_seq, 2],
    )
}

/// The kernel family the fused backward runs on `ctx` for `dtype` views: the context's, except that
/// f16 runs the GPU family where the context runs the CPU-driver family (whose kernels are f32
/// only). The tensor-core family's backward runs the GPU family's kernels where its own do not
/// apply (`coop::CoopBackward::choose`).
pub fn attention_backward_family(ctx: &Context, dtype: DType) -> KernelFamily {
    backward_family(ctx.kernel_family(), dtype)
}

/// The kernels the fused backward runs: family, shapes and matrix build
/// ([`attention_backward_plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackwardPlan {
    /// The kernel family of the dK/dV and dQ kernels.
    pub family: KernelFamily,
    /// dK/dV: invocations per workgroup, keys per workgroup, query rows per staged tile.
    pub dkdv: (u32, u32, u32),
    /// dQ: invocations per workgroup, query rows per workgroup, keys per staged tile.
    pub dq: (u32, u32, u32),
    /// The tensor-core family's matrix build (`None` for the other families).
    pub matrix: Option<MatrixBuild>,
    /// Whether the dK/dV kernel adds dQ with f32 atomics and no dQ kernel runs
    /// ([`crate::ContextOptions::atomic_gradients`]; `dq` is then the shape it would have had).
    pub dq_atomic: bool,
}

impl std::fmt::Display for BackwardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kw, keys, rows) = self.dkdv;
        let (qw, q_rows, q_keys) = self.dq;
        write!(f, "{} dkdv {keys}x{rows}/{kw}", self.family.name())?;
        match self.dq_atomic {
            true => write!(f, " dq atomic")?,
            false => write!(f, " dq {q_rows}x{q_keys}/{qw}")?,
        }
        if let Some(matrix) = self.matrix {
            write!(f, " {}", matrix.name())?;
        }
        Ok(())
    }
}

/// The kernels the fused backward runs for `shape` and `dtype` views on `ctx` without a mask: the
/// family ([`attention_backward_family`], and the GPU family's where the tensor-core family's
/// backward does not apply), each kernel's workgroup and tiles, and the tensor-core matrix build.
/// The context's settings, over the choice tuned for the shape where one was made (nothing is tuned
/// here). Under the tensor-core family this decides, at the first call, which build the device runs.
pub fn attention_backward_plan(
    ctx: &Context,
    shape: &AttentionShape,
    dtype: DType,
) -> Result<BackwardPlan> {
    let choice = tune::choice_so_far(ctx, Tuned::Backward, shape, dtype);
    plan_with(ctx, shape, dtype, &choice, 0)
}

/// [`attention_backward_plan`] for a call's `choice`, where dQ also writes the shares of a learned
/// relative table of `relative_grad_buckets` buckets (0: none).
fn plan_with(
    ctx: &Context,
    s: &AttentionShape,
    dtype: DType,
    choice: &KernelChoice,
    relative_grad_buckets: u32,
) -> Result<BackwardPlan> {
    let family = backward_family(choice.family_on(ctx), dtype);
    if family == KernelFamily::Coop {
        if let Some(config) = coop::CoopBackward::choose(ctx, s, relative_grad_buckets > 0)? {
            let (dkdv, dq) = config.shapes();
            return Ok(BackwardPlan {
                family,
                dkdv,
                dq,
                matrix: Some(config.build),
                dq_atomic: gpu::adds_dq_atomically(ctx, choice, 0),
            });
        }
    }
    if family != KernelFamily::CpuDriver {
        return Ok(BackwardPlan {
            family: KernelFamily::Gpu,
            dkdv: gpu::GpuDkDv::choose(ctx, s, choice.tiles[1])?.shape(),
            dq: gpu::GpuDq::choose(ctx, s, relative_grad_buckets, choice.tiles[2])?.shape(),
            matrix: None,
            dq_atomic: gpu::adds_dq_atomically(ctx, choice, relative_grad_buckets),
        });
    }
    let wg = workgroup_size(ctx, true, choice.workgroup);
    let quads = QuadReads::choose(ctx, wg);
    Ok(BackwardPlan {
        family,
        dkdv: (wg, wg * ROWS, cpu_dkdv_rows(ctx, s, quads)),
        dq: (wg, wg * ROWS, cpu_dq_keys(ctx, s, quads)),
        matrix: None,
        dq_atomic: false,
    })
}

/// Query rows per staged tile of the CPU-driver dK/dV: whole steps of its kernel where they fit.
fn cpu_dkdv_rows(ctx: &Context, s: &AttentionShape, quads: QuadReads) -> u32 {
    whole_steps(tile_rows(ctx, s, 8, 64), 4 * quads.dkdv_step_quads())
}

/// Keys per staged tile of the CPU-driver dQ: whole steps of its kernel where they fit.
fn cpu_dq_keys(ctx: &Context, s: &AttentionShape, quads: QuadReads) -> u32 {
    whole_steps(tile_rows(ctx, s, 0, 64), 4 * quads.dq_step_quads())
}

/// `rows` staged rows rounded down to whole steps of `step` rows where the tile holds one, else to
/// whole quads (at least one): a step past the tile's end reads inside it, masked
/// (attention/cpu/quads.wgsl's step_quad).
fn whole_steps(rows: u32, step: u32) -> u32 {
    if rows >= step {
        rows / step * step
    } else {
        (rows & !3).max(4)
    }
}

/// The family the fused backward runs for `dtype` views where the call chose `family`.
fn backward_family(family: KernelFamily, dtype: DType) -> KernelFamily {
    match (dtype, family) {
        (DType::F32, KernelFamily::CpuDriver) => KernelFamily::CpuDriver,
        (_, KernelFamily::Coop) => KernelFamily::Coop,
        _ => KernelFamily::Gpu,
    }
}

/// Which of the backward's two gradient kernels a pass records: dK/dV over key blocks, or dQ over
/// query blocks (with the relative table's row shares where the family's kernel writes them).
pub(super) enum Gradient<'a> {
    /// `dq_sums`: the f32 sums the GPU or tensor-core family's dK/dV kernel adds dQ to (binding
    /// 9), where it does.
    DkDv {
        dq_sums: Option<Binding<'a>>,
    },
    Dq {
        rel: Option<&'a bias::RelativeRows>,
    },
}

/// How a family runs one gradient kernel: its key (given whether the call's Q, K, V and dO are read
/// four elements per access), the keys (dK/dV) or query rows (dQ) each workgroup owns, and the loop
/// iterations per step of its long loop and outside it, with the steps' alignment (the loop
/// budget's chunks: query rows of every head of a group for dK/dV, keys for dQ).
pub(super) struct GradientKernel<'a> {
    pub key: &'a dyn Fn(bool) -> FusedVariant,
    pub block: usize,
    pub cost: (usize, usize),
    pub align: usize,
}

/// Records one gradient kernel of `call` in a pass of its own (so a profile tells the kernels
/// apart): the inputs and (lse, D) bound, dK and dV or dQ written, split into accumulating
/// dispatches under a loop budget. Every family's backward goes through here.
pub(super) fn encode_gradient(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    call: &BackwardCall<'_>,
    which: Gradient<'_>,
    kernel: GradientKernel<'_>,
) -> Result<()> {
    let (s, views) = (&call.s, &call.views);
    let name = match which {
        Gradient::DkDv { .. } => "attention_backward_dkdv",
        Gradient::Dq { .. } => "attention_backward_dq",
    };
    let mut pass = ctx.begin_pass(encoder, name);
    let mut params = base_params(s, call.scale, call.opts);
    let inputs = [views.q, views.k, views.v, views.d_out];
    let mut bindings = bind_backward_inputs(ctx, &mut params, inputs, views.workspace)?;
    let vec4_inputs = inputs_on_vec4(&params, &[VIEW_Q, VIEW_K, VIEW_V, VIEW_DO], s);
    let (blocks, entries, steps) = match which {
        Gradient::DkDv { dq_sums } => {
            let outputs = [("dk", views.dk, VIEW_DK), ("dv", views.dv, VIEW_DV)];
            bindings.extend(bind_output_pair(ctx, outputs, &mut params)?);
            bindings.extend(dq_sums);
            (
                s.kv_seq.div_ceil(kernel.block),
                s.batch * s.kv_heads,
                call.group_rows,
            )
        }
        Gradient::Dq { rel } => {
            bindings.push(bind_view(ctx, "dq", views.dq, VIEW_DQ, &mut params)?);
            bindings.extend(rel.map(|rel| rel.binding()));
            (s.q_seq.div_ceil(kernel.block), s.batch * s.heads, s.kv_seq)
        }
    };
    let grid = set_grid(ctx, &mut params, blocks, entries)?;
    let chunks = loop_chunks(ctx, steps, kernel.cost.0, kernel.cost.1, kernel.align);
    encode_fused_chunks(
        ctx,
        &mut pass,
        (kernel.key)(vec4_inputs),
        &mut params,
        Bound {
            shared: Shared::scores(ctx, call.opts)?,
            bindings: &bindings,
            grid,
        },
        &chunks,
    );
    Ok(())
}

/// Records the fused attention backward into `encoder`: the `D = rowsum(dO * O)` pass, the dK/dV
/// kernel (parallel over key blocks) and the dQ kernel (parallel over query blocks). No atomics, so
/// results are bitwise reproducible, unless the context allows them
/// ([`crate::ContextOptions::atomic_gradients`]: the dK/dV kernel then adds dQ, and no dQ kernel
/// runs). `dq`, `dk`, `dv` may be views into one packed gradient buffer.
pub fn attention_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &BackwardViews<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let &BackwardViews {
        q,
        k,
        v,
        out,
        d_out,
        dq,
        dk,
        dv,
        ..
    } = views;
    use PackedSide::{Keys, Queries};
    check_packed(
        &[
            ("q", q, Queries),
            ("k", k, Keys),
            ("v", v, Keys),
            ("out", out, Queries),
            ("d_out", d_out, Queries),
            ("dq", dq, Queries),
            ("dk", dk, Keys),
            ("dv", dv, Keys),
        ],
        opts,
    )?;
    if !qk_norm::active(opts) {
        return encode_backward_core(ctx, encoder, *views, opts, None);
    }
    // Cosine scores and key clipping: the backward of the transformed Q and K, then dQ and dK
    // through the transforms, in place (which reads Q and K: they may not share the gradients'
    // buffers).
    let s = AttentionShape::of(q, k, v)?;
    check_options(ctx, &s, opts)?;
    check_distinct(
        ctx,
        opts,
        &[("dq", dq.region()), ("dk", dk.region())],
        &[("q", q.region()), ("k", k.region())],
    )?;
    qk_norm::check_grids(ctx, [q, k], opts)?;
    let (q_used, k_used) = qk_norm::encode_inputs(ctx, encoder, q, k, opts)?;
    let transformed = BackwardViews {
        q: &q_used,
        k: &k_used,
        ..*views
    };
    encode_backward_core(ctx, encoder, transformed, opts, None)?;
    qk_norm::encode_backward(ctx, encoder, [q, k], [dq, dk], opts)
}

/// [`attention_backward_into`] of the Q and K the scores are made of, running `choice`, or the
/// context's choice for the call (tuned where the context tunes) where it is `None`.
pub(super) fn encode_backward_core(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: BackwardViews<'_>,
    opts: &AttentionOptions<'_>,
    choice: Option<KernelChoice>,
) -> Result<()> {
    let BackwardViews {
        q,
        k,
        v,
        out,
        lse,
        d_out,
        dq,
        dk,
        dv,
        workspace,
    } = views;
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(ctx, &s, opts)?;
    check_storage_buffer_limit(ctx, opts)?;
    let named = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("out", out),
        ("d_out", d_out),
        ("dq", dq),
        ("dk", dk),
        ("dv", dv),
    ];
    let dtype = common_dtype(ctx, &named, opts)?;
    check_view_typed("out", out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    check_view_typed("d_out", d_out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    check_tensor("lse", lse, &[s.batch, s.heads, s.q_seq])?;
    check_tensor("workspace", workspace, &[s.batch, s.heads, s.q_seq, 2])?;
    check_view_typed("dq", dq, [s.batch, s.q_seq, s.heads, s.head_dim_qk])?;
    check_view_typed("dk", dk, [s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk])?;
    check_view_typed("dv", dv, [s.batch, s.kv_seq, s.kv_heads, s.head_dim_v])?;
    let widest = s.head_dim_qk.max(s.head_dim_v);
    let choice = match choice {
        Some(choice) => choice,
        None => tune::call_choice(ctx, Tuned::Backward, &s, opts, dtype, [q, k])?,
    };
    let family = backward_family(choice.family_on(ctx), dtype);
    if family == KernelFamily::CpuDriver
        && !ctx.is_cpu()
        && widest > MAX_FUSED_BACKWARD_HEAD_DIM_GPU
    {
        return Err(Error::Unsupported {
            arg: "head_dim (fused backward on a GPU adapter)",
            value: widest as u64,
            limit: MAX_FUSED_BACKWARD_HEAD_DIM_GPU as u64,
            hint: "; use the GPU kernel family (Context::set_kernel_family), attention_backward_unfused, or split the head dimension",
        });
    }
    let mut inputs = vec![
        ("q", q.region()),
        ("k", k.region()),
        ("v", v.region()),
        ("out", out.region()),
        ("lse", lse.region()),
        ("d_out", d_out.region()),
    ];
    // The preprocess writes the workspace from O and dO; the gradient kernels then read it.
    check_distinct(ctx, opts, &[("workspace", workspace.region())], &inputs)?;
    inputs.push(("workspace", workspace.region()));
    check_distinct(
        ctx,
        opts,
        &[
            ("dq", dq.region()),
            ("dk", dk.region()),
            ("dv", dv.region()),
        ],
        &inputs,
    )?;

    // The dK/dV loop runs over (query head of the group, query row), flattened.
    let group_rows = (s.heads / s.kv_heads)
        .checked_mul(s.q_seq)
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or(Error::Unsupported {
            arg: "q seq * (heads / kv_heads)",
            value: ((s.heads / s.kv_heads) as u64).saturating_mul(s.q_seq as u64),
            limit: u32::MAX as u64,
            hint: "; split the sequence",
        })?;
    let lens = seq_lens_buffer(ctx, opts);
    // A score bias the kernels cannot bind is refused before anything is recorded.
    Shared::scores(ctx, opts)?;
    // So are gradient kernels with more workgroups than the device dispatches (each kernel checks
    // its own grid again as it records it): the plan is the one the family's recording takes.
    let plan = plan_with(
        ctx,
        &s,
        dtype,
        &choice,
        bias::RelativeRows::buckets_of(opts),
    )?;
    attention_grid(
        ctx,
        s.kv_seq.div_ceil(plan.dkdv.1 as usize),
        s.batch * s.kv_heads,
    )?;
    attention_grid(ctx, s.q_seq.div_ceil(plan.dq.1 as usize), s.batch * s.heads)?;
    // One pass per kernel, so a profile tells the three apart.
    // 1. stats = (lse, D).
    {
        let mut pass = ctx.begin_pass(encoder, "attention_backward_preprocess");
        let mut params = base_params(&s, scale, opts);
        let bindings = [
            bind_view(ctx, "out", out, VIEW_O, &mut params)?,
            bind_view(ctx, "d_out", d_out, VIEW_DO, &mut params)?,
            bind_tensor(ctx, "lse", lse)?,
            bind_tensor(ctx, "workspace", workspace)?,
        ];
        let rows_total = s.batch * s.heads * s.q_seq;
        let grid = set_grid(ctx, &mut params, rows_total.div_ceil(SIMPLE_WG as usize), 1)?;
        encode_kernel(
            ctx,
            &mut pass,
            Kernel {
                name: match dtype {
                    DType::F32 => "attention_backward_preprocess",
                    DType::F16 => "attention_backward_preprocess_f16",
                },
                source: |score_bias| {
                    with_common_typed(BACKWARD_PREPROCESS, dtype, DType::F32, score_bias)
                },
                constants: &[("WG", SIMPLE_WG)],
            },
            &params,
            Bound {
                shared: Shared::lens(lens),
                bindings: &bindings,
                grid,
            },
        );
    }
    let call = BackwardCall {
        s,
        scale,
        views,
        opts,
        group_rows,
        dtype,
        choice,
    };
    if family == KernelFamily::Coop {
        let relative_grad = opts.relative.is_some() && opts.relative_grad.is_some();
        if let Some(config) = coop::CoopBackward::choose(ctx, &s, relative_grad)? {
            return coop::encode_backward_coop(ctx, encoder, config, &call);
        }
    }
    if family != KernelFamily::CpuDriver {
        return gpu::encode_backward_gpu(ctx, encoder, &call);
    }
    let wg = workgroup_size(ctx, true, choice.workgroup);
    let dims = [("DK", s.head_dim_qk as u32), ("DV", s.head_dim_v as u32)];
    let quads = QuadReads::choose(ctx, wg);
    let (dk4, dv4) = (s.head_dim_qk.div_ceil(4), s.head_dim_v.div_ceil(4));
    // 2. dK, dV: one workgroup per key block of one (batch, kv head); per query row, three loops
    // over the head dimension plus the row loop itself.
    let block_m = cpu_dkdv_rows(ctx, &s, quads);
    encode_gradient(
        ctx,
        encoder,
        &call,
        Gradient::DkDv { dq_sums: None },
        GradientKernel {
            key: &|vec4_inputs| {
                let mut key = FusedVariant::new(FusedKernel::BackwardDkDv, FamilyBuild::Cpu(quads));
                key.arrays = cpu_family_arrays(s.head_dim_qk.max(s.head_dim_v), None);
                key.vec4_inputs = vec4_inputs;
                key.constants = vec![
                    ("WG", wg),
                    ("BLOCK_M", block_m),
                    ("STEP_QUADS", quads.dkdv_step_quads()),
                    dims[0],
                    dims[1],
                ];
                key
            },
            block: (wg * ROWS) as usize,
            cost: (
                2 * dk4 + dv4 + 8,
                4 * (s.head_dim_qk + s.head_dim_v) + 8 * (dk4 + dv4),
            ),
            align: block_m as usize,
        },
    )?;
    // 3. dQ: one workgroup per query block of one (batch, head); per key, three loops over the
    // head dimension plus the key loop itself.
    let rel = bias::RelativeRows::new(ctx, &s, opts)?;
    let block_n = cpu_dq_keys(ctx, &s, quads);
    encode_gradient(
        ctx,
        encoder,
        &call,
        Gradient::Dq { rel: Some(&rel) },
        GradientKernel {
            key: &|vec4_inputs| {
                let mut key = FusedVariant::new(FusedKernel::BackwardDq, FamilyBuild::Cpu(quads));
                key.vec4_inputs = vec4_inputs;
                key.arrays =
                    cpu_family_arrays(s.head_dim_qk.max(s.head_dim_v), Some(rel.buckets()));
                key.constants = vec![
                    ("WG", wg),
                    ("BLOCK_N", block_n),
                    ("STEP_QUADS", quads.dq_step_quads()),
                    dims[0],
                    dims[1],
                    rel.constant(),
                ];
                key
            },
            block: (wg * ROWS) as usize,
            cost: (
                2 * dk4 + dv4 + 8,
                4 * (2 * s.head_dim_qk + s.head_dim_v) + 8 * (dk4 + dv4),
            ),
            align: block_n as usize,
        },
    )?;
    rel.encode_sums(ctx, encoder, &s, opts)
}

// ---------------------------------------------------------------------------------------------
// Unfused baseline: scores materialised as [B, H, Lq, Lk].
