//! The unfused baselines for the benchmark (scores materialised `[B, H, Lq, Lk]`) and the
//! attention maps (`shaders/additive/scores.wgsl`).

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::attention::binding::{
    base_params, bind_tensor, bind_view, empty_rw_binding, encode_chunks, encode_kernel,
    seq_lens_buffer, set_grid, Binding, Bound, Kernel, Shared, SIMPLE_WG, VIEW_DK, VIEW_DQ, VIEW_K,
    VIEW_Q,
};
use crate::kernels::attention::call::AttentionOutput;
use crate::kernels::attention::forward::check_rows;
use crate::kernels::attention::header::with_common;
use crate::kernels::attention::shape::{check_tensor, check_view};
use crate::kernels::attention::unfused::{
    encode_pv, encode_softmax, encode_unfused_output_grads, scores_shape, UnfusedCall,
};
use crate::kernels::attention::AttentionOptions;
use crate::kernels::dispatch::loop_chunks;
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, HeadsView};

use super::backward::encode_param_grads;
use super::call::{check, AdditiveGrads, AdditiveScores};
use super::sources::{BACKWARD_UNFUSED, SCORES};

/// The unfused baseline of [`additive_forward`](super::additive_forward), for the benchmark: the scores materialised as
/// `[B, H, Lq, Lk]` (`shaders/additive/scores.wgsl`), the masked softmax and `P V` of the unfused
/// dot-product path. Submitted; O(L^2) memory.
pub fn additive_forward_unfused(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionOutput> {
    let (s, scale) = check(ctx, a, b, v, scores, opts)?;
    let probs = GpuTensor::uninit(ctx, "additive scores", &scores_shape(ctx, &s)?)?;
    let AttentionOutput { out, lse } = AttentionOutput::new(ctx, &s)?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "additive_forward_unfused");
        let call = UnfusedCall::new(ctx, &s, scale, opts);
        encode_forward_unfused(
            ctx,
            &mut pass,
            call,
            [a, b, v],
            scores,
            &probs,
            (&out.heads()?, &lse),
        )?;
    }
    ctx.submit(encoder)?;
    Ok(AttentionOutput { out, lse })
}

/// Records the unfused forward of a checked call: the probabilities into `probs` `[B, H, Lq, Lk]`
/// (and `lse`), then `out = P V`. What [`additive_forward_unfused`] runs, and the fused forward's
/// route where the tuner found the unfused path faster (`KernelChoice::unfused`).
pub(super) fn encode_forward_unfused(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    call: UnfusedCall<'_>,
    [a, b, v]: [&HeadsView; 3],
    scores: AdditiveScores<'_>,
    probs: &GpuTensor,
    (out, lse): (&HeadsView, &GpuTensor),
) -> Result<()> {
    encode_unfused_probs(ctx, pass, call, [a, b], scores, [probs, lse])?;
    encode_pv(ctx, pass, call.s, probs, v, out)
}

/// Attention maps of additive attention: the probabilities `P[b, h, i, j]` of query rows `rows`,
/// recomputed from a, b and the forward's lse with the same masks, as a new `[B, H, rows, Lk]`
/// tensor (0 where masked). See [`attention_probabilities`](crate::kernels::attention::attention_probabilities) for
/// what maps do and do not show.
pub fn additive_probabilities(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    lse: &GpuTensor,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
    rows: std::ops::Range<usize>,
) -> Result<GpuTensor> {
    // V plays no part; b stands in for it in the shape check.
    let (s, scale) = check(ctx, a, b, b, scores, opts)?;
    check_tensor("lse", lse, &[s.batch, s.heads, s.q_seq])?;
    check_rows(&rows, s.q_seq)?;
    let out = GpuTensor::uninit(
        ctx,
        "additive probabilities",
        &[s.batch, s.heads, rows.len(), s.kv_seq],
    )?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "additive_probabilities");
        let call = UnfusedCall::new(ctx, &s, scale, opts);
        encode_scores(
            ctx,
            &mut pass,
            call,
            [a, b],
            scores,
            (Some(lse), rows),
            &out,
        )?;
    }
    ctx.submit(encoder)?;
    Ok(out)
}

