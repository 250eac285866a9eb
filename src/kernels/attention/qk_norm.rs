//! Cosine-similarity scores and key-norm clipping, the seeds' defences against "attention hijacking"
//! (one key of huge norm capturing a row whatever its content): queries and keys are transformed
//! before the scores (`shaders/attention/qk_norm.wgsl`: L2-normalised, eps-guarded, for cosine scores;
//! keys scaled down to norm `c` when longer, for clipping) into scratch tensors the attention kernels
//! then read, and the backward carries dQ and dK back through the same transform, in place. A learned
//! per-head cosine scale multiplies the normalised queries; its gradient is the per-head sum of
//! `dL/dy . x / |x|` over the query rows (row shares from the backward pass, then column sums in a
//! fixed order). Exact gradients; O((Lq + Lk) D) extra work against the attention's O(Lq Lk D).
//! CPU reference: [`crate::reference::attention`] (`Masks::normalize_qk`, `Masks::key_clip`).

use super::binding::{unused_writable, view_params, ViewParams};
use super::options::AttentionOptions;
use crate::device::Context;
use crate::error::Result;
use crate::kernels::arguments::check_binding;
use crate::kernels::dispatch::{Bindable, SimpleKernel};
use crate::kernels::linear::encode_column_sum;
use crate::tensor::{GpuTensor, HeadsView};

pub(super) const SOURCE: &str = include_str!("../../../shaders/attention/qk_norm.wgsl");

const NORMALIZE: u32 = 1;
const CLIP: u32 = 2;
const SCALE: u32 = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct NormParams {
    rows: u32,
    seq: u32,
    heads: u32,
    dim: u32,
    mode: u32,
    clip: f32,
    grid_x: u32,
    pad: u32,
    x: ViewParams,
    grad: ViewParams,
}

fn query_mode(opts: &AttentionOptions<'_>) -> u32 {
    match (opts.cosine, opts.learned_cosine) {
        (_, Some(_)) => NORMALIZE | SCALE,
        (Some(_), None) => NORMALIZE,
        (None, None) => 0,
    }
}

fn key_mode(opts: &AttentionOptions<'_>) -> u32 {
    (query_mode(opts) & NORMALIZE) | if opts.key_clip.is_some() { CLIP } else { 0 }
}

/// Whether `opts` transform the queries or keys before the scores.
pub(super) fn transforms(opts: &AttentionOptions<'_>) -> bool {
    query_mode(opts) != 0 || key_mode(opts) != 0
}

/// One of Q's or K's transforms: the kernel's `mode` bits, the key-norm clip and, under SCALE, the
/// per-head scale.
#[derive(Clone, Copy)]
struct Transform<'a> {
    mode: u32,
    clip: f32,
    scale: Option<&'a GpuTensor>,
}

impl<'a> Transform<'a> {
    /// The transform `mode` (query_mode or key_mode of `opts`) with its parameters from `opts`.
    fn of(opts: &AttentionOptions<'a>, mode: u32) -> Self {
        Self {
            mode,
            clip: opts.key_clip.unwrap_or(0.0),
            scale: opts
                .learned_cosine
                .filter(|_| mode & SCALE != 0)
                .map(|c| c.scale),
        }
    }
}

/// Records one pass of the kernel over the rows of `x`: the transform into `out` (a contiguous
/// scratch buffer), or the backward in place in the gradient view `grad`, which under SCALE also
/// writes the rows' gradient shares of the scale into `row_shares`.
fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &HeadsView,
    (out, grad): (&wgpu::Buffer, Option<&HeadsView>),
    transform: Transform<'_>,
    row_shares: Option<&wgpu::Buffer>,
) -> Result<()> {
    let Transform { mode, clip, scale } = transform;
    let [b, l, h, d] = x.shape();
    let rows = b * l * h;
    let out_arg = if grad.is_some() {
        "dq/dk"
    } else {
        "q/k output"
    };
    for (arg, buffer) in [("q/k", x.buffer()), (out_arg, out)] {
        check_binding(ctx, arg, buffer.size())?;
    }
    let params = NormParams {
        rows: rows as u32,
        seq: l as u32,
        heads: h as u32,
        dim: d as u32,
        mode,
        clip,
        grid_x: crate::kernels::dispatch::grid_x(ctx, rows)?,
        pad: 0,
        // Whole buffers are bound, so views keep their own offsets.
        x: view_params("q/k", x, 0)?,
        grad: grad
            .map(|g| view_params("dq/dk", g, 0))
            .transpose()?
            .unwrap_or_default(),
    };
    // Absent, both extra bindings are dummies; the writable one must be a buffer of its own (one
    // buffer cannot be bound read-only and writable in one dispatch).
    let unused = unused_writable(ctx)?;
    crate::kernels::dispatch::encode(
        ctx,
        encoder,
        SimpleKernel {
            name: if grad.is_some() {
                "attention_qk_norm_backward"
            } else {
                "attention_qk_norm"
            },
            source: SOURCE,
            constants: &[("BACKWARD", grad.is_some() as u32)],
        },
        bytemuck::bytes_of(&params),
        &[
            x.buffer(),
            out,
            scale.map_or(ctx.empty_storage() as &dyn Bindable, |s| s as &dyn Bindable),
            row_shares.unwrap_or(&unused),
        ],
        rows,
    )
}

