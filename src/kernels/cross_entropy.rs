//! Softmax cross-entropy with an ignore index (SPEC.md): `shaders/cross_entropy_forward.wgsl` (loss
//! and lse per row), `cross_entropy_reduce.wgsl` (mean over counted rows, in row order) and
//! `cross_entropy_backward.wgsl` (d logits). CPU reference: [`crate::reference::cross_entropy`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_call};
use crate::kernels::dispatch::{encode, grid_x, SimpleKernel};
use crate::kernels::loss_scale::LossScale;
use crate::tensor::{GpuTensor, GpuTokens};

const FORWARD: &str = include_str!("../../shaders/cross_entropy_forward.wgsl");
const REDUCE: &str = include_str!("../../shaders/cross_entropy_reduce.wgsl");
const BACKWARD: &str = include_str!("../../shaders/cross_entropy_backward.wgsl");

/// The cross-entropy shaders by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![
        ("cross_entropy_forward", FORWARD.to_string()),
        ("cross_entropy_reduce", REDUCE.to_string()),
        ("cross_entropy_backward", BACKWARD.to_string()),
    ]
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    classes: u32,
    ignore_index: u32,
    grid_x: u32,
}

/// What the forward leaves for the backward: `loss [2]` = (mean loss, counted rows) and the per-row
/// loss and lse `[rows]`.
#[derive(Clone, Debug)]
pub struct CrossEntropyOutput {
    /// `[mean loss, counted targets]`.
    pub loss: GpuTensor,
    /// Each row's loss (0 for ignored targets).
    pub row_loss: GpuTensor,
    /// Each row's log-sum-exp, what the backward needs.
    pub row_lse: GpuTensor,
}

fn check(
    ctx: &Context,
    logits: &GpuTensor,
    targets: &GpuTokens,
    ignore_index: Option<u32>,
) -> Result<Params> {
    let classes = *logits.shape().last().unwrap_or(&0);
    let rows = logits.len().checked_div(classes).unwrap_or(0);
    if rows == 0 || classes == 0 || logits.len() > u32::MAX as usize {
        return Err(Error::shape(
            "logits",
            format!(
                "has shape {:?}; it needs [rows.., classes] with at least one of each",
                logits.shape()
            ),
        ));
    }
    if targets.len() != rows {
        return Err(Error::shape(
            "targets",
            format!("has {} ids for {rows} rows of logits", targets.len()),
        ));
    }
    if let Some((i, v)) = targets.first_out_of_range(classes as u32, ignore_index) {
        return Err(Error::shape(
            "targets",
            format!("entry {i} is {v}, not a class below {classes} nor the ignore index"),
        ));
    }
    // Rows loop over classes twice, the reduction over rows once; llvmpipe ends loops after 65535.
    if let Some(budget) = ctx.loop_budget() {
        for (arg, value, limit) in [
            ("classes", classes, budget as usize / 2),
            ("rows", rows, budget as usize),
        ] {
            if value > limit {
                return Err(Error::Unsupported {
                    arg,
                    value: value as u64,
                    limit: limit as u64,
                    hint: " on this driver (llvmpipe loop cap)",
                });
            }
        }
    }
    check_binding(ctx, "logits", logits.size_bytes())?;
    Ok(Params {
        rows: rows as u32,
        classes: classes as u32,
        ignore_index: ignore_index.unwrap_or(u32::MAX),
        grid_x: grid_x(ctx, rows)?,
    })
}

/// Mean cross-entropy of `logits [.., classes]` against `targets [..]`, rows whose target is
/// `ignore_index` excluded (padding), submitted.
pub fn cross_entropy_forward(
    ctx: &Context,
    logits: &GpuTensor,
    targets: &GpuTokens,
    ignore_index: Option<u32>,
) -> Result<CrossEntropyOutput> {
    let p = check(ctx, logits, targets, ignore_index)?;
    let out = CrossEntropyOutput {
        loss: GpuTensor::uninit(ctx, "cross_entropy loss", &[2])?,
        row_loss: GpuTensor::uninit(ctx, "cross_entropy row loss", &[p.rows as usize])?,
        row_lse: GpuTensor::uninit(ctx, "cross_entropy row lse", &[p.rows as usize])?,
    };
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    cross_entropy_forward_into(ctx, &mut encoder, logits, targets, ignore_index, &out)?;
    ctx.submit(encoder)?;
    Ok(out)
}

