//! Attention maps: the probabilities `P[b, h, i, j]` of an attention call, recomputed on request from
//! Q, K and the forward's `lse` (`shaders/attention/probs.wgsl`) with the same masks and score
//! modifiers as the fused kernels, for a range of query rows at a time (long sequences are looked at
//! by row chunks; nothing `Lq x Lk` is kept by the fused path). CPU reference:
//! [`crate::reference::attention::attention_probabilities`].
//!
//! What they show and what they do not: `P` is where each query's softmax put its weight, not why
//! the model produced its output, nor what would change it (seed 000's caveat: attention weights are
//! not explanations; values, later layers and residual paths all intervene).

use super::binding::{
    base_params, bind_tensor, bind_view, encode_kernel, set_grid, Bound, Kernel, Shared, SIMPLE_WG,
    VIEW_K, VIEW_Q,
};
use super::forward::check_rows;
use super::header::with_common;
use super::options::AttentionOptions;
use super::qk_norm;
use super::shape::{check_distinct, check_options, check_tensor, refuse_packed};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::check_f32;
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, HeadsView};
use std::ops::Range;

pub(super) const SOURCE: &str = include_str!("../../../shaders/attention/probs.wgsl");

/// The probabilities of query rows `rows` of every (batch, head): a new `[B, H, rows.len(), Lk]`
/// tensor. `lse` is the forward's, for the same inputs and options.
pub fn attention_probabilities(
    ctx: &Context,
    q: &HeadsView,
    k: &HeadsView,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
    rows: Range<usize>,
) -> Result<GpuTensor> {
    let [b, _, h, _] = q.shape();
    let lk = k.shape()[1];
    let out = GpuTensor::uninit(ctx, "attention probabilities", &[b, h, rows.len(), lk])?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    attention_probabilities_into(ctx, &mut encoder, [q, k], lse, rows, &out, opts)?;
    ctx.submit(encoder)?;
    Ok(out)
}

/// Records [`attention_probabilities`] into `encoder`: of Q and K (`[q, k]`) and the forward's
/// `lse`, query rows `rows`, writing `out` (`[B, H, rows.len(), Lk]`). Nothing is recorded if the
/// input is rejected.
pub fn attention_probabilities_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    [q, k]: [&HeadsView; 2],
    lse: &GpuTensor,
    rows: Range<usize>,
    out: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    // V plays no part; K stands in for it in the shape check.
    let s = AttentionShape::of(q, k, k)?;
    check_f32(&[("q", q), ("k", k)])?;
    refuse_packed(&[("q", q), ("k", k)], "attention_probabilities")?;
    let scale = check_options(ctx, &s, opts)?;
    check_tensor("lse", lse, &[s.batch, s.heads, s.q_seq])?;
    check_rows(&rows, s.q_seq)?;
    check_tensor("out", out, &[s.batch, s.heads, rows.len(), s.kv_seq])?;
    check_distinct(
        ctx,
        opts,
        &[("out", out.region())],
        &[("q", q.region()), ("k", k.region()), ("lse", lse.region())],
    )?;
    let elements = out.len();
    if elements > u32::MAX as usize {
        return Err(Error::Unsupported {
            arg: "attention probabilities (B * H * rows * Lk)",
            value: elements as u64,
            limit: u32::MAX as u64,
            hint: "; ask for fewer rows at a time",
        });
    }
    let (q, k) = qk_norm::encode_inputs(ctx, encoder, q, k, opts)?;
    let mut params = base_params(&s, scale, opts);
    params.chunk_begin = rows.start as u32;
    params.chunk_end = rows.end as u32;
    let bindings = [
        bind_view(ctx, "q", &q, VIEW_Q, &mut params)?,
        bind_view(ctx, "k", &k, VIEW_K, &mut params)?,
        bind_tensor(ctx, "lse", lse)?,
        bind_tensor(ctx, "out", out)?,
    ];
    let grid = set_grid(ctx, &mut params, elements.div_ceil(SIMPLE_WG as usize), 1)?;
    let mut pass = ctx.begin_pass(encoder, "attention_probabilities");
    encode_kernel(
        ctx,
        &mut pass,
        Kernel {
            name: "attention_probs",
            source: |score_bias| with_common(SOURCE, score_bias),
            constants: &[("WG", SIMPLE_WG)],
        },
        &params,
        Bound {
            shared: Shared::scores(ctx, opts)?,
            bindings: &bindings,
            grid,
        },
    );
    Ok(())
}
