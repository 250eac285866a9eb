//! Linear layer `y = x W^T + b` (SPEC.md) on the strided GEMM (`shaders/matmul_strided.wgsl`, whose
//! strides give the transposed forms the backward needs, `dx = dy W` and `dW = dy^T x`, without
//! copies) with its bias epilogue and optional activation and residual epilogues ([`Epilogue`]),
//! and the bias gradient `db = column sums of dy` (`shaders/column_sum.wgsl`, deterministic).
//! CPU reference: [`crate::reference::linear`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_call};
use crate::kernels::dispatch::{encode_column_reduction_in, grid_x, Bindable, SimpleKernel};
use crate::kernels::elementwise::Activation;
use crate::kernels::matmul::{
    check_gemm, encode_gemm, product_of_rows, takes_skinny_path, ActivationStep, Elements,
    Epilogue as GemmEpilogue, Gemm, Operand,
};
use crate::tensor::{GpuTensor, GpuTensorF16, Region};

const COLUMN_SUM: &str = include_str!("../../shaders/column_sum.wgsl");

/// The Linear-specific shaders by name, for the naga tests (the GEMM is listed with attention's).
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![("column_sum", COLUMN_SUM.to_string())]
}

/// Gradients of a Linear layer; `d_bias` when it has a bias.
#[derive(Clone, Debug)]
pub struct LinearGrads {
    /// At the input, `[rows, in]`.
    pub dx: GpuTensor,
    /// Of the weight, `[out, in]`.
    pub d_weight: GpuTensor,
    /// Of the bias, `[out]` (when the layer has one).
    pub d_bias: Option<GpuTensor>,
}

/// (rows, in, out) of `x [.., in]` against `weight [out, in]`, validated.
fn dims(
    ctx: &Context,
    x: &GpuTensor,
    weight: &GpuTensor,
    bias: Option<&GpuTensor>,
) -> Result<(usize, usize, usize)> {
    dims_of(
        ctx,
        (x.shape(), x.size_bytes()),
        (weight.shape(), weight.size_bytes()),
        bias,
    )
}

/// [`dims`] from the shapes and byte sizes of `x` and `weight` (either element type).
fn dims_of(
    ctx: &Context,
    (x_shape, x_bytes): (&[usize], u64),
    (w_shape, w_bytes): (&[usize], u64),
    bias: Option<&GpuTensor>,
) -> Result<(usize, usize, usize)> {
    let x_len: usize = x_shape.iter().product();
    let &[out_f, in_f] = w_shape else {
        return Err(Error::shape(
            "weight",
            format!("has shape {w_shape:?}; expected [out, in]"),
        ));
    };
    if x_shape.last() != Some(&in_f) || x_len == 0 || in_f == 0 || out_f == 0 {
        return Err(Error::shape(
            "x",
            format!(
                "has shape {x_shape:?}; its last dimension must be the weight's in features {in_f}"
            ),
        ));
    }
    if let Some(b) = bias {
        if b.shape() != [out_f] {
            return Err(Error::shape(
                "bias",
                format!("has shape {:?}, expected [{out_f}]", b.shape()),
            ));
        }
    }
    let rows = x_len / in_f;
    if rows * out_f > u32::MAX as usize || x_len > u32::MAX as usize {
        return Err(Error::Unsupported {
            arg: "Linear elements",
            value: (rows * out_f.max(in_f)) as u64,
            limit: u32::MAX as u64,
            hint: "",
        });
    }
    for (arg, bytes) in [("x", x_bytes), ("weight", w_bytes)] {
        check_binding(ctx, arg, bytes)?;
    }
    Ok((rows, in_f, out_f))
}

/// The shape of `x`'s Linear output: its last dimension replaced by `features`.
fn out_shape(x: &[usize], features: usize) -> Vec<usize> {
    let mut s = x.to_vec();
    *s.last_mut().expect("validated non-empty") = features;
    s
}

/// `x W^T + b` into a new tensor, submitted.
pub fn linear_forward(
    ctx: &Context,
    x: &GpuTensor,
    weight: &GpuTensor,
    bias: Option<&GpuTensor>,
) -> Result<GpuTensor> {
    let (_, _, out_f) = dims(ctx, x, weight, bias)?;
    let y = GpuTensor::uninit(ctx, "linear y", &out_shape(x.shape(), out_f))?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    linear_forward_into(ctx, &mut encoder, x, weight, bias, &y)?;
    ctx.submit(encoder)?;
    Ok(y)
}

