//! The fused backward: the query side (`backward_da.wgsl`: da, D and per-row shares of dw), the
//! key side (`backward_db.wgsl`: db, dV) and the fixed-order sum of dw and dbias
//! (`param_grads.wgsl`).

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::attention::binding::{
    base_params, bind_output_pair, bind_tensor, bind_view, encode_chunks, encode_kernel,
    seq_lens_buffer, set_grid, Binding, Bound, Kernel, Shared, SIMPLE_WG, VIEW_DK, VIEW_DO,
    VIEW_DQ, VIEW_DV, VIEW_K, VIEW_O, VIEW_Q, VIEW_V,
};
use crate::kernels::attention::header::with_common;
use crate::kernels::attention::shape::{check_distinct, check_tensor, check_view};
use crate::kernels::attention::{AttentionOptions, BackwardViews, ForwardViews};
use crate::kernels::dispatch::loop_chunks;
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, HeadsView};

use super::call::{check, AdditiveGrads, AdditiveScores};
use super::sources::{
    backward_constants, sized_backward, BACKWARD_DA, BACKWARD_DB, BACKWARD_PACK,
    BACKWARD_WORKSPACE, PARAM_GRADS,
};
use super::tiles::{backward_lanes, backward_names, staged_tile, AdditiveKernel, WG};
use super::tune::{runs_unfused, Tuned};
use super::unfused::{encode_backward_unfused, UnfusedScratch};
use super::ADDITIVE_BACKWARD_STORAGE_BUFFERS;
use crate::device::KernelChoice;
use crate::kernels::attention::unfused::UnfusedCall;

/// Additive attention backward into new tensors, submitted: the gradients for `d_out` at the
/// output of the forward call whose tensors `forward` names (`q`, `k` the projections `a`, `b`;
/// `out` and `lse` what the forward wrote).
pub fn additive_backward(
    ctx: &Context,
    forward: &ForwardViews<'_>,
    scores: AdditiveScores<'_>,
    d_out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AdditiveGrads> {
    let &ForwardViews {
        q: a,
        k: b,
        v,
        out,
        lse,
    } = forward;
    let (s, _) = check(ctx, a, b, v, scores, opts)?;
    let (bb, lq, lk, h) = (s.batch, s.q_seq, s.kv_seq, s.heads);
    let grads = AdditiveGrads {
        da: GpuTensor::uninit(ctx, "additive da", &[bb, lq, h, s.head_dim_qk])?,
        db: GpuTensor::uninit(ctx, "additive db", &[bb, lk, h, s.head_dim_qk])?,
        dv: GpuTensor::uninit(ctx, "additive dv", &[bb, lk, h, s.head_dim_v])?,
        dw: GpuTensor::uninit(ctx, "additive dw", &[h, s.head_dim_qk])?,
        dbias: GpuTensor::uninit(ctx, "additive dbias", &[h, s.head_dim_qk])?,
    };
    let workspace = additive_backward_workspace(ctx, &s)?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    additive_backward_into(
        ctx,
        &mut encoder,
        &BackwardViews {
            q: a,
            k: b,
            v,
            out,
            lse,
            d_out,
            dq: &grads.da.heads()?,
            dk: &grads.db.heads()?,
            dv: &grads.dv.heads()?,
            workspace: &workspace,
        },
        scores,
        [&grads.dw, &grads.dbias],
        opts,
    )?;
    ctx.submit(encoder)?;
    Ok(grads)
}

/// The backward's workspace for `s` (`shaders/additive/backward_workspace.wgsl`): each row's
/// `D = dO . O` (`[B, H, Lq]`, padded to a multiple of 64 values so the shares start at a 256-byte
/// boundary, WebGPU's largest storage offset alignment), each row's share of `dw`
/// (`[H, B, Lq, Da]`), and copies of `w`, the bias and `lse`.
pub fn additive_backward_workspace(ctx: &Context, s: &AttentionShape) -> Result<GpuTensor> {
    GpuTensor::zeros(ctx, &[workspace_len(s)])
}

fn workspace_len(s: &AttentionShape) -> usize {
    let rows = s.batch * s.heads * s.q_seq;
    rows.div_ceil(64) * 64 + rows * s.head_dim_qk + 2 * s.heads * s.head_dim_qk + rows
}

/// Records the additive attention backward: `views` with the projections `a`, `b` as `q`, `k` and
/// their gradients `da`, `db` as `dq`, `dk` (shaped like them), the workspace
/// [`additive_backward_workspace`]; and the score parameters' gradients `[dw, dbias]` `[H, Da]`.
/// Nothing is recorded if the input is rejected.
pub fn additive_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &BackwardViews<'_>,
    scores: AdditiveScores<'_>,
    param_grads: [&GpuTensor; 2],
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    encode_backward(ctx, encoder, views, scores, param_grads, opts, None)
}

