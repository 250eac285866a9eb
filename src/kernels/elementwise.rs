//! Elementwise ops: activations (`shaders/activation_{forward,backward}.wgsl`: ReLU, tanh-GELU, SiLU),
//! gated activations (`shaders/gated_activation_{forward,backward}.wgsl`: SwiGLU, GeGLU) and the
//! residual sum (`shaders/add.wgsl`), and the f16 copy of an f32 tensor (`shaders/cast_f16.wgsl`).
//! CPU reference: [`crate::reference::elementwise`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_tensors};
use crate::kernels::dispatch::{encode, grid_x, SimpleKernel};
use crate::tensor::{GpuTensor, GpuTensorF16};

const ACTIVATION_FORWARD: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/activation_forward.wgsl")
);
const ACTIVATION_BACKWARD: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/activation_backward.wgsl")
);
const ADD: &str = include_str!("../../shaders/add.wgsl");
const CAST_F16: &str = include_str!("../../shaders/cast_f16.wgsl");
const GATED_FORWARD: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/gated_activation_forward.wgsl")
);
const GATED_BACKWARD: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/gated_activation_backward.wgsl")
);

/// The elementwise shaders by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![
        ("activation_forward", ACTIVATION_FORWARD.to_string()),
        ("activation_backward", ACTIVATION_BACKWARD.to_string()),
        ("add", ADD.to_string()),
        ("cast_f16", CAST_F16.to_string()),
        ("gated_activation_forward", GATED_FORWARD.to_string()),
        ("gated_activation_backward", GATED_BACKWARD.to_string()),
    ]
}

pub use crate::spec::Activation;

impl Activation {
    /// The `ACT_*` code of `activation_common.wgsl`.
    pub(crate) fn code(self) -> u32 {
        match self {
            Activation::Relu => 1,
            Activation::Gelu => 2,
            Activation::Silu => 3,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    len: u32,
    grid_x: u32,
}

fn params(ctx: &Context, arg: &'static str, t: &GpuTensor) -> Result<Params> {
    if t.is_empty() || t.len() > u32::MAX as usize {
        return Err(Error::shape(
            arg,
            format!("has {} elements; it needs 1 to 2^32 - 1", t.len()),
        ));
    }
    check_binding(ctx, arg, t.size_bytes())?;
    Ok(Params {
        len: t.len() as u32,
        grid_x: grid_x(ctx, t.len())?,
    })
}

fn same_shape(arg: &'static str, t: &GpuTensor, like: &GpuTensor) -> Result<()> {
    if t.shape() != like.shape() {
        return Err(Error::shape(
            arg,
            format!("has shape {:?}, expected {:?}", t.shape(), like.shape()),
        ));
    }
    Ok(())
}

/// `y = f(x)` into a new tensor, submitted.
pub fn activation_forward(ctx: &Context, kind: Activation, x: &GpuTensor) -> Result<GpuTensor> {
    let y = GpuTensor::uninit(ctx, "activation y", x.shape())?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    activation_forward_into(ctx, &mut encoder, kind, x, &y)?;
    ctx.submit(encoder)?;
    Ok(y)
}

/// Records `y = act(x)` elementwise.
pub fn activation_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    kind: Activation,
    x: &GpuTensor,
    y: &GpuTensor,
) -> Result<()> {
    let p = params(ctx, "x", x)?;
    same_shape("y", y, x)?;
    check_tensors(ctx, &[("y", y)], &[("x", x)])?;
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "activation_forward",
            source: ACTIVATION_FORWARD,
            constants: &[("ACTIVATION", kind.code())],
        },
        bytemuck::bytes_of(&p),
        &[x, y],
        x.len(),
    )
}

/// `dx = dy * f'(x)` into a new tensor, submitted.
pub fn activation_backward(
    ctx: &Context,
    kind: Activation,
    x: &GpuTensor,
    dy: &GpuTensor,
) -> Result<GpuTensor> {
    let dx = GpuTensor::uninit(ctx, "activation dx", x.shape())?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    activation_backward_into(ctx, &mut encoder, kind, x, dy, &dx)?;
    ctx.submit(encoder)?;
    Ok(dx)
}

/// Records `dx = act'(x) * dy` elementwise.
pub fn activation_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    kind: Activation,
    x: &GpuTensor,
    dy: &GpuTensor,
    dx: &GpuTensor,
) -> Result<()> {
    let p = params(ctx, "x", x)?;
    same_shape("dy", dy, x)?;
    same_shape("dx", dx, x)?;
    check_tensors(ctx, &[("dx", dx)], &[("x", x), ("dy", dy)])?;
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "activation_backward",
            source: ACTIVATION_BACKWARD,
            constants: &[("ACTIVATION", kind.code())],
        },
        bytemuck::bytes_of(&p),
        &[x, dy, dx],
        x.len(),
    )
}

/// `a + b` into a new tensor, submitted.
pub fn add(ctx: &Context, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
    let out = GpuTensor::uninit(ctx, "add out", a.shape())?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    add_into(ctx, &mut encoder, a, b, &out)?;
    ctx.submit(encoder)?;
    Ok(out)
}