/// Records the loss of `logits [rows, classes]` against `targets` into `out` (see
/// `cross_entropy_forward`).
pub fn cross_entropy_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    logits: &GpuTensor,
    targets: &GpuTokens,
    ignore_index: Option<u32>,
    out: &CrossEntropyOutput,
) -> Result<()> {
    let p = check(ctx, logits, targets, ignore_index)?;
    let rows = p.rows as usize;
    let inputs = [("logits", logits.region()), ("targets", targets.region())];
    check_call(
        ctx,
        &[
            ("row_loss", out.row_loss.region()),
            ("row_lse", out.row_lse.region()),
        ],
        &inputs,
    )?;
    // The reduction reads the row losses it sums into `loss`.
    check_call(
        ctx,
        &[("loss", out.loss.region())],
        &[inputs[0], inputs[1], ("row_loss", out.row_loss.region())],
    )?;
    for (arg, t, shape) in [
        ("loss", &out.loss, vec![2]),
        ("row_loss", &out.row_loss, vec![rows]),
        ("row_lse", &out.row_lse, vec![rows]),
    ] {
        if t.shape() != shape {
            return Err(Error::shape(
                arg,
                format!("must be a separate tensor of shape {shape:?}"),
            ));
        }
    }
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "cross_entropy_forward",
            source: FORWARD,
            constants: &[],
        },
        bytemuck::bytes_of(&p),
        &[logits, targets, &out.row_loss, &out.row_lse],
        rows,
    )?;
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "cross_entropy_reduce",
            source: REDUCE,
            constants: &[],
        },
        bytemuck::bytes_of(&p),
        &[targets, &out.row_loss, &out.loss],
        1,
    )
}

/// d(mean loss)/d logits into a new tensor, submitted.
pub fn cross_entropy_backward(
    ctx: &Context,
    logits: &GpuTensor,
    targets: &GpuTokens,
    ignore_index: Option<u32>,
    forward: &CrossEntropyOutput,
) -> Result<GpuTensor> {
    let d_logits = GpuTensor::uninit(ctx, "cross_entropy d_logits", logits.shape())?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    cross_entropy_backward_into(
        ctx,
        &mut encoder,
        logits,
        targets,
        ignore_index,
        forward,
        &d_logits,
    )?;
    ctx.submit(encoder)?;
    Ok(d_logits)
}

/// Records `d_logits = (softmax(logits) - onehot(target)) / counted` for the targets that count, 0
/// for ignored ones.
pub fn cross_entropy_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    logits: &GpuTensor,
    targets: &GpuTokens,
    ignore_index: Option<u32>,
    forward: &CrossEntropyOutput,
    d_logits: &GpuTensor,
) -> Result<()> {
    LossGradient::new(logits, targets, ignore_index, forward).record(ctx, encoder, d_logits)
}

/// The loss gradient of a [`cross_entropy_forward_into`] call, recorded by
/// [`LossGradient::record`]: [`cross_entropy_backward_into`]'s inputs, and optionally the loss
/// scale of mixed-precision training ([`LossGradient::scaled`]).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LossGradient<'a> {
    /// `[rows, classes]`, as the forward took them.
    pub logits: &'a GpuTensor,
    /// `[rows]`.
    pub targets: &'a GpuTokens,
    /// Targets equal to it count for nothing.
    pub ignore_index: Option<u32>,
    /// The forward's output for these logits.
    pub forward: &'a CrossEntropyOutput,
    /// The loss scale `S`: the gradient recorded is that of `S * mean loss`, for the `S` the GPU
    /// state holds when the step runs (the optimizer unscales; see [`crate::kernels::loss_scale`]).
    pub scale: Option<&'a LossScale>,
}

impl<'a> LossGradient<'a> {
    /// The gradient of the mean loss.
    pub fn new(
        logits: &'a GpuTensor,
        targets: &'a GpuTokens,
        ignore_index: Option<u32>,
        forward: &'a CrossEntropyOutput,
    ) -> Self {
        Self {
            logits,
            targets,
            ignore_index,
            forward,
            scale: None,
        }
    }

    /// The same gradient times the loss scale where one is given.
    pub fn scaled(self, scale: Option<&'a LossScale>) -> Self {
        Self { scale, ..self }
    }

    /// Records the gradient into `d_logits` (`[rows, classes]`, a tensor of its own).
    pub fn record(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        d_logits: &GpuTensor,
    ) -> Result<()> {
        let &LossGradient {
            logits,
            targets,
            ignore_index,
            forward,
            scale,
        } = self;
        let p = check(ctx, logits, targets, ignore_index)?;
        check_call(
            ctx,
            &[("d_logits", d_logits.region())],
            &[("logits", logits.region()), ("targets", targets.region())],
        )?;
        if d_logits.shape() != logits.shape() {
            return Err(Error::shape(
                "d_logits",
                format!("must be a separate tensor of shape {:?}", logits.shape()),
            ));
        }
        if forward.row_lse.len() != p.rows as usize || forward.loss.len() != 2 {
            return Err(Error::shape(
                "forward",
                "is not the output of cross_entropy_forward for these logits",
            ));
        }
        let scale_buffer = scale.map_or(ctx.empty_storage(), LossScale::buffer);
        encode(
            ctx,
            encoder,
            SimpleKernel {
                name: "cross_entropy_backward",
                source: BACKWARD,
                constants: &[("LOSS_SCALED", scale.is_some() as u32)],
            },
            bytemuck::bytes_of(&p),
            &[
                logits,
                targets,
                &forward.row_lse,
                &forward.loss,
                d_logits,
                scale_buffer,
            ],
            p.rows as usize,
        )
    }
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    let forward = uniform_layout!(
        "cross_entropy_forward",
        "Params",
        Params {
            rows,
            classes,
            ignore_index,
            grid_x
        }
    );
    forward.also_read_by(&["cross_entropy_reduce", "cross_entropy_backward"])
}
