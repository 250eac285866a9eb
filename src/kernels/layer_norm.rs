//! LayerNorm over the last dimension (SPEC.md): `shaders/layer_norm_forward.wgsl` writes y and the
//! per-row `(mean, rstd)`; the backward is `layer_norm_backward.wgsl` (dx, one invocation per row) and
//! `layer_norm_param_grads.wgsl` (dgamma, dbeta, one invocation per column summing rows in order, so
//! deterministic without atomics). RMSNorm (LLaMA's: no centring, no shift) is the same kernels with
//! `CENTERED = false`: [`rms_norm_forward_into`], [`rms_norm_backward_add_into`].
//!
//! Those kernels are the CPU-driver family's ([`KernelFamily::CpuDriver`]): one invocation per row
//! or column suits a CPU's few wide cores, but leaves a GPU idle (a 1024 x 256 LayerNorm launches 16
//! workgroups: benchmarks/HISTORY.md). The GPU family's give a row a workgroup
//! (`layer_norm_forward_rows.wgsl`, `layer_norm_backward_rows.wgsl`, sums in a fixed tree order)
//! and reduce the parameter gradients in two steps: partial sums over blocks of rows
//! (`layer_norm_param_partials.wgsl`), then the blocks in order (`layer_norm_param_sums.wgsl`).
//! Both families are deterministic and tested against the same reference.
//! CPU reference: [`crate::reference::layer_norm`].

use crate::device::{Context, KernelFamily};
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_tensors};
use crate::kernels::dispatch::{
    encode_column_reduction_in, encode_in, encode_workgroups_in, grid_x, invocation_groups,
    Bindable, SimpleKernel,
};
use crate::tensor::{GpuTensor, Region};

const FORWARD: &str = concat!(
    include_str!("../../shaders/layer_norm_forward_common.wgsl"),
    include_str!("../../shaders/layer_norm_forward.wgsl")
);
const BACKWARD: &str = concat!(
    include_str!("../../shaders/layer_norm_backward_common.wgsl"),
    include_str!("../../shaders/layer_norm_backward.wgsl")
);
const PARAM_GRADS: &str = include_str!("../../shaders/layer_norm_param_grads.wgsl");
const FORWARD_ROWS: &str = concat!(
    include_str!("../../shaders/workgroup_sum.wgsl"),
    include_str!("../../shaders/layer_norm_forward_common.wgsl"),
    include_str!("../../shaders/layer_norm_forward_rows.wgsl")
);
const BACKWARD_ROWS: &str = concat!(
    include_str!("../../shaders/workgroup_sum.wgsl"),
    include_str!("../../shaders/layer_norm_backward_common.wgsl"),
    include_str!("../../shaders/layer_norm_backward_rows.wgsl")
);
const PARAM_PARTIALS: &str = include_str!("../../shaders/layer_norm_param_partials.wgsl");
const PARAM_SUMS: &str = include_str!("../../shaders/layer_norm_param_sums.wgsl");

/// Rows one partial sum of the GPU family's parameter gradients covers (`BLOCK_ROWS`).
const BLOCK_ROWS: usize = 32;

/// The LayerNorm shaders by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![
        ("layer_norm_forward_cpu", FORWARD.to_string()),
        ("layer_norm_backward_cpu", BACKWARD.to_string()),
        ("layer_norm_param_grads_cpu", PARAM_GRADS.to_string()),
        ("layer_norm_forward_rows", FORWARD_ROWS.to_string()),
        ("layer_norm_backward_rows", BACKWARD_ROWS.to_string()),
        ("layer_norm_param_partials", PARAM_PARTIALS.to_string()),
        ("layer_norm_param_sums", PARAM_SUMS.to_string()),
    ]
}