/// Refuses Q and K whose transforms the device cannot dispatch (one invocation per row of a head),
/// so that a call is refused before it records anything rather than between its dispatches.
pub(super) fn check_grids(
    ctx: &Context,
    [q, k]: [&HeadsView; 2],
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    for (x, mode) in [(q, query_mode(opts)), (k, key_mode(opts))] {
        if mode != 0 {
            let [b, l, h, _] = x.shape();
            crate::kernels::dispatch::grid_x(ctx, b * l * h)?;
        }
    }
    Ok(())
}

/// The Q and K the attention kernels read: the inputs themselves, or their transforms (recorded into
/// `encoder`) in the context's scratch tensors.
pub(super) fn encode_inputs(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    q: &HeadsView,
    k: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<(HeadsView, HeadsView)> {
    let transform = |encoder: &mut wgpu::CommandEncoder, slot, x: &HeadsView, mode| {
        if mode == 0 {
            return Ok(x.clone());
        }
        let [b, l, h, d] = x.shape();
        let buffer = ctx.scratch_buffer(slot, (b * l * h * d * 4) as u64)?;
        record(
            ctx,
            encoder,
            x,
            (&buffer, None),
            Transform::of(opts, mode),
            None,
        )?;
        HeadsView::new(buffer, 0, [b, l, h, d], [l * h * d, h * d, d])
    };
    Ok((
        transform(encoder, "attention transformed q", q, query_mode(opts))?,
        transform(encoder, "attention transformed k", k, key_mode(opts))?,
    ))
}

/// Carries `dq` and `dk` (gradients with respect to the transformed Q and K, as the attention
/// backward wrote them) back through the transforms, in place.
pub(super) fn encode_backward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    [q, k]: [&HeadsView; 2],
    [dq, dk]: [&HeadsView; 2],
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let [b, lq, h, _] = q.shape();
    let row_dots = match opts.learned_cosine {
        Some(_) => {
            Some(ctx.scratch_buffer("attention cosine scale row shares", (b * lq * h * 4) as u64)?)
        }
        None => None,
    };
    for (x, grad, mode) in [(q, dq, query_mode(opts)), (k, dk, key_mode(opts))] {
        if mode != 0 {
            let transform = Transform::of(opts, mode);
            let shares = row_dots.as_ref().filter(|_| transform.scale.is_some());
            record(
                ctx,
                encoder,
                x,
                (grad.buffer(), Some(grad)),
                transform,
                shares,
            )?;
        }
    }
    if let (Some(c), Some(dots)) = (opts.learned_cosine, &row_dots) {
        // Rows are (batch, position, head): a [B * Lq, H] matrix whose column sums are dL/ds.
        encode_column_sum(ctx, encoder, dots, b * lq, h, c.grad)?;
    }
    Ok(())
}

/// Whether the options transform Q or K.
pub(super) fn active(opts: &AttentionOptions<'_>) -> bool {
    key_mode(opts) != 0
}

/// This module's parameter block against its WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(super) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    vec![uniform_layout!(
        "attention_qk_norm",
        "Params",
        NormParams { rows, seq, heads, dim, mode, clip, grid_x, pad }
        nested { x, grad }
        constants { NORMALIZE, CLIP, SCALE }
    )]
}