/// Records `y = x W^T + b` (`W [out, in]`) into `y`.
pub fn linear_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    weight: &GpuTensor,
    bias: Option<&GpuTensor>,
    y: &GpuTensor,
) -> Result<()> {
    linear_forward_epilogue_into(ctx, encoder, x, weight, bias, Epilogue::default(), y)
}

/// What a Linear GEMM applies to its result before storing it, instead of a pass of its own.
///
/// Forward, `z = x W^T + b`: `y = act(z) + residual`, and `pre` receives `z` (what the activation's
/// backward reads). Backward, on the input gradient of a layer whose input is `x = act(pre)`:
/// `dx = (dy W) * act'(pre) + residual`, the activation's backward fused into the GEMM.
/// `pre` and `residual` have the shape of the output (`y`, or `dx`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Epilogue<'a> {
    /// Apply this activation to the output, keeping the pre-activation in the tensor given.
    pub activation: Option<(Activation, &'a GpuTensor)>,
    /// Add this tensor (same shape as the output) to the result.
    pub residual: Option<&'a GpuTensor>,
}

impl<'a> Epilogue<'a> {
    /// Validates `pre` and `residual` against the output's shape and the buffers the GEMM binds.
    fn check(&self, out_arg: &'static str, out: &[usize], bound: &[&GpuTensor]) -> Result<()> {
        let parts = [
            ("pre", self.activation.map(|(_, pre)| pre)),
            ("residual", self.residual),
        ];
        for (arg, t) in parts {
            let Some(t) = t else { continue };
            if t.shape() != out {
                return Err(Error::shape(
                    arg,
                    format!(
                        "has shape {:?}, expected {out:?} (that of {out_arg})",
                        t.shape()
                    ),
                ));
            }
        }
        if let Some((_, pre)) = self.activation {
            // Bound read-write: it may share its buffer with nothing else the GEMM binds.
            if bound
                .iter()
                .chain(self.residual.as_ref())
                .any(|t| t.buffer() == pre.buffer())
            {
                return Err(Error::shape(
                    "pre",
                    format!("shares a buffer with {out_arg}, an input or the residual"),
                ));
            }
        }
        if self
            .residual
            .is_some_and(|r| r.buffer() == bound[0].buffer())
        {
            return Err(Error::shape(
                "residual",
                format!("shares a buffer with {out_arg}; write to a separate tensor"),
            ));
        }
        Ok(())
    }

    fn gemm(&self, bias: Option<&'a GpuTensor>, step: ActivationStep) -> GemmEpilogue<'a> {
        GemmEpilogue {
            bias: bias.map(GpuTensor::region),
            activation: self
                .activation
                .map(|(kind, pre)| (kind, step, pre.region())),
            residual: self.residual.map(GpuTensor::region),
        }
    }
}

/// [`linear_forward_into`] with an [`Epilogue`]: `y = act(x W^T + b) + residual` in one GEMM.
pub fn linear_forward_epilogue_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    weight: &GpuTensor,
    bias: Option<&GpuTensor>,
    epilogue: Epilogue<'_>,
    y: &GpuTensor,
) -> Result<()> {
    forward_with(ctx, encoder, x, Weight::F32(weight), bias, epilogue, y)
}

/// [`linear_forward_epilogue_into`] in mixed precision (SPEC.md): the product takes `x` rounded to
/// f16 as it reads it and `weight`, the f16 copy of the layer's f32 weight, with f32 accumulation;
/// bias, epilogue and `y` are f32. What PyTorch's autocast gives a Linear layer, with half the
/// weight's memory traffic and the operands tensor cores take. Needs `SHADER_F16`
/// ([`Error::MissingFeature`] elsewhere, e.g. GL).
pub fn linear_forward_mixed_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    weight: &GpuTensorF16,
    bias: Option<&GpuTensor>,
    epilogue: Epilogue<'_>,
    y: &GpuTensor,
) -> Result<()> {
    check_f16(ctx)?;
    forward_with(ctx, encoder, x, Weight::F16(weight), bias, epilogue, y)
}