/// [`additive_backward_into`] running `choice` (the tuner's candidates) instead of the context's.
pub(super) fn record_backward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &BackwardViews<'_>,
    scores: AdditiveScores<'_>,
    param_grads: [&GpuTensor; 2],
    opts: &AttentionOptions<'_>,
    choice: KernelChoice,
) -> Result<()> {
    encode_backward(ctx, encoder, views, scores, param_grads, opts, Some(choice))
}

/// Records the backward: the fused kernels, or the unfused path where `choice` (the context's,
/// tuned, where `None`) says so.
fn encode_backward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &BackwardViews<'_>,
    scores: AdditiveScores<'_>,
    [dw, dbias]: [&GpuTensor; 2],
    opts: &AttentionOptions<'_>,
    choice: Option<KernelChoice>,
) -> Result<()> {
    let &BackwardViews {
        q: a,
        k: b,
        v,
        out,
        lse,
        d_out,
        dq: da,
        dk: db,
        dv,
        workspace,
    } = views;
    let (s, scale) = check(ctx, a, b, v, scores, opts)?;
    let have = ctx.limits().max_storage_buffers_per_shader_stage;
    if have < ADDITIVE_BACKWARD_STORAGE_BUFFERS {
        return Err(Error::shape(
            "device limits",
            format!(
                "max_storage_buffers_per_shader_stage is {have}, but the additive attention backward binds {ADDITIVE_BACKWARD_STORAGE_BUFFERS}; request the adapter's limit (adapter.limits()) when creating the device"
            ),
        ));
    }
    let (bb, lq, lk, h, dda, ddv) = (
        s.batch,
        s.q_seq,
        s.kv_seq,
        s.heads,
        s.head_dim_qk,
        s.head_dim_v,
    );
    check_view("out", out, [bb, lq, h, ddv])?;
    check_view("d_out", d_out, [bb, lq, h, ddv])?;
    check_tensor("lse", lse, &[bb, h, lq])?;
    check_view("da", da, [bb, lq, h, dda])?;
    check_view("db", db, [bb, lk, h, dda])?;
    check_view("dv", dv, [bb, lk, h, ddv])?;
    check_tensor("dw", dw, &[h, dda])?;
    check_tensor("dbias", dbias, &[h, dda])?;
    let rows = bb * h * lq;
    check_tensor("workspace", workspace, &[workspace_len(&s)])?;
    let mut inputs = vec![
        ("a", a.region()),
        ("b", b.region()),
        ("v", v.region()),
        ("out", out.region()),
        ("d_out", d_out.region()),
        ("lse", lse.region()),
        ("w", scores.w.region()),
        ("bias", scores.bias.region()),
    ];
    // The first kernel writes the workspace, which the gradient kernels then read.
    check_distinct(ctx, opts, &[("workspace", workspace.region())], &inputs)?;
    inputs.push(("workspace", workspace.region()));
    let outputs = [
        ("da", da.region()),
        ("db", db.region()),
        ("dv", dv.region()),
        ("dw", dw.region()),
        ("dbias", dbias.region()),
    ];
    check_distinct(ctx, opts, &outputs, &inputs)?;
    if runs_unfused(ctx, Tuned::Backward, &s, opts, choice)? {
        // P recomputed with its own lse (the forward's stays an input), in scratch.
        let scratch = UnfusedScratch::of_context(ctx, &s)?;
        let mut pass = ctx.begin_pass(encoder, "additive_backward_unfused");
        let call = UnfusedCall::new(ctx, &s, scale, opts);
        return encode_backward_unfused(
            ctx,
            &mut pass,
            call,
            ([a, b, v, d_out], scores),
            [da, db, dv],
            [dw, dbias],
            &scratch,
        );
    }
    let dw_offset = rows.div_ceil(64) as u64 * 256;
    let dw_rows = Binding {
        buffer: workspace.buffer(),
        offset_bytes: dw_offset,
        size_bytes: (rows * dda) as u64 * 4,
    };
    let shared = Shared::lens(seq_lens_buffer(ctx, opts));
    let mut pass = ctx.begin_pass(encoder, "additive_backward");

    // w, the bias and lse into the workspace, where the gradient kernels read them.
    let mut params = base_params(&s, scale, opts);
    let bindings = [
        bind_tensor(ctx, "w", scores.w)?,
        bind_tensor(ctx, "bias", scores.bias)?,
        bind_tensor(ctx, "lse", lse)?,
        bind_tensor(ctx, "workspace", workspace)?,
    ];
    let elements = rows.max(h * dda);
    let grid = set_grid(ctx, &mut params, elements.div_ceil(SIMPLE_WG as usize), 1)?;
    encode_kernel(
        ctx,
        &mut pass,
        Kernel {
            name: "additive_backward_pack",
            source: |score_bias| {
                with_common(
                    &format!("{BACKWARD_WORKSPACE}\n{BACKWARD_PACK}"),
                    score_bias,
                )
            },
            constants: &[("WG", SIMPLE_WG)],
        },
        &params,
        Bound {
            shared: Shared::NONE,
            bindings: &bindings,
            grid,
        },
    );

    // Query side: da, D and the dw shares.
    let mut params = base_params(&s, scale, opts);
    let bindings = [
        bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
        bind_view(ctx, "b", b, VIEW_K, &mut params)?,
        bind_view(ctx, "v", v, VIEW_V, &mut params)?,
        bind_tensor(ctx, "workspace", workspace)?,
        bind_view(ctx, "out", out, VIEW_O, &mut params)?,
        bind_view(ctx, "d_out", d_out, VIEW_DO, &mut params)?,
        bind_view(ctx, "da", da, VIEW_DQ, &mut params)?,
    ];
    let lanes = backward_lanes(ctx, &s);
    let rows_per_group = (WG / lanes) as usize;
    let tile = staged_tile(ctx, &s, lanes);
    let constants = backward_constants(&s, tile, lanes);
    let grid = set_grid(ctx, &mut params, lq.div_ceil(rows_per_group), bb * h)?;
    let (per_key, fixed) = AdditiveKernel::BackwardQuerySide.loop_cost(dda, ddv, tile, lanes);
    let chunks = loop_chunks(ctx, lk, per_key, fixed, tile as usize);
    encode_chunks(
        ctx,
        &mut pass,
        Kernel {
            name: backward_names(ctx)[0],
            source: |score_bias| sized_backward(BACKWARD_DA, &s, lanes, score_bias),
            constants: &constants,
        },
        &mut params,
        Bound {
            shared,
            bindings: &bindings,
            grid,
        },
        &chunks,
    );

    // Key side: db and dV.
    let mut params = base_params(&s, scale, opts);
    let bindings = [
        bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
        bind_view(ctx, "b", b, VIEW_K, &mut params)?,
        bind_view(ctx, "v", v, VIEW_V, &mut params)?,
        bind_tensor(ctx, "workspace", workspace)?,
        bind_view(ctx, "d_out", d_out, VIEW_DO, &mut params)?,
    ];
    let outputs = bind_output_pair(ctx, [("db", db, VIEW_DK), ("dv", dv, VIEW_DV)], &mut params)?;
    let bindings: Vec<_> = bindings.into_iter().chain(outputs).collect();
    let grid = set_grid(ctx, &mut params, lk.div_ceil(rows_per_group), bb * h)?;
    let (per_query, fixed) = AdditiveKernel::BackwardKeySide.loop_cost(dda, ddv, tile, lanes);
    let chunks = loop_chunks(ctx, lq, per_query, fixed, tile as usize);
    encode_chunks(
        ctx,
        &mut pass,
        Kernel {
            name: backward_names(ctx)[1],
            source: |score_bias| sized_backward(BACKWARD_DB, &s, lanes, score_bias),
            constants: &constants,
        },
        &mut params,
        Bound {
            shared,
            bindings: &bindings,
            grid,
        },
        &chunks,
    );

    encode_param_grads(ctx, &mut pass, &s, opts, dw_rows, da, [dw, dbias])
}

