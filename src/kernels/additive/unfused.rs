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
        encode_unfused_probs(ctx, &mut pass, call, [a, b], scores, [&probs, &lse])?;
        encode_pv(ctx, &mut pass, &s, &probs, v, &out.heads()?)?;
    }
    ctx.submit(encoder)?;
    Ok(AttentionOutput { out, lse })
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
    let probs = GpuTensor::uninit(ctx, "additive probs", &shape)?;
    let dprobs = GpuTensor::uninit(ctx, "additive dprobs", &shape)?;
    let lse = GpuTensor::uninit(ctx, "additive lse", &[bb, h, lq])?;
    let dw_rows = GpuTensor::uninit(ctx, "additive dw shares", &[h, bb, lq, dda])?;
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
        encode_unfused_probs(ctx, &mut pass, call, [a, b], scores, [&probs, &lse])?;
        encode_unfused_output_grads(ctx, &mut pass, call, [&probs, &dprobs], [v, d_out, &dv])?;
        for query_side in [true, false] {
            let mut params = base_params(&s, scale, opts);
            let bindings = [
                bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
                bind_view(ctx, "b", b, VIEW_K, &mut params)?,
                bind_tensor(ctx, "w", scores.w)?,
                bind_tensor(ctx, "bias", scores.bias)?,
                bind_tensor(ctx, "dS", &dprobs)?,
                match query_side {
                    true => bind_view(ctx, "da", &da, VIEW_DQ, &mut params)?,
                    false => bind_view(ctx, "db", &db, VIEW_DK, &mut params)?,
                },
                match query_side {
                    true => bind_tensor(ctx, "dw shares", &dw_rows)?,
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
                &mut pass,
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
        let dw_binding = bind_tensor(ctx, "dw shares", &dw_rows)?;
        let param_grads = [&grads.dw, &grads.dbias];
        encode_param_grads(ctx, &mut pass, &s, opts, dw_binding, &da, param_grads)?;
    }
    ctx.submit(encoder)?;
    Ok(grads)
}
