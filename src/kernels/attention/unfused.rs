//! The unfused baseline: the scores materialised through the GEMM (`matmul_strided.wgsl`), the
//! softmax and its backward (`attention_softmax*.wgsl`); also a second check of the fused kernels.

use super::backward::AttentionGrads;
use super::binding::{
    base_params, bind_tensor, encode_kernel, seq_lens_buffer, set_grid, Bound, Kernel, Shared,
    SIMPLE_WG,
};
use super::call::AttentionOutput;
use super::header::with_common;
use super::options::AttentionOptions;
use super::shape::{check_options, check_view, refuse_packed};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_context, check_f32};
use crate::kernels::matmul::{encode_gemm, Elements, Epilogue, Gemm, Operand};
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, HeadsView, Region};

pub(super) const SOFTMAX: &str = include_str!("../../../shaders/attention/unfused/softmax.wgsl");
pub(super) const SOFTMAX_BACKWARD: &str =
    include_str!("../../../shaders/attention/unfused/softmax_backward.wgsl");

/// One unfused call as its steps record it (shared with additive attention's): the shape, the
/// softmax scale, the options and their sequence-lengths buffer.
#[derive(Clone, Copy)]
pub(crate) struct UnfusedCall<'a> {
    pub(crate) s: &'a AttentionShape,
    pub(crate) scale: f32,
    pub(crate) opts: &'a AttentionOptions<'a>,
    pub(crate) lens: &'a wgpu::Buffer,
}

impl<'a> UnfusedCall<'a> {
    /// The call of shape `s` and scale `scale` with `opts`, their lengths bound from the context.
    pub(crate) fn new(
        ctx: &'a Context,
        s: &'a AttentionShape,
        scale: f32,
        opts: &'a AttentionOptions<'a>,
    ) -> Self {
        Self {
            s,
            scale,
            opts,
            lens: seq_lens_buffer(ctx, opts),
        }
    }
}

/// The unfused backward's steps from P (shared with additive attention's): `dP = dO V^T` into
/// `dprobs`, `dS = P (dP - rowsum(P dP))` in place (the gradient at the scaled scores), and
/// `dV = sum_g P^T dO` over the query heads of each kv head.
pub(crate) fn encode_unfused_output_grads(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    call: UnfusedCall<'_>,
    [probs, dprobs]: [&GpuTensor; 2],
    [v, d_out, dv]: [&HeadsView; 3],
) -> Result<()> {
    let UnfusedCall { s, opts, .. } = call;
    let group = s.heads / s.kv_heads;
    let (b, h, hkv, lq, lk) = (
        s.batch as u32,
        s.heads as u32,
        s.kv_heads as u32,
        s.q_seq,
        s.kv_seq,
    );
    let (p_rows, p_t_grouped) = probs_operands(s);
    encode_gemm(
        ctx,
        pass,
        &Gemm {
            m: lq as u32,
            n: lk as u32,
            k: s.head_dim_v as u32,
            groups: 1,
            batch: b,
            heads: h,
            alpha: 1.0,
            a: (Region::whole(d_out.buffer()), view_operand(d_out, true, 1)),
            b: (Region::whole(v.buffer()), view_operand(v, false, group)),
            c: (Region::whole(dprobs.buffer()), p_rows),
            epilogue: Epilogue::NONE,
            row_sums: None,
            elements: Elements::F32,
        },
    )?;
    let mut params = base_params(s, 1.0, opts);
    let grid = set_grid(ctx, &mut params, s.batch * s.heads * lq, 1)?;
    let bindings = [
        bind_tensor(ctx, "probs", probs)?,
        bind_tensor(ctx, "dprobs", dprobs)?,
    ];
    encode_kernel(
        ctx,
        pass,
        Kernel {
            name: "attention_softmax_backward",
            source: |score_bias| with_common(SOFTMAX_BACKWARD, score_bias),
            constants: &[("WG", SIMPLE_WG)],
        },
        &params,
        Bound {
            shared: Shared::NONE,
            bindings: &bindings,
            grid,
        },
    );
    encode_gemm(
        ctx,
        pass,
        &Gemm {
            m: lk as u32,
            n: s.head_dim_v as u32,
            k: lq as u32,
            groups: group as u32,
            batch: b,
            heads: hkv,
            alpha: 1.0,
            a: (Region::whole(probs.buffer()), p_t_grouped),
            b: (Region::whole(d_out.buffer()), grouped_operand(d_out, group)),
            c: (Region::whole(dv.buffer()), view_operand(dv, true, 1)),
            epilogue: Epilogue::NONE,
            row_sums: None,
            elements: Elements::F32,
        },
    )
}