/// dw and dbias `[H, Da]`: fixed-order sums of the per-row shares `dw_rows` and of `da` over every
/// (batch, query row).
pub(super) fn encode_param_grads(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    dw_rows: Binding<'_>,
    da: &HeadsView,
    [dw, dbias]: [&GpuTensor; 2],
) -> Result<()> {
    let mut params = base_params(s, 1.0, opts);
    let bindings = [
        dw_rows,
        bind_view(ctx, "da", da, VIEW_DQ, &mut params)?,
        bind_tensor(ctx, "dw", dw)?,
        bind_tensor(ctx, "dbias", dbias)?,
    ];
    let grid = set_grid(
        ctx,
        &mut params,
        (s.heads * s.head_dim_qk).div_ceil(SIMPLE_WG as usize),
        1,
    )?;
    let chunks = loop_chunks(ctx, s.batch * s.q_seq, 1, 16, 1);
    encode_chunks(
        ctx,
        pass,
        Kernel {
            name: "additive_param_grads",
            source: |score_bias| with_common(PARAM_GRADS, score_bias),
            constants: &[("WG", SIMPLE_WG)],
        },
        &mut params,
        Bound {
            shared: Shared::lens(seq_lens_buffer(ctx, opts)),
            bindings: &bindings,
            grid,
        },
        &chunks,
    );
    Ok(())
}