/// A Linear layer's weight as its products read it: the f32 weight, or in mixed precision its f16
/// copy.
#[derive(Clone, Copy)]
enum Weight<'a> {
    F32(&'a GpuTensor),
    F16(&'a GpuTensorF16),
}

impl<'a> Weight<'a> {
    fn shape(self) -> &'a [usize] {
        match self {
            Weight::F32(w) => w.shape(),
            Weight::F16(w) => w.shape(),
        }
    }

    fn size_bytes(self) -> u64 {
        match self {
            Weight::F32(w) => w.size_bytes(),
            Weight::F16(w) => w.size_bytes(),
        }
    }

    fn region(self) -> Region<'a> {
        match self {
            Weight::F32(w) => w.region(),
            Weight::F16(w) => w.region(),
        }
    }

    /// The element types of the products with this weight as B (`x W^T`, `dy W`), and of the
    /// weight gradient `dy^T x`, which does not read it.
    fn elements(self) -> (Elements, Elements) {
        match self {
            Weight::F32(_) => (Elements::F32, Elements::F32),
            Weight::F16(_) => (Elements::MIXED_F16_B, Elements::MIXED),
        }
    }
}

fn forward_with(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    weight: Weight<'_>,
    bias: Option<&GpuTensor>,
    epilogue: Epilogue<'_>,
    y: &GpuTensor,
) -> Result<()> {
    let (rows, in_f, out_f) = dims_of(
        ctx,
        (x.shape(), x.size_bytes()),
        (weight.shape(), weight.size_bytes()),
        bias,
    )?;
    let expected = out_shape(x.shape(), out_f);
    if y.shape() != expected {
        return Err(Error::shape(
            "y",
            format!("has shape {:?}, expected {expected:?}", y.shape()),
        ));
    }
    let mut inputs = vec![("x", x.region()), ("weight", weight.region())];
    inputs.extend(bias.map(|b| ("bias", b.region())));
    check_call(ctx, &[("y", y.region())], &inputs)?;
    check_binding(ctx, "y", y.size_bytes())?;
    let mut bound = vec![y, x];
    bound.extend(bias);
    if let Weight::F32(w) = weight {
        bound.push(w);
    }
    epilogue.check("y", y.shape(), &bound)?;
    encode_forward(
        ctx,
        encoder,
        (rows, in_f, out_f),
        [x.region(), weight.region(), y.region()],
        epilogue.gemm(bias, ActivationStep::Forward),
        weight.elements().0,
    )
}

/// `x W^T + b` with f16 `x`, `weight` and result (f32 arithmetic and bias) into a new tensor,
/// submitted: half the memory traffic of the f32 Linear, for inference with f16 weights. Needs
/// `SHADER_F16` ([`Error::MissingFeature`] elsewhere, e.g. GL).
pub fn linear_forward_f16(
    ctx: &Context,
    x: &GpuTensorF16,
    weight: &GpuTensorF16,
    bias: Option<&GpuTensor>,
) -> Result<GpuTensorF16> {
    check_f16(ctx)?;
    let (_, _, out_f) = dims_of(
        ctx,
        (x.shape(), x.size_bytes()),
        (weight.shape(), weight.size_bytes()),
        bias,
    )?;
    let y = GpuTensorF16::zeros(ctx, &out_shape(x.shape(), out_f))?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    linear_forward_f16_into(ctx, &mut encoder, x, weight, bias, &y)?;
    ctx.submit(encoder)?;
    Ok(y)
}

/// [`linear_forward_f16`] recorded into `encoder`, writing `y`.
pub fn linear_forward_f16_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensorF16,
    weight: &GpuTensorF16,
    bias: Option<&GpuTensor>,
    y: &GpuTensorF16,
) -> Result<()> {
    check_f16(ctx)?;
    let (rows, in_f, out_f) = dims_of(
        ctx,
        (x.shape(), x.size_bytes()),
        (weight.shape(), weight.size_bytes()),
        bias,
    )?;
    let expected = out_shape(x.shape(), out_f);
    if y.shape() != expected {
        return Err(Error::shape(
            "y",
            format!("has shape {:?}, expected {expected:?}", y.shape()),
        ));
    }
    check_call(
        ctx,
        &[("y", y.region())],
        &[("x", x.region()), ("weight", weight.region())],
    )?;
    check_binding(ctx, "y", y.size_bytes())?;
    let epilogue = GemmEpilogue {
        bias: bias.map(GpuTensor::region),
        ..GemmEpilogue::NONE
    };
    encode_forward(
        ctx,
        encoder,
        (rows, in_f, out_f),
        [x.region(), weight.region(), y.region()],
        epilogue,
        Elements::F16,
    )
}