/// Records `shaders/additive/scores.wgsl` over query rows `rows` into `out`: the scaled scores, or
/// with `lse` the masked probabilities.
fn encode_scores(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    call: UnfusedCall<'_>,
    [a, b]: [&HeadsView; 2],
    scores: AdditiveScores<'_>,
    (lse, rows): (Option<&GpuTensor>, std::ops::Range<usize>),
    out: &GpuTensor,
) -> Result<()> {
    let UnfusedCall {
        s,
        scale,
        opts,
        lens,
    } = call;
    let elements = out.len();
    if elements > u32::MAX as usize {
        return Err(Error::Unsupported {
            arg: "additive scores (B * H * rows * Lk)",
            value: elements as u64,
            limit: u32::MAX as u64,
            hint: "; use the fused kernels, or fewer rows at a time",
        });
    }
    let mut params = base_params(s, scale, opts);
    params.chunk_begin = rows.start as u32;
    params.chunk_end = rows.end as u32;
    let dummy = Binding {
        buffer: ctx.empty_storage(),
        offset_bytes: 0,
        size_bytes: 4,
    };
    let bindings = [
        bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
        bind_view(ctx, "b", b, VIEW_K, &mut params)?,
        bind_tensor(ctx, "w", scores.w)?,
        bind_tensor(ctx, "bias", scores.bias)?,
        bind_tensor(ctx, "scores", out)?,
        match lse {
            Some(lse) => bind_tensor(ctx, "lse", lse)?,
            None => dummy,
        },
    ];
    let grid = set_grid(ctx, &mut params, elements.div_ceil(SIMPLE_WG as usize), 1)?;
    encode_kernel(
        ctx,
        pass,
        Kernel {
            name: "additive_scores",
            source: |score_bias| with_common(SCORES, score_bias),
            constants: &[("WG", SIMPLE_WG), ("PROBS", lse.is_some() as u32)],
        },
        &params,
        Bound {
            shared: Shared::lens(lens),
            bindings: &bindings,
            grid,
        },
    );
    Ok(())
}

/// The unfused paths' probabilities: every score materialised into `probs` `[B, H, Lq, Lk]`, then
/// the masked softmax in place, writing `lse`.
fn encode_unfused_probs(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    call: UnfusedCall<'_>,
    [a, b]: [&HeadsView; 2],
    scores: AdditiveScores<'_>,
    [probs, lse]: [&GpuTensor; 2],
) -> Result<()> {
    let rows = 0..call.s.q_seq;
    encode_scores(ctx, pass, call, [a, b], scores, (None, rows), probs)?;
    // The scores are already scaled.
    let scaled = UnfusedCall { scale: 1.0, ..call };
    encode_softmax(ctx, pass, scaled, probs, lse)
}

/// The unfused baseline of [`additive_backward`](super::additive_backward), for the benchmark: P recomputed and materialised
/// as `[B, H, Lq, Lk]` (the unfused forward's kernels), `dP = dO V^T` and `dV = P^T dO` as GEMMs,
/// `dS = P (dP - rowsum(P dP))` by the softmax backward, then da, db and the dw shares from dS with
/// each tanh recomputed per pair (`shaders/additive/backward_unfused.wgsl`), dw and dbias summed as
/// in the fused path. Two `[B, H, Lq, Lk]` tensors: O(L^2) memory.
pub fn additive_backward_unfused(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    d_out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AdditiveGrads> {
    let (s, scale) = check(ctx, a, b, v, scores, opts)?;
    let (bb, lq, lk, h, dda, ddv) = (
        s.batch,
        s.q_seq,
        s.kv_seq,
        s.heads,
        s.head_dim_qk,
        s.head_dim_v,
    );
    check_view("d_out", d_out, [bb, lq, h, ddv])?;
    let shape = scores_shape(ctx, &s)?;
    let scratch = UnfusedScratch {
        probs: GpuTensor::uninit(ctx, "additive probs", &shape)?,
        dprobs: GpuTensor::uninit(ctx, "additive dprobs", &shape)?,
        lse: GpuTensor::uninit(ctx, "additive lse", &[bb, h, lq])?,
        dw_rows: GpuTensor::uninit(ctx, "additive dw shares", &[h, bb, lq, dda])?,
    };
    let grads = AdditiveGrads {
        da: GpuTensor::uninit(ctx, "additive da", &[bb, lq, h, dda])?,
        db: GpuTensor::uninit(ctx, "additive db", &[bb, lk, h, dda])?,
        dv: GpuTensor::uninit(ctx, "additive dv", &[bb, lk, h, ddv])?,
        dw: GpuTensor::uninit(ctx, "additive dw", &[h, dda])?,
        dbias: GpuTensor::uninit(ctx, "additive dbias", &[h, dda])?,
    };
    let (da, db, dv) = (grads.da.heads()?, grads.db.heads()?, grads.dv.heads()?);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "additive_backward_unfused");
        let call = UnfusedCall::new(ctx, &s, scale, opts);
        encode_backward_unfused(
            ctx,
            &mut pass,
            call,
            ([a, b, v, d_out], scores),
            [&da, &db, &dv],
            [&grads.dw, &grads.dbias],
            &scratch,
        )?;
    }
    ctx.submit(encoder)?;
    Ok(grads)
}