/// A BSHD view as the B operand summed over the `group` query heads of each kv head.
pub(super) fn grouped_operand(view: &HeadsView, group: usize) -> Operand {
    let mut op = view_operand(view, true, 1);
    op.stride_g = op.stride_h;
    op.stride_h *= group as u32;
    op
}

/// Operands over the `[B, H, Lq, Lk]` probabilities: P rows (queries) by columns (keys) per query
/// head, and P^T per kv head summed over the group's query heads.
pub(super) fn probs_operands(s: &AttentionShape) -> (Operand, Operand) {
    let (h, lq, lk) = (s.heads as u32, s.q_seq as u32, s.kv_seq as u32);
    let group = s.heads / s.kv_heads;
    let plane = lq * lk;
    let p_rows = Operand {
        stride_b: h * plane,
        stride_h: plane,
        head_div: 1,
        stride_row: lk,
        stride_col: 1,
        ..Default::default()
    };
    let p_t_grouped = Operand {
        stride_b: h * plane,
        stride_h: group as u32 * plane,
        head_div: 1,
        stride_g: plane,
        stride_row: 1,
        stride_col: lk,
        ..Default::default()
    };
    (p_rows, p_t_grouped)
}

pub(crate) fn scores_shape(ctx: &Context, s: &AttentionShape) -> Result<[usize; 4]> {
    let shape = [s.batch, s.heads, s.q_seq, s.kv_seq];
    let bytes = shape.iter().map(|&d| d as u64).product::<u64>() * 4;
    check_binding(ctx, "scores (unfused B x H x Lq x Lk)", bytes)?;
    Ok(shape)
}

pub(super) fn view_operand(view: &HeadsView, rows_are_seq: bool, head_div: usize) -> Operand {
    let [sb, ss, sh] = view.strides();
    let (stride_row, stride_col) = if rows_are_seq { (ss, 1) } else { (1, ss) };
    Operand {
        offset: view.offset() as u32,
        stride_b: sb as u32,
        stride_h: sh as u32,
        head_div: head_div as u32,
        stride_g: 0,
        stride_row: stride_row as u32,
        stride_col: stride_col as u32,
        _pad: 0,
    }
}

pub(super) fn check_whole_binding(
    ctx: &Context,
    arg: &'static str,
    buffer: &wgpu::Buffer,
) -> Result<()> {
    check_binding(ctx, arg, buffer.size())
}

/// Records `P = softmax(scale Q K^T + masks)` into `probs [B, H, Lq, Lk]` and the row lse.
pub(super) fn encode_probs(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    call: UnfusedCall<'_>,
    [q, k]: [&HeadsView; 2],
    probs: &GpuTensor,
    lse: &GpuTensor,
) -> Result<()> {
    let UnfusedCall { s, scale, .. } = call;
    let group = s.heads / s.kv_heads;
    let (lq, lk) = (s.q_seq, s.kv_seq);
    let scores_op = Operand {
        stride_b: (s.heads * lq * lk) as u32,
        stride_h: (lq * lk) as u32,
        head_div: 1,
        stride_row: lk as u32,
        stride_col: 1,
        ..Default::default()
    };
    encode_gemm(
        ctx,
        pass,
        &Gemm {
            m: lq as u32,
            n: lk as u32,
            k: s.head_dim_qk as u32,
            groups: 1,
            batch: s.batch as u32,
            heads: s.heads as u32,
            alpha: scale,
            a: (Region::whole(q.buffer()), view_operand(q, true, 1)),
            b: (Region::whole(k.buffer()), view_operand(k, false, group)),
            c: (Region::whole(probs.buffer()), scores_op),
            epilogue: Epilogue::NONE,
            row_sums: None,
            elements: Elements::F32,
        },
    )?;
    encode_softmax(ctx, pass, call, probs, lse)
}