/// Records `y = x W^T` with its epilogue for validated sizes `(rows, in, out)`: the one GEMM of
/// every Linear forward, in either element type.
fn encode_forward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    (rows, in_f, out_f): (usize, usize, usize),
    [x, weight, y]: [Region<'_>; 3],
    epilogue: GemmEpilogue<'_>,
    elements: Elements,
) -> Result<()> {
    let mut pass = ctx.begin_pass(encoder, "linear_forward");
    let product = Gemm {
        epilogue,
        elements,
        ..product_of_rows(x, weight, y, [rows, out_f, in_f])
    };
    encode_gemm(ctx, &mut pass, &product)
}

fn check_f16(ctx: &Context) -> Result<()> {
    ctx.require_f16(
        "f16 Linear",
        "; the GL back end has none: use f32 tensors and linear_forward there",
    )
}

/// dx, dW (and db) of `y = x W^T + b` for the upstream gradient `dy`, into new tensors, submitted.
pub fn linear_backward(
    ctx: &Context,
    x: &GpuTensor,
    weight: &GpuTensor,
    dy: &GpuTensor,
    with_bias: bool,
) -> Result<LinearGrads> {
    let (_, in_f, out_f) = dims(ctx, x, weight, None)?;
    let grads = LinearGrads {
        dx: GpuTensor::uninit(ctx, "linear dx", x.shape())?,
        d_weight: GpuTensor::uninit(ctx, "linear d_weight", &[out_f, in_f])?,
        d_bias: if with_bias {
            Some(GpuTensor::uninit(ctx, "linear d_bias", &[out_f])?)
        } else {
            None
        },
    };
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    linear_backward_into(ctx, &mut encoder, x, weight, dy, &grads)?;
    ctx.submit(encoder)?;
    Ok(grads)
}

/// Records the Linear backward into `grads` (overwritten, not accumulated).
pub fn linear_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    weight: &GpuTensor,
    dy: &GpuTensor,
    grads: &LinearGrads,
) -> Result<()> {
    linear_backward_epilogue_into(ctx, encoder, x, weight, dy, grads, Epilogue::default())
}

/// [`linear_backward_into`] with an [`Epilogue`] on the input gradient:
/// `dx = (dy W) * act'(pre) + residual`, for a layer whose input is `x = act(pre)`.
pub fn linear_backward_epilogue_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    weight: &GpuTensor,
    dy: &GpuTensor,
    grads: &LinearGrads,
    dx_epilogue: Epilogue<'_>,
) -> Result<()> {
    backward_with(ctx, encoder, x, Weight::F32(weight), dy, grads, dx_epilogue)
}

/// [`linear_backward_epilogue_into`] in mixed precision (SPEC.md), the backward of
/// [`linear_forward_mixed_into`]: `dx = dy W` from `dy` rounded to f16 and the f16 weight copy,
/// `dW = dy^T x` from both rounded to f16, f32 accumulation and f32 gradients (`db` sums `dy` in
/// f32, within the same bound). Scale the loss ([`crate::kernels::loss_scale`]) so that small
/// gradients survive the rounding. Needs `SHADER_F16`.
pub fn linear_backward_mixed_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    weight: &GpuTensorF16,
    dy: &GpuTensor,
    grads: &LinearGrads,
    dx_epilogue: Epilogue<'_>,
) -> Result<()> {
    check_f16(ctx)?;
    backward_with(ctx, encoder, x, Weight::F16(weight), dy, grads, dx_epilogue)
}

