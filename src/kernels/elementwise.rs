//! Elementwise ops: activations (`shaders/activation_{forward,backward}.wgsl`, ReLU and tanh-GELU)
//! and the residual sum (`shaders/add.wgsl`). CPU reference: [`crate::reference::elementwise`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_tensors};
use crate::kernels::dispatch::{encode, grid_x};
use crate::tensor::GpuTensor;

const ACTIVATION_FORWARD: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/activation_forward.wgsl")
);
const ACTIVATION_BACKWARD: &str = concat!(
    include_str!("../../shaders/activation_common.wgsl"),
    include_str!("../../shaders/activation_backward.wgsl")
);
const ADD: &str = include_str!("../../shaders/add.wgsl");

/// The elementwise shaders by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![
        ("activation_forward", ACTIVATION_FORWARD.to_string()),
        ("activation_backward", ACTIVATION_BACKWARD.to_string()),
        ("add", ADD.to_string()),
    ]
}

pub use crate::spec::Activation;

impl Activation {
    /// The `ACT_*` code of `activation_common.wgsl`.
    pub(crate) fn code(self) -> u32 {
        match self {
            Activation::Relu => 1,
            Activation::Gelu => 2,
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
        grid_x: grid_x(t.len()),
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
        "activation_forward",
        ACTIVATION_FORWARD,
        &[("ACTIVATION", kind.code())],
        bytemuck::bytes_of(&p),
        &[x, y],
        x.len(),
    );
    Ok(())
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
        "activation_backward",
        ACTIVATION_BACKWARD,
        &[("ACTIVATION", kind.code())],
        bytemuck::bytes_of(&p),
        &[x, dy, dx],
        x.len(),
    );
    Ok(())
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
        "add",
        ADD,
        &[],
        bytemuck::bytes_of(&p),
        &[a, b, out],
        a.len(),
    );
    Ok(())
}