/// Whether `ctx` runs the GPU family's LayerNorm kernels (a workgroup per row).
fn rows_per_workgroup(ctx: &Context) -> bool {
    ctx.kernel_family() != KernelFamily::CpuDriver
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct BackwardParams {
    rows: u32,
    cols: u32,
    has_residual: u32,
    grid_x: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RowParams {
    rows: u32,
    cols: u32,
    eps: f32,
    grid_x: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct PartialParams {
    rows: u32,
    cols: u32,
    blocks: u32,
    grid_x: u32,
}

/// y and the saved `(mean, rstd)` per row, `[rows, 2]`.
#[derive(Clone, Debug)]
pub struct LayerNormOutput {
    /// The normalised output, shaped like `x`.
    pub y: GpuTensor,
    /// Per row `(mean, 1 / sqrt(var + eps))`, what the backward needs.
    pub stats: GpuTensor,
}

#[derive(Clone, Debug)]
/// Gradients of a LayerNorm.
pub struct LayerNormGrads {
    /// At the input.
    pub dx: GpuTensor,
    /// Of the scale `gamma`.
    pub d_gamma: GpuTensor,
    /// Of the shift `beta`.
    pub d_beta: GpuTensor,
}

/// Rows and columns of `x` (columns = last dimension), validated.
fn rows_cols(ctx: &Context, x: &GpuTensor) -> Result<(usize, usize)> {
    let cols = *x.shape().last().unwrap_or(&0);
    let rows = x.len().checked_div(cols).unwrap_or(0);
    if rows == 0 || cols == 0 {
        return Err(Error::shape(
            "x",
            format!(
                "has shape {:?}; LayerNorm needs at least one row and one column",
                x.shape()
            ),
        ));
    }
    if rows > u32::MAX as usize / 2 || x.len() > u32::MAX as usize {
        return Err(Error::Unsupported {
            arg: "x elements",
            value: x.len() as u64,
            limit: u32::MAX as u64,
            hint: "",
        });
    }
    // Three passes over a row per invocation; llvmpipe ends all loops after 65535 iterations.
    if let Some(budget) = ctx.loop_budget() {
        let limit = budget as usize / 3;
        if cols > limit {
            return Err(Error::Unsupported {
                arg: "LayerNorm columns",
                value: cols as u64,
                limit: limit as u64,
                hint: " on this driver (llvmpipe loop cap)",
            });
        }
    }
    check_binding(ctx, "x", x.size_bytes())?;
    Ok((rows, cols))
}

fn check_shape(arg: &'static str, t: &GpuTensor, expected: &[usize]) -> Result<()> {
    if t.shape() != expected {
        return Err(Error::shape(
            arg,
            format!("has shape {:?}, expected {:?}", t.shape(), expected),
        ));
    }
    Ok(())
}

/// LayerNorm of `x [.., cols]` into new tensors, submitted.
pub fn layer_norm_forward(
    ctx: &Context,
    x: &GpuTensor,
    gamma: &GpuTensor,
    beta: &GpuTensor,
    eps: f32,
) -> Result<LayerNormOutput> {
    let (rows, _) = rows_cols(ctx, x)?;
    let y = GpuTensor::uninit(ctx, "layer_norm y", x.shape())?;
    let stats = GpuTensor::uninit(ctx, "layer_norm stats", &[rows, 2])?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    layer_norm_forward_into(ctx, &mut encoder, x, [gamma, beta], eps, [&y, &stats])?;
    ctx.submit(encoder)?;
    Ok(LayerNormOutput { y, stats })
}

/// Records the LayerNorm forward with weights `[gamma, beta]` (`[cols]` each): `[y, stats]`, `y`
/// shaped like `x`, `stats [rows, 2]`. Nothing is recorded if the input is rejected.
pub fn layer_norm_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    [gamma, beta]: [&GpuTensor; 2],
    eps: f32,
    outputs: [&GpuTensor; 2],
) -> Result<()> {
    norm_forward_into(ctx, encoder, x, (gamma, Some(beta)), eps, outputs)
}

/// Records the RMSNorm forward `y = x / sqrt(mean(x^2) + eps) * gamma` (LLaMA's): `[y, stats]`, `y`
/// shaped like `x`, `stats [rows, 2]` holding `(0, rstd)` per row. Nothing is recorded if the input
/// is rejected.
pub fn rms_norm_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    gamma: &GpuTensor,
    eps: f32,
    outputs: [&GpuTensor; 2],
) -> Result<()> {
    norm_forward_into(ctx, encoder, x, (gamma, None), eps, outputs)
}

/// LayerNorm (`beta` given) or RMSNorm (`None`).
fn norm_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    (gamma, beta): (&GpuTensor, Option<&GpuTensor>),
    eps: f32,
    [y, stats]: [&GpuTensor; 2],
) -> Result<()> {
    let (rows, cols) = rows_cols(ctx, x)?;
    check_shape("gamma", gamma, &[cols])?;
    if let Some(beta) = beta {
        check_shape("beta", beta, &[cols])?;
    }
    check_shape("y", y, x.shape())?;
    check_shape("stats", stats, &[rows, 2])?;
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::shape(
            "eps",
            format!("is {eps}; it must be finite and >= 0"),
        ));
    }
    let mut inputs = vec![("x", x), ("gamma", gamma)];
    inputs.extend(beta.map(|b| ("beta", b)));
    check_tensors(ctx, &[("y", y), ("stats", stats)], &inputs)?;
    let (name, source, workgroups) = match rows_per_workgroup(ctx) {
        true => ("layer_norm_forward_rows", FORWARD_ROWS, rows as u64),
        false => ("layer_norm_forward_cpu", FORWARD, invocation_groups(rows)),
    };
    let params = RowParams {
        rows: rows as u32,
        cols: cols as u32,
        eps,
        grid_x: ctx.grid_2d(workgroups)?.0,
    };
    let mut pass = ctx.begin_pass(encoder, "layer_norm_forward");
    // RMSNorm binds gamma where beta would be; the shader does not read it.
    encode_workgroups_in(
        ctx,
        &mut pass,
        SimpleKernel {
            name,
            source,
            constants: &[("CENTERED", beta.is_some() as u32)],
        },
        bytemuck::bytes_of(&params),
        &[x, gamma, beta.unwrap_or(gamma), y, stats],
        workgroups,
    )
}

