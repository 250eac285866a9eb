//! The matrix interface of the tensor-core kernels (the attention's `coop` family, the GEMM's
//! `coop` tiles): load, multiply-add and store 16x16 tiles, in two builds with the same functions,
//! `shaders/matrix/cooperative.wgsl` (wgpu's cooperative matrices: tensor cores, WMMA, simdgroup
//! matrices) and `shaders/matrix/portable.wgsl` (ordinary arithmetic, any adapter), so every test
//! runs a tensor-core kernel's tiling on a CPU driver. Which build a context runs is decided once,
//! by the attention's qualification on the device (`kernels::attention::matrix_build`), and for
//! the GEMM by its own too (`kernels::matmul::qualify_gemm_build`); this module keeps their
//! outcomes (`record_qualification`).

use crate::device::Context;
use crate::error::Result;
use crate::tensor::DType;

const COOPERATIVE: &str = include_str!("../../shaders/matrix/cooperative.wgsl");
const PORTABLE: &str = include_str!("../../shaders/matrix/portable.wgsl");

/// How the matrix interface is built on a context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MatrixBuild {
    /// wgpu's cooperative matrices (tensor cores), f16 16x16 tiles with f32 accumulation.
    Cooperative,
    /// The same tiles in ordinary arithmetic: any adapter, not fast.
    Portable,
}

impl MatrixBuild {
    /// `coop` or `portable`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cooperative => "coop",
            Self::Portable => "portable",
        }
    }

    /// The interface's WGSL, appended to a kernel that declares `mat_mem` (MatElem), `acc_mem`
    /// (f32) and, for the portable build, `SG` and `MAT_SLOTS`.
    pub(crate) fn interface(self) -> &'static str {
        match self {
            Self::Cooperative => COOPERATIVE,
            Self::Portable => PORTABLE,
        }
    }

    /// The directive a kernel's source starts with for this build (after `enable f16;` where
    /// it has one): cooperative matrices' extension, or nothing.
    pub(crate) fn enable(self) -> &'static str {
        match self {
            Self::Cooperative => "enable wgpu_cooperative_matrix;\n",
            Self::Portable => "",
        }
    }
}

/// The element type of the staged tiles on `ctx`: f16 where the device has it (what tensor cores
/// take), else f32.
pub(crate) fn tile_element(ctx: &Context) -> DType {
    match ctx.device().features().contains(wgpu::Features::SHADER_F16) {
        true => DType::F16,
        false => DType::F32,
    }
}

/// A qualification's outcome as the reason it failed: the mismatch it found, or the error it
/// stopped on.
pub(crate) fn mismatch(outcome: Result<Option<String>>) -> Option<String> {
    match outcome {
        Ok(mismatch) => mismatch,
        Err(e) => Some(format!("its qualification failed: {e}")),
    }
}

/// Keeps whether kernel `key` qualified on `ctx` (`why_not` is `None`) with the line that says so,
/// `refused` or `passed` followed by the adapter's name and the reason, logs it, and returns
/// whether it passed.
pub(crate) fn record_qualification(
    ctx: &Context,
    key: &'static str,
    why_not: Option<String>,
    refused: &str,
    passed: &str,
) -> bool {
    let name = &ctx.report().name;
    let detail = match &why_not {
        Some(why) => format!("{refused} on {name}: {why}"),
        None => format!("{passed} on {name}"),
    };
    log::info!("wgpu-attention: {detail}");
    ctx.set_qualification(key, why_not.is_none(), detail);
    why_not.is_none()
}
