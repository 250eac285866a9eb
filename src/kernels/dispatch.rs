//! Recording of the simple kernels (one invocation per row, column or element): a cached pipeline, a
//! uniform parameter block at binding 0 and whole tensors from binding 1 on, in one compute pass.

use crate::device::{Context, StorageBinding};
use crate::error::Result;
use crate::tensor::{GpuTensor, GpuTokens, Region};

/// What a simple kernel binds: a tensor's range of its buffer, or a whole buffer.
pub(crate) trait Bindable {
    fn bound_region(&self) -> Region<'_>;
}

impl Bindable for GpuTensor {
    fn bound_region(&self) -> Region<'_> {
        self.region()
    }
}

impl Bindable for wgpu::Buffer {
    fn bound_region(&self) -> Region<'_> {
        Region::whole(self)
    }
}

impl Bindable for Region<'_> {
    fn bound_region(&self) -> Region<'_> {
        *self
    }
}

impl Bindable for GpuTokens {
    fn bound_region(&self) -> Region<'_> {
        Region::whole(self.buffer())
    }
}

/// Invocations per workgroup of the simple kernels (`WG` in their shaders).
pub(crate) const WG: u32 = 64;

/// Workgroups of [`WG`] invocations covering `invocations` (at least one).
pub(crate) fn invocation_groups(invocations: usize) -> u64 {
    invocations.max(1).div_ceil(WG as usize) as u64
}

/// The `grid_x` a shader needs to linearise a 2-D grid covering `invocations`; an error where the
/// device cannot dispatch that many workgroups ([`Context::grid_2d`]).
pub(crate) fn grid_x(ctx: &Context, invocations: usize) -> Result<u32> {
    Ok(ctx.grid_2d(invocation_groups(invocations))?.0)
}

/// Splits a kernel's long loop of `steps` iterations into chunks that each stay within the context's
/// loop budget, assuming `cost_per_step` loop iterations per step (inner loops counted as if not
/// unrolled) plus `fixed_cost` for set-up and output; chunk lengths are multiples of `align`.
pub(crate) fn loop_chunks(
    ctx: &Context,
    steps: usize,
    cost_per_step: usize,
    fixed_cost: usize,
    align: usize,
) -> Vec<(u32, u32)> {
    let per_chunk = match ctx.loop_budget() {
        Some(budget) => {
            let room = (budget as usize).saturating_sub(fixed_cost) / cost_per_step.max(1);
            (room / align * align).max(align)
        }
        None => steps.max(1),
    };
    (0..steps.max(1))
        .step_by(per_chunk)
        .map(|begin| (begin as u32, (begin + per_chunk).min(steps) as u32))
        .collect()
}

/// A simple kernel's pipeline: its name (and pass label), WGSL and override constants (`WG` is
/// added).
#[derive(Clone, Copy)]
pub(crate) struct SimpleKernel<'a> {
    pub(crate) name: &'static str,
    pub(crate) source: &'static str,
    pub(crate) constants: &'a [(&'static str, u32)],
}

/// Records `kernel` over at least `invocations` invocations, in a compute pass of its own; nothing
/// where the device cannot dispatch that many workgroups (the error).
pub(crate) fn encode(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    kernel: SimpleKernel<'_>,
    params: &[u8],
    buffers: &[&dyn Bindable],
    invocations: usize,
) -> Result<()> {
    let grid = ctx.grid_2d(invocation_groups(invocations))?;
    let mut pass = ctx.begin_pass(encoder, kernel.name);
    record(ctx, &mut pass, kernel, params, buffers, grid);
    Ok(())
}

/// [`encode`] into an open compute pass: kernels that record many independent dispatches (one per
/// parameter tensor) share one pass.
pub(crate) fn encode_in(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    kernel: SimpleKernel<'_>,
    params: &[u8],
    buffers: &[&dyn Bindable],
    invocations: usize,
) -> Result<()> {
    let workgroups = invocation_groups(invocations);
    encode_workgroups_in(ctx, pass, kernel, params, buffers, workgroups)
}

/// [`encode_in`] over `workgroups` workgroups of [`WG`] invocations, for kernels that give a
/// workgroup one row (laid out as [`Context::grid_2d`]; the shader's `grid_x` is its first value);
/// nothing where the device cannot dispatch them (the error).
pub(crate) fn encode_workgroups_in(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    kernel: SimpleKernel<'_>,
    params: &[u8],
    buffers: &[&dyn Bindable],
    workgroups: u64,
) -> Result<()> {
    let grid = ctx.grid_2d(workgroups.max(1))?;
    record(ctx, pass, kernel, params, buffers, grid);
    Ok(())
}

/// Records one dispatch of `kernel` over the 2-D grid `(gx, gy)` its caller checked.
fn record(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    kernel: SimpleKernel<'_>,
    params: &[u8],
    buffers: &[&dyn Bindable],
    (gx, gy): (u32, u32),
) {
    let SimpleKernel {
        name,
        source,
        constants,
    } = kernel;
    let mut all_constants = vec![("WG", WG)];
    all_constants.extend_from_slice(constants);
    let pipeline = ctx.pipeline(name, || source.to_string(), &all_constants);
    let storage: Vec<StorageBinding<'_>> = buffers
        .iter()
        .enumerate()
        .map(|(i, t)| t.bound_region().bind(i as u32 + 1))
        .collect();
    let bind_group = ctx.bind_group(&pipeline, name, params, &storage);
    pass.set_pipeline(&pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(gx, gy, 1);
}

/// Parameters of the column reductions (`column_sum.wgsl`, `layer_norm_param_grads.wgsl`,
/// `layer_norm_param_sums.wgsl`): one invocation per column adds rows `[row_begin, row_end)` in
/// order, adding to what an earlier dispatch wrote when `accumulate` is 1.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ColumnParams {
    rows: u32,
    cols: u32,
    row_begin: u32,
    row_end: u32,
    accumulate: u32,
    grid_x: u32,
    pad: [u32; 2],
}

/// Records column reduction `kernel` of a `[rows, cols]` matrix into `pass`: one dispatch per chunk
/// of rows that fits the context's loop budget (`cost_per_row` loop iterations a row), each after
/// the first adding to the sums; deterministic (rows in order, chunks in order). The grid is
/// checked before the first dispatch: on error nothing is recorded.
pub(crate) fn encode_column_reduction_in(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    kernel: SimpleKernel<'_>,
    (rows, cols): (usize, usize),
    cost_per_row: usize,
    buffers: &[&dyn Bindable],
) -> Result<()> {
    let grid = ctx.grid_2d(invocation_groups(cols))?;
    for (index, (begin, end)) in loop_chunks(ctx, rows, cost_per_row, 16, 1)
        .into_iter()
        .enumerate()
    {
        let params = ColumnParams {
            rows: rows as u32,
            cols: cols as u32,
            row_begin: begin,
            row_end: end,
            accumulate: (index > 0) as u32,
            grid_x: grid.0,
            pad: [0; 2],
        };
        record(
            ctx,
            pass,
            kernel,
            bytemuck::bytes_of(&params),
            buffers,
            grid,
        );
    }
    Ok(())
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    let column_sum = uniform_layout!(
        "column_sum",
        "Params",
        ColumnParams {
            rows,
            cols,
            row_begin,
            row_end,
            accumulate,
            grid_x,
            pad
        }
    );
    column_sum.also_read_by(&["layer_norm_param_grads_cpu", "layer_norm_param_sums"])
}