/// LayerNorm backward into new tensors, submitted. `stats` is the forward's.
pub fn layer_norm_backward(
    ctx: &Context,
    x: &GpuTensor,
    gamma: &GpuTensor,
    stats: &GpuTensor,
    dy: &GpuTensor,
) -> Result<LayerNormGrads> {
    let (_, cols) = rows_cols(ctx, x)?;
    let dx = GpuTensor::uninit(ctx, "layer_norm dx", x.shape())?;
    let d_gamma = GpuTensor::uninit(ctx, "layer_norm d_gamma", &[cols])?;
    let d_beta = GpuTensor::uninit(ctx, "layer_norm d_beta", &[cols])?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    layer_norm_backward_into(
        ctx,
        &mut encoder,
        x,
        gamma,
        stats,
        dy,
        [&dx, &d_gamma, &d_beta],
    )?;
    ctx.submit(encoder)?;
    Ok(LayerNormGrads {
        dx,
        d_gamma,
        d_beta,
    })
}

/// Records the LayerNorm backward: `grads` are `[dx, d_gamma, d_beta]`, `dx` shaped like `x`,
/// `d_gamma` and `d_beta` `[cols]` (overwritten, not accumulated).
pub fn layer_norm_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    gamma: &GpuTensor,
    stats: &GpuTensor,
    dy: &GpuTensor,
    grads: [&GpuTensor; 3],
) -> Result<()> {
    layer_norm_backward_add_into(ctx, encoder, x, gamma, stats, (dy, None), grads)
}

/// [`layer_norm_backward_into`] of `(dy, residual)` with `dx = LN'(dy) + residual` (`residual`
/// shaped like `x`): the gradient of a residual connection around the LayerNorm added in the same
/// kernel. `grads` are `[dx, d_gamma, d_beta]`.
pub fn layer_norm_backward_add_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    gamma: &GpuTensor,
    stats: &GpuTensor,
    upstream: (&GpuTensor, Option<&GpuTensor>),
    grads: [&GpuTensor; 3],
) -> Result<()> {
    let [dx, d_gamma, d_beta] = grads;
    let saved = [x, gamma, stats];
    norm_backward_add_into(ctx, encoder, saved, upstream, ([dx, d_gamma], Some(d_beta)))
}

/// The RMSNorm backward (after [`rms_norm_forward_into`], whose `stats` it reads) of `(dy,
/// residual)` with `dx = RMSNorm'(dy) + residual`; `grads` are `[dx, d_gamma]` (overwritten).
pub fn rms_norm_backward_add_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    gamma: &GpuTensor,
    stats: &GpuTensor,
    upstream: (&GpuTensor, Option<&GpuTensor>),
    grads: [&GpuTensor; 2],
) -> Result<()> {
    norm_backward_add_into(ctx, encoder, [x, gamma, stats], upstream, (grads, None))
}