/// Records `out = a + b` elementwise (same shapes).
pub fn add_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    a: &GpuTensor,
    b: &GpuTensor,
    out: &GpuTensor,
) -> Result<()> {
    let p = params(ctx, "a", a)?;
    same_shape("b", b, a)?;
    same_shape("out", out, a)?;
    check_tensors(ctx, &[("out", out)], &[("a", a), ("b", b)])?;
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "add",
            source: ADD,
            constants: &[],
        },
        bytemuck::bytes_of(&p),
        &[a, b, out],
        a.len(),
    )
}

/// Records `out = f16(x)` elementwise (same shapes), rounded to nearest as the device converts:
/// the f16 copy of f32 values, e.g. a mixed-precision layer's weight copy. Needs `SHADER_F16`.
pub fn cast_f16_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    out: &GpuTensorF16,
) -> Result<()> {
    ctx.require_f16("cast_f16_into", "; the GL back end has none")?;
    let p = params(ctx, "x", x)?;
    if out.shape() != x.shape() {
        return Err(Error::shape(
            "out",
            format!("has shape {:?}, expected {:?}", out.shape(), x.shape()),
        ));
    }
    crate::kernels::arguments::check_call(ctx, &[("out", out.region())], &[("x", x.region())])?;
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "cast_f16",
            source: CAST_F16,
            constants: &[],
        },
        bytemuck::bytes_of(&p),
        &[x, &out.region()],
        x.len(),
    )
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct GatedParams {
    rows: u32,
    width: u32,
    grid_x: u32,
    pad: u32,
}

/// Rows and the gated width `F` of `gate_up [.., 2 F]`, and the shape of `y [.., F]`.
fn gated_shape(ctx: &Context, gate_up: &GpuTensor) -> Result<(GatedParams, Vec<usize>)> {
    let last = *gate_up.shape().last().unwrap_or(&0);
    if last == 0 || !last.is_multiple_of(2) || gate_up.len() > u32::MAX as usize {
        return Err(Error::shape(
            "gate_up",
            format!(
                "has shape {:?}; its last dim must be 2 F > 0 (gate then up), under 2^32 elements",
                gate_up.shape()
            ),
        ));
    }
    check_binding(ctx, "gate_up", gate_up.size_bytes())?;
    let width = last / 2;
    let rows = gate_up.len() / last;
    let mut shape = gate_up.shape().to_vec();
    *shape.last_mut().expect("non-empty shape") = width;
    let params = GatedParams {
        rows: rows as u32,
        width: width as u32,
        grid_x: grid_x(ctx, rows * width)?,
        pad: 0,
    };
    Ok((params, shape))
}

/// Records the gated activation `y = act(gate) * up` of a gated feed-forward block (SwiGLU with
/// [`Activation::Silu`], GeGLU with [`Activation::Gelu`]): each row of `gate_up [.., 2 F]` is the
/// gate projection then the up projection; `y` is `[.., F]`.
pub fn gated_activation_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    kind: Activation,
    gate_up: &GpuTensor,
    y: &GpuTensor,
) -> Result<()> {
    let (p, y_shape) = gated_shape(ctx, gate_up)?;
    if y.shape() != y_shape {
        return Err(Error::shape(
            "y",
            format!("has shape {:?}, expected {y_shape:?}", y.shape()),
        ));
    }
    check_tensors(ctx, &[("y", y)], &[("gate_up", gate_up)])?;
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "gated_activation_forward",
            source: GATED_FORWARD,
            constants: &[("ACTIVATION", kind.code())],
        },
        bytemuck::bytes_of(&p),
        &[gate_up, y],
        y.len(),
    )
}

/// Records the backward of [`gated_activation_forward_into`]: `d_gate = dy * up * act'(gate)` and
/// `d_up = dy * act(gate)` into `d_gate_up`, laid out as `gate_up`.
pub fn gated_activation_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    kind: Activation,
    gate_up: &GpuTensor,
    dy: &GpuTensor,
    d_gate_up: &GpuTensor,
) -> Result<()> {
    let (p, y_shape) = gated_shape(ctx, gate_up)?;
    if dy.shape() != y_shape {
        return Err(Error::shape(
            "dy",
            format!("has shape {:?}, expected {y_shape:?}", dy.shape()),
        ));
    }
    same_shape("d_gate_up", d_gate_up, gate_up)?;
    check_tensors(
        ctx,
        &[("d_gate_up", d_gate_up)],
        &[("gate_up", gate_up), ("dy", dy)],
    )?;
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "gated_activation_backward",
            source: GATED_BACKWARD,
            constants: &[("ACTIVATION", kind.code())],
        },
        bytemuck::bytes_of(&p),
        &[gate_up, dy, d_gate_up],
        dy.len(),
    )
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    let elements = uniform_layout!("activation_forward", "Params", Params { len, grid_x });
    let gated = uniform_layout!(
        "gated_activation_forward",
        "Params",
        GatedParams {
            rows,
            width,
            grid_x,
            pad
        }
    );
    let mut layouts = elements.also_read_by(&["activation_backward", "add", "cast_f16"]);
    layouts.extend(gated.also_read_by(&["gated_activation_backward"]));
    layouts
}