fn backward_with(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    weight: Weight<'_>,
    dy: &GpuTensor,
    grads: &LinearGrads,
    dx_epilogue: Epilogue<'_>,
) -> Result<()> {
    let (rows, in_f, out_f) = dims_of(
        ctx,
        (x.shape(), x.size_bytes()),
        (weight.shape(), weight.size_bytes()),
        None,
    )?;
    let checks = [
        ("dy", dy.shape().to_vec(), out_shape(x.shape(), out_f)),
        ("dx", grads.dx.shape().to_vec(), x.shape().to_vec()),
        (
            "d_weight",
            grads.d_weight.shape().to_vec(),
            vec![out_f, in_f],
        ),
    ];
    for (arg, got, want) in checks {
        if got != want {
            return Err(Error::shape(
                arg,
                format!("has shape {got:?}, expected {want:?}"),
            ));
        }
    }
    if let Some(db) = &grads.d_bias {
        if db.shape() != [out_f] {
            return Err(Error::shape(
                "d_bias",
                format!("has shape {:?}, expected [{out_f}]", db.shape()),
            ));
        }
    }
    let mut outputs = vec![("dx", &grads.dx), ("d_weight", &grads.d_weight)];
    outputs.extend(grads.d_bias.as_ref().map(|db| ("d_bias", db)));
    let outputs: Vec<_> = outputs.iter().map(|(arg, t)| (*arg, t.region())).collect();
    let inputs = [
        ("x", x.region()),
        ("weight", weight.region()),
        ("dy", dy.region()),
    ];
    check_call(ctx, &outputs, &inputs)?;
    for (arg, t) in [("dy", dy), ("dx", &grads.dx), ("d_weight", &grads.d_weight)] {
        check_binding(ctx, arg, t.size_bytes())?;
    }
    let (products_with_weight, weight_grad) = weight.elements();
    // dW [out, in] = dy^T [out, rows] . x [rows, in], with db [out] = the row sums of dy^T in the
    // same dispatch unless the product takes the SKINNY path.
    let mut d_weight = Gemm {
        m: out_f as u32,
        n: in_f as u32,
        k: rows as u32,
        groups: 1,
        batch: 1,
        heads: 1,
        alpha: 1.0,
        a: (dy.region(), Operand::transposed(out_f)),
        b: (x.region(), Operand::row_major(in_f)),
        c: (grads.d_weight.region(), Operand::row_major(in_f)),
        epilogue: GemmEpilogue::NONE,
        row_sums: None,
        elements: weight_grad,
    };
    let fused_bias = grads
        .d_bias
        .as_ref()
        .filter(|_| !takes_skinny_path(ctx, &d_weight));
    d_weight.row_sums = fused_bias.map(GpuTensor::region);
    // Every dispatch's grid before the first is recorded (dx's is checked as it is recorded).
    check_gemm(ctx, &d_weight)?;
    if grads.d_bias.is_some() && fused_bias.is_none() {
        grid_x(ctx, out_f)?;
    }
    // dx and dW (and db) in one pass: independent dispatches reading dy.
    let mut pass = ctx.begin_pass(encoder, "linear_backward");
    {
        // dx [rows, in] = dy [rows, out] . W [out, in]
        encode_gemm(
            ctx,
            &mut pass,
            &Gemm {
                m: rows as u32,
                n: in_f as u32,
                k: out_f as u32,
                groups: 1,
                batch: 1,
                heads: 1,
                alpha: 1.0,
                a: (dy.region(), Operand::row_major(out_f)),
                b: (weight.region(), Operand::row_major(in_f)),
                c: (grads.dx.region(), Operand::row_major(in_f)),
                epilogue: dx_epilogue.gemm(None, ActivationStep::Grad),
                row_sums: None,
                elements: products_with_weight,
            },
        )?;
        encode_gemm(ctx, &mut pass, &d_weight)?;
    }
    if let (Some(db), None) = (&grads.d_bias, fused_bias) {
        encode_column_sum_in(ctx, &mut pass, dy, rows, out_f, db)?;
    }
    Ok(())
}

/// Records `sums[c] = sum over r of x[r, c]` of a row-major `[rows, cols]` matrix at the start of
/// `x`, rows added in order (deterministic): the bias gradient of a Linear layer, the relative
/// attention table's from its partial sums.
pub(crate) fn encode_column_sum(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &dyn Bindable,
    rows: usize,
    cols: usize,
    sums: &GpuTensor,
) -> Result<()> {
    grid_x(ctx, cols)?;
    let mut pass = ctx.begin_pass(encoder, "column_sum");
    encode_column_sum_in(ctx, &mut pass, x, rows, cols, sums)
}

/// [`encode_column_sum`] into an open pass.
pub(crate) fn encode_column_sum_in(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    x: &dyn Bindable,
    rows: usize,
    cols: usize,
    sums: &GpuTensor,
) -> Result<()> {
    encode_column_reduction_in(
        ctx,
        pass,
        SimpleKernel {
            name: "column_sum",
            source: COLUMN_SUM,
            constants: &[],
        },
        (rows, cols),
        1,
        &[x, sums],
    )
}
