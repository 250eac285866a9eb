//! Attention sinks (gpt-oss style): a learnable logit per query head that joins every row's softmax
//! denominator without a value (`shaders/attention/sinks.wgsl`, applied after the forward of either
//! family), and its gradient `dsink_h = -sum_rows exp(sink_h - lse) D` from the backward's stats
//! (`shaders/attention/sinks_backward.wgsl`, one workgroup per head, fixed-order reduction).
//! dQ, dK and dV need nothing else: the forward's lse and O already include the sink.
//! CPU reference: [`crate::reference::attention`] (`Masks::sinks`).

use super::binding::{
    base_params, bind_tensor, bind_view, encode_kernel, seq_lens_buffer, set_grid, Bound, Kernel,
    Shared, SIMPLE_WG, VIEW_O,
};
use super::header::with_common;
use super::options::AttentionOptions;
use super::shape::{check_distinct, check_options, check_tensor};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, HeadsView};

pub(super) const FORWARD: &str = include_str!("../../../shaders/attention/sinks.wgsl");
pub(super) const BACKWARD: &str = include_str!("../../../shaders/attention/sinks_backward.wgsl");

/// Invocations of the sink-gradient workgroup (a power of two: the reduction is a tree).
const BACKWARD_WG: u32 = 64;
/// The backward kernel's only specialisation: its pipeline is the same for every problem.
const BACKWARD_CONSTANTS: [(&str, u32); 1] = [("WG", BACKWARD_WG)];

/// Compiles the backward kernel's pipeline ([`super::attention_precompile`]).
pub(super) fn precompile_backward(ctx: &Context) {
    ctx.pipeline(
        "attention_sinks_backward",
        || with_common(BACKWARD, true),
        &BACKWARD_CONSTANTS,
    );
}

/// Records the sink pass over the forward's `out` and `lse` where the options have sinks.
pub(super) fn encode_forward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    s: &AttentionShape,
    scale: f32,
    (out, lse): (&HeadsView, &GpuTensor),
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let Some(sinks) = opts.sinks else {
        return Ok(());
    };
    let mut params = base_params(s, scale, opts);
    let bindings = [
        bind_view(ctx, "out", out, VIEW_O, &mut params)?,
        bind_tensor(ctx, "lse", lse)?,
        bind_tensor(ctx, "sinks", sinks)?,
    ];
    let rows = s.batch * s.heads * s.q_seq;
    let grid = set_grid(ctx, &mut params, rows.div_ceil(SIMPLE_WG as usize), 1)?;
    let mut pass = ctx.begin_pass(encoder, "attention_sinks");
    encode_kernel(
        ctx,
        &mut pass,
        Kernel {
            name: "attention_sinks",
            source: |score_bias| with_common(FORWARD, score_bias),
            constants: &[("WG", SIMPLE_WG)],
        },
        &params,
        Bound {
            // Padded rows are known by their lse = -inf; the lengths locate a packed O's rows.
            shared: Shared::lens(seq_lens_buffer(ctx, opts)),
            bindings: &bindings,
            grid,
        },
    );
    Ok(())
}

/// Records `d_sinks [H] = dL/dsinks` into `encoder`, after
/// [`attention_backward_into`](super::attention_backward_into) recorded with the same `workspace`
/// and options (it reads the `(lse, D)` stats the backward wrote there).
pub fn attention_sinks_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    shape: &AttentionShape,
    sinks: &GpuTensor,
    workspace: &GpuTensor,
    d_sinks: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let s = shape;
    let scale = check_options(ctx, s, opts)?;
    check_tensor("sinks", sinks, &[s.heads])?;
    check_tensor("d_sinks", d_sinks, &[s.heads])?;
    check_tensor("workspace", workspace, &[s.batch, s.heads, s.q_seq, 2])?;
    check_distinct(
        ctx,
        opts,
        &[("d_sinks", d_sinks.region())],
        &[("sinks", sinks.region()), ("workspace", workspace.region())],
    )?;
    let rows = (s.batch * s.q_seq).div_ceil(BACKWARD_WG as usize);
    if let Some(budget) = ctx.loop_budget() {
        if rows > budget as usize {
            return Err(Error::Unsupported {
                arg: "batch * q seq / 64 (sink gradient loop)",
                value: rows as u64,
                limit: budget as u64,
                hint: " on this driver (llvmpipe loop cap); split the batch",
            });
        }
    }
    let mut params = base_params(s, scale, opts);
    let bindings = [
        bind_tensor(ctx, "workspace", workspace)?,
        bind_tensor(ctx, "sinks", sinks)?,
        bind_tensor(ctx, "d_sinks", d_sinks)?,
    ];
    let grid = set_grid(ctx, &mut params, s.heads, 1)?;
    let mut pass = ctx.begin_pass(encoder, "attention_sinks_backward");
    encode_kernel(
        ctx,
        &mut pass,
        Kernel {
            name: "attention_sinks_backward",
            source: |score_bias| with_common(BACKWARD, score_bias),
            constants: &BACKWARD_CONSTANTS,
        },
        &params,
        Bound {
            // Padded rows are known by their lse = -inf: no lengths bound.
            shared: Shared::NONE,
            bindings: &bindings,
            grid,
        },
    );
    Ok(())
}