/// Records the masked row softmax of materialised scores `[B, H, Lq, Lk]` in place (P), with lse.
pub(crate) fn encode_softmax(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    call: UnfusedCall<'_>,
    probs: &GpuTensor,
    lse: &GpuTensor,
) -> Result<()> {
    let UnfusedCall {
        s,
        scale,
        opts,
        lens,
    } = call;
    let mut params = base_params(s, scale, opts);
    let rows = s.batch * s.heads * s.q_seq;
    let grid = set_grid(ctx, &mut params, rows, 1)?;
    let bindings = [
        bind_tensor(ctx, "scores", probs)?,
        bind_tensor(ctx, "lse", lse)?,
    ];
    encode_kernel(
        ctx,
        pass,
        Kernel {
            name: "attention_softmax",
            source: |score_bias| with_common(SOFTMAX, score_bias),
            constants: &[("WG", SIMPLE_WG)],
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

/// Records `out = P V` for materialised probabilities `[B, H, Lq, Lk]`.
pub(crate) fn encode_pv(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    probs: &GpuTensor,
    v: &HeadsView,
    out: &HeadsView,
) -> Result<()> {
    let group = s.heads / s.kv_heads;
    let (lq, lk) = (s.q_seq, s.kv_seq);
    encode_gemm(
        ctx,
        pass,
        &Gemm {
            m: lq as u32,
            n: s.head_dim_v as u32,
            k: lk as u32,
            groups: 1,
            batch: s.batch as u32,
            heads: s.heads as u32,
            alpha: 1.0,
            a: (
                Region::whole(probs.buffer()),
                Operand {
                    stride_b: (s.heads * lq * lk) as u32,
                    stride_h: (lq * lk) as u32,
                    head_div: 1,
                    stride_row: lk as u32,
                    stride_col: 1,
                    ..Default::default()
                },
            ),
            b: (Region::whole(v.buffer()), view_operand(v, true, group)),
            c: (Region::whole(out.buffer()), view_operand(out, true, 1)),
            epilogue: Epilogue::NONE,
            row_sums: None,
            elements: Elements::F32,
        },
    )
}

pub(super) fn unfused_checks(ctx: &Context, views: &[(&'static str, &HeadsView)]) -> Result<()> {
    check_f32(views)?;
    let regions: Vec<_> = views.iter().map(|(arg, v)| (*arg, v.region())).collect();
    check_context(ctx, &regions)?;
    for (arg, v) in views {
        check_whole_binding(ctx, arg, v.buffer())?;
        if v.end_element() > u32::MAX as usize {
            return Err(Error::Unsupported {
                arg,
                value: v.end_element() as u64,
                limit: u32::MAX as u64,
                hint: " elements",
            });
        }
    }
    Ok(())
}

/// Unfused attention forward (benchmark baseline and second check): materialises the scores
/// `[B, H, Lq, Lk]`, applies a masked softmax, then multiplies by V. Same semantics and outputs as
/// [`attention_forward`](super::attention_forward).
pub fn attention_forward_unfused(
    ctx: &Context,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionOutput> {
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(ctx, &s, opts)?;
    unfused_modifier_check(opts)?;
    refuse_packed(&[("q", q), ("k", k), ("v", v)], "the unfused attention")?;
    unfused_checks(ctx, &[("q", q), ("k", k), ("v", v)])?;
    let probs = GpuTensor::uninit(ctx, "probs", &scores_shape(ctx, &s)?)?;
    let AttentionOutput { out, lse } = AttentionOutput::new(ctx, &s)?;
    check_whole_binding(ctx, "out", out.buffer())?;
    let call = UnfusedCall::new(ctx, &s, scale, opts);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "attention_forward_unfused");
        encode_probs(ctx, &mut pass, call, [q, k], &probs, &lse)?;
        encode_pv(ctx, &mut pass, &s, &probs, v, &out.heads()?)?;
    }
    ctx.submit(encoder)?;
    Ok(AttentionOutput { out, lse })
}

/// The unfused baseline has masks but no score modifiers.
pub(super) fn unfused_modifier_check(opts: &AttentionOptions<'_>) -> Result<()> {
    if opts.has_score_modifier() {
        return Err(Error::shape(
            "softcap/alibi/sinks/cosine/key_norm_clip/bias/relative_buckets",
            "the unfused path has no score modifiers; use attention_forward / attention_backward",
        ));
    }
    Ok(())
}

/// Unfused attention backward (benchmark baseline): recomputes and materialises P `[B, H, Lq, Lk]`,
/// then dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO,
/// with dK and dV summed over the query heads of each kv head.
pub fn attention_backward_unfused(
    ctx: &Context,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    d_out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionGrads> {
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(ctx, &s, opts)?;
    unfused_modifier_check(opts)?;
    refuse_packed(&[("q", q), ("k", k), ("v", v)], "the unfused attention")?;
    check_view("d_out", d_out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    unfused_checks(ctx, &[("q", q), ("k", k), ("v", v), ("d_out", d_out)])?;
    let shape = scores_shape(ctx, &s)?;
    let probs = GpuTensor::uninit(ctx, "probs", &shape)?;
    let dprobs = GpuTensor::uninit(ctx, "dprobs", &shape)?;
    let lse = GpuTensor::uninit(ctx, "lse", &[s.batch, s.heads, s.q_seq])?;
    let dq = GpuTensor::uninit(ctx, "dq", &[s.batch, s.q_seq, s.heads, s.head_dim_qk])?;
    let dk = GpuTensor::uninit(ctx, "dk", &[s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk])?;
    let dv = GpuTensor::uninit(ctx, "dv", &[s.batch, s.kv_seq, s.kv_heads, s.head_dim_v])?;
    for (arg, t) in [("dq", &dq), ("dk", &dk), ("dv", &dv)] {
        check_whole_binding(ctx, arg, t.buffer())?;
    }
    let call = UnfusedCall::new(ctx, &s, scale, opts);
    let group = s.heads / s.kv_heads;
    let (b, h, hkv, lq, lk) = (
        s.batch as u32,
        s.heads as u32,
        s.kv_heads as u32,
        s.q_seq,
        s.kv_seq,
    );
    let dk_dim = s.head_dim_qk as u32;
    // P rows (queries) by columns (keys) per query head; P^T per kv head over its query heads.
    let (p_rows, p_t_grouped) = probs_operands(&s);
    let (dq_v, dk_v, dv_v) = (dq.heads()?, dk.heads()?, dv.heads()?);

    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "attention_backward_unfused");
        encode_probs(ctx, &mut pass, call, [q, k], &probs, &lse)?;
        // dP, dS in place, dV.
        encode_unfused_output_grads(ctx, &mut pass, call, [&probs, &dprobs], [v, d_out, &dv_v])?;
        // dQ = scale dS K
        encode_gemm(
            ctx,
            &mut pass,
            &Gemm {
                m: lq as u32,
                n: dk_dim,
                k: lk as u32,
                groups: 1,
                batch: b,
                heads: h,
                alpha: scale,
                a: (Region::whole(dprobs.buffer()), p_rows),
                b: (Region::whole(k.buffer()), view_operand(k, true, group)),
                c: (Region::whole(dq.buffer()), view_operand(&dq_v, true, 1)),
                epilogue: Epilogue::NONE,
                row_sums: None,
                elements: Elements::F32,
            },
        )?;
        // dK = scale sum_g dS^T Q
        encode_gemm(
            ctx,
            &mut pass,
            &Gemm {
                m: lk as u32,
                n: dk_dim,
                k: lq as u32,
                groups: group as u32,
                batch: b,
                heads: hkv,
                alpha: scale,
                a: (Region::whole(dprobs.buffer()), p_t_grouped),
                b: (Region::whole(q.buffer()), grouped_operand(q, group)),
                c: (Region::whole(dk.buffer()), view_operand(&dk_v, true, 1)),
                epilogue: Epilogue::NONE,
                row_sums: None,
                elements: Elements::F32,
            },
        )?;
    }
    ctx.submit(encoder)?;
    Ok(AttentionGrads {
        dq,
        dk,
        dv,
        d_sinks: None,
        d_bias: None,
        d_relative: None,
    })
}
