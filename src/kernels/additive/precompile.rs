//! Ahead-of-time compilation of an additive attention problem's pipelines.

use crate::device::Context;
use crate::error::Result;
use crate::kernels::attention::{AttentionOptions, AttentionPasses, BackwardViews, ForwardViews};
use crate::spec::AttentionShape;
use crate::tensor::GpuTensor;

use super::backward::{additive_backward_into, additive_backward_workspace};
use super::call::AdditiveScores;
use super::forward::additive_forward_into;

/// Compiles every pipeline that [`additive_forward_into`] (and, for
/// [`AttentionPasses::ForwardBackward`], [`additive_backward_into`]) would use for `shape` (`Da` as
/// `head_dim_qk`, `kv_heads == heads`) and `opts`, without running any, as
/// [`attention_precompile`](crate::kernels::attention::attention_precompile) does for dot-product attention.
/// [`additive_decode_into`](super::additive_decode_into) runs these kernels for prefill-sized
/// chunks, and its own decoding kernel for a few new rows, which this does not build
/// (`wgpu_attention_serve::Generator::precompile` builds a model's). Returns how many pipelines
/// were newly compiled.
pub fn additive_precompile(
    ctx: &Context,
    shape: &AttentionShape,
    opts: &AttentionOptions<'_>,
    passes: AttentionPasses,
) -> Result<usize> {
    let s = shape;
    let before = ctx.cached_pipelines();
    let heads = |seq: usize, dim: usize| -> Result<GpuTensor> {
        GpuTensor::zeros(ctx, &[s.batch, seq, s.heads, dim])
    };
    let (a, b, v, out) = (
        heads(s.q_seq, s.head_dim_qk)?,
        heads(s.kv_seq, s.head_dim_qk)?,
        heads(s.kv_seq, s.head_dim_v)?,
        heads(s.q_seq, s.head_dim_v)?,
    );
    let (w, bias) = (
        GpuTensor::zeros(ctx, &[s.heads, s.head_dim_qk])?,
        GpuTensor::zeros(ctx, &[s.heads, s.head_dim_qk])?,
    );
    let lse = GpuTensor::zeros(ctx, &[s.batch, s.heads, s.q_seq])?;
    let scores = AdditiveScores { w: &w, bias: &bias };
    let (a, b, v, out) = (a.heads()?, b.heads()?, v.heads()?, out.heads()?);
    let mut encoder = ctx
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("additive precompile (never submitted)"),
        });
    additive_forward_into(
        ctx,
        &mut encoder,
        &ForwardViews {
            q: &a,
            k: &b,
            v: &v,
            out: &out,
            lse: &lse,
        },
        scores,
        opts,
    )?;
    if passes == AttentionPasses::ForwardBackward {
        let (d_out, da, db, dv) = (
            heads(s.q_seq, s.head_dim_v)?,
            heads(s.q_seq, s.head_dim_qk)?,
            heads(s.kv_seq, s.head_dim_qk)?,
            heads(s.kv_seq, s.head_dim_v)?,
        );
        let (dw, dbias) = (
            GpuTensor::zeros(ctx, &[s.heads, s.head_dim_qk])?,
            GpuTensor::zeros(ctx, &[s.heads, s.head_dim_qk])?,
        );
        let workspace = additive_backward_workspace(ctx, s)?;
        additive_backward_into(
            ctx,
            &mut encoder,
            &BackwardViews {
                q: &a,
                k: &b,
                v: &v,
                out: &out,
                lse: &lse,
                d_out: &d_out.heads()?,
                dq: &da.heads()?,
                dk: &db.heads()?,
                dv: &dv.heads()?,
                workspace: &workspace,
            },
            scores,
            [&dw, &dbias],
            opts,
        )?;
    }
    // Dropped unsubmitted: nothing runs, the pipelines stay in the context's cache.
    drop(encoder);
    Ok(ctx.cached_pipelines() - before)
}