/// The unfused backward's scratch: P and dS `[B, H, Lq, Lk]`, the recomputed lse `[B, H, Lq]` and
/// each row's share of dw `[H, B, Lq, Da]`.
pub(super) struct UnfusedScratch {
    pub probs: GpuTensor,
    pub dprobs: GpuTensor,
    pub lse: GpuTensor,
    pub dw_rows: GpuTensor,
}

/// A tensor of `shape` in the context's scratch buffer `what` (reused by the next call that asks
/// for it: this call's readers are recorded before it).
pub(super) fn scratch_tensor(
    ctx: &Context,
    what: &'static str,
    shape: &[usize],
) -> Result<GpuTensor> {
    let bytes = shape.iter().map(|&d| d as u64).product::<u64>() * 4;
    GpuTensor::from_buffer(ctx.scratch_buffer(what, bytes)?, shape)
}

impl UnfusedScratch {
    /// The scratch of the fused backward's unfused route, in the context's scratch buffers.
    pub(super) fn of_context(ctx: &Context, s: &AttentionShape) -> Result<Self> {
        let shape = scores_shape(ctx, s)?;
        let (b, h, lq) = (s.batch, s.heads, s.q_seq);
        Ok(Self {
            probs: scratch_tensor(ctx, "additive unfused probs", &shape)?,
            dprobs: scratch_tensor(ctx, "additive unfused dprobs", &shape)?,
            lse: scratch_tensor(ctx, "additive unfused lse", &[b, h, lq])?,
            dw_rows: scratch_tensor(
                ctx,
                "additive unfused dw shares",
                &[h, b, lq, s.head_dim_qk],
            )?,
        })
    }
}

/// Records the unfused backward of a checked call (see [`additive_backward_unfused`]): the
/// gradients `[da, db, dv]` (views shaped like a, b, v) and `[dw, dbias]`, through `scratch`.
pub(super) fn encode_backward_unfused(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    call: UnfusedCall<'_>,
    ([a, b, v, d_out], scores): ([&HeadsView; 4], AdditiveScores<'_>),
    [da, db, dv]: [&HeadsView; 3],
    param_grads: [&GpuTensor; 2],
    scratch: &UnfusedScratch,
) -> Result<()> {
    let UnfusedCall { s, scale, opts, .. } = call;
    let (bb, lq, lk, h, dda) = (s.batch, s.q_seq, s.kv_seq, s.heads, s.head_dim_qk);
    let UnfusedScratch {
        probs,
        dprobs,
        lse,
        dw_rows,
    } = scratch;
    encode_unfused_probs(ctx, pass, call, [a, b], scores, [probs, lse])?;
    encode_unfused_output_grads(ctx, pass, call, [probs, dprobs], [v, d_out, dv])?;
    for query_side in [true, false] {
        let mut params = base_params(s, scale, opts);
        let bindings = [
            bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
            bind_view(ctx, "b", b, VIEW_K, &mut params)?,
            bind_tensor(ctx, "w", scores.w)?,
            bind_tensor(ctx, "bias", scores.bias)?,
            bind_tensor(ctx, "dS", dprobs)?,
            match query_side {
                true => bind_view(ctx, "da", da, VIEW_DQ, &mut params)?,
                false => bind_view(ctx, "db", db, VIEW_DK, &mut params)?,
            },
            match query_side {
                true => bind_tensor(ctx, "dw shares", dw_rows)?,
                false => empty_rw_binding(ctx),
            },
        ];
        let (rows, other) = if query_side { (lq, lk) } else { (lk, lq) };
        let grid = set_grid(
            ctx,
            &mut params,
            (bb * rows * h * dda).div_ceil(SIMPLE_WG as usize),
            1,
        )?;
        let chunks = loop_chunks(ctx, other, 1, 16, 1);
        encode_chunks(
            ctx,
            pass,
            Kernel {
                name: "additive_backward_unfused",
                source: |score_bias| with_common(BACKWARD_UNFUSED, score_bias),
                constants: &[("WG", SIMPLE_WG), ("QUERY_SIDE", query_side as u32)],
            },
            &mut params,
            Bound {
                shared: Shared::lens(seq_lens_buffer(ctx, opts)),
                bindings: &bindings,
                grid,
            },
            &chunks,
        );
    }
    let dw_binding = bind_tensor(ctx, "dw shares", dw_rows)?;
    encode_param_grads(ctx, pass, s, opts, dw_binding, da, param_grads)
}