/// LayerNorm's backward (`d_beta` given) or RMSNorm's (`None`), from the forward's `[x, gamma,
/// stats]`.
fn norm_backward_add_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    [x, gamma, stats]: [&GpuTensor; 3],
    (dy, residual): (&GpuTensor, Option<&GpuTensor>),
    ([dx, d_gamma], d_beta): ([&GpuTensor; 2], Option<&GpuTensor>),
) -> Result<()> {
    let (rows, cols) = rows_cols(ctx, x)?;
    check_shape("gamma", gamma, &[cols])?;
    check_shape("stats", stats, &[rows, 2])?;
    check_shape("dy", dy, x.shape())?;
    check_shape("dx", dx, x.shape())?;
    check_shape("d_gamma", d_gamma, &[cols])?;
    if let Some(d_beta) = d_beta {
        check_shape("d_beta", d_beta, &[cols])?;
    }
    if let Some(r) = residual {
        check_shape("residual", r, x.shape())?;
    }
    let mut inputs = vec![("x", x), ("gamma", gamma), ("stats", stats), ("dy", dy)];
    inputs.extend(residual.map(|r| ("residual", r)));
    let mut outputs = vec![("dx", dx), ("d_gamma", d_gamma)];
    outputs.extend(d_beta.map(|d| ("d_beta", d)));
    check_tensors(ctx, &outputs, &inputs)?;
    let centered = [("CENTERED", d_beta.is_some() as u32)];
    let per_workgroup = rows_per_workgroup(ctx);
    // The GPU family's partial sums of the parameter gradients: dgamma's, then dbeta's, in a
    // scratch buffer of the context (checked before anything is recorded).
    let blocks = rows.div_ceil(BLOCK_ROWS);
    let partial_len = blocks * cols * if d_beta.is_some() { 2 } else { 1 };
    let scratch = match per_workgroup {
        true => {
            let bytes = partial_len as u64 * 4;
            check_binding(ctx, "LayerNorm parameter-gradient partial sums", bytes)?;
            Some(ctx.scratch_buffer("layer_norm parameter-gradient partials", bytes)?)
        }
        false => None,
    };
    let (name, source, workgroups) = match per_workgroup {
        true => ("layer_norm_backward_rows", BACKWARD_ROWS, rows as u64),
        false => ("layer_norm_backward_cpu", BACKWARD, invocation_groups(rows)),
    };
    let params = BackwardParams {
        rows: rows as u32,
        cols: cols as u32,
        has_residual: residual.is_some() as u32,
        grid_x: ctx.grid_2d(workgroups)?.0,
    };
    // The parameter gradients' grids, before anything is recorded: the partial sums' is the
    // largest (blocks x columns invocations; the column sums have one per column).
    grid_x(ctx, blocks * cols)?;
    // dx and the parameter gradients in one pass: independent dispatches over rows and columns.
    let mut pass = ctx.begin_pass(encoder, "layer_norm_backward");
    encode_workgroups_in(
        ctx,
        &mut pass,
        SimpleKernel {
            name,
            source,
            constants: &centered,
        },
        bytemuck::bytes_of(&params),
        &[x, gamma, stats, dy, dx, residual.unwrap_or(dy)],
        workgroups,
    )?;
    // RMSNorm binds a dummy where d_beta would be (the shaders write only d_gamma then; d_gamma at
    // both would be two overlapping read-write bindings, which WebGPU refuses). Long row (block)
    // ranges are split under a loop budget.
    let no_beta = Region::elements(ctx.empty_storage_rw(0), 0, 2, 4);
    let d_beta: &dyn Bindable = match d_beta {
        Some(d_beta) => d_beta,
        None => &no_beta,
    };
    let Some(scratch) = scratch else {
        // Each column sums its rows in order.
        return encode_column_reduction_in(
            ctx,
            &mut pass,
            SimpleKernel {
                name: "layer_norm_param_grads_cpu",
                source: PARAM_GRADS,
                constants: &centered,
            },
            (rows, cols),
            1,
            &[x, stats, dy, d_gamma, d_beta],
        );
    };
    // Partial sums over blocks of BLOCK_ROWS rows, then each column adds its blocks in order.
    let partials = Region::elements(&scratch, 0, partial_len, 4);
    let params = PartialParams {
        rows: rows as u32,
        cols: cols as u32,
        blocks: blocks as u32,
        grid_x: grid_x(ctx, blocks * cols)?,
    };
    let mut constants = centered.to_vec();
    constants.push(("BLOCK_ROWS", BLOCK_ROWS as u32));
    encode_in(
        ctx,
        &mut pass,
        SimpleKernel {
            name: "layer_norm_param_partials",
            source: PARAM_PARTIALS,
            constants: &constants,
        },
        bytemuck::bytes_of(&params),
        &[x, stats, dy, &partials],
        blocks * cols,
    )?;
    encode_column_reduction_in(
        ctx,
        &mut pass,
        SimpleKernel {
            name: "layer_norm_param_sums",
            source: PARAM_SUMS,
            constants: &centered,
        },
        (blocks, cols),
        2,
        &[&partials, d_gamma, d_beta],
    )
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    let forward = uniform_layout!(
        "layer_norm_forward_cpu",
        "Params",
        RowParams {
            rows,
            cols,
            eps,
            grid_x
        }
    );
    let backward = uniform_layout!(
        "layer_norm_backward_cpu",
        "Params",
        BackwardParams {
            rows,
            cols,
            has_residual,
            grid_x
        }
    );
    let mut layouts = forward.also_read_by(&["layer_norm_forward_rows"]);
    layouts.extend(backward.also_read_by(&["layer_norm_backward_rows"]));
    layouts.push(uniform_layout!(
        "layer_norm_param_partials",
        "Params",
        PartialParams {
            rows,
            cols,
            blocks,
            grid_x
        }
    ));
    layouts
}
