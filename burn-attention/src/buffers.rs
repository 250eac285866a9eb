//! burn's tensors as the kernels' views: the wgpu buffer under a `CubeTensor` (no copy), its
//! layout as a [`HeadsView`] / [`BiasView`] / [`GpuTensor`], and new outputs in burn's memory pool.

use burn::backend::wgpu::{AutoCompiler, CubeTensor, WgpuResource};
use burn::tensor::{DType as BurnDType, Shape};
use burn_cubecl::kernel::into_contiguous;
use cubecl::wgpu::WgpuServer;
use cubecl_runtime::storage::ManagedResource;
use wgpu_attention::{BiasView, DType, GpuTensor, HeadsView};

use crate::{Error, Result};

/// A burn tensor's buffer, pinned: while this lives burn's pool neither frees nor moves the
/// allocation, so the kernels recorded against it may run.
pub(crate) struct Pinned {
    _resource: ManagedResource<WgpuResource>,
    buffer: wgpu::Buffer,
    /// The tensor's first element, counted in its elements.
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
    dtype: DType,
}

/// The element type the kernels read for a burn dtype.
pub(crate) fn kernel_dtype(arg: &'static str, dtype: BurnDType) -> Result<DType> {
    match dtype {
        BurnDType::F32 | BurnDType::Flex32 => Ok(DType::F32),
        BurnDType::F16 => Ok(DType::F16),
        other => Err(Error::DType {
            arg,
            found: format!("{other:?}"),
            message: "the fused kernels take f32 and f16 tensors".into(),
        }),
    }
}

impl Pinned {
    /// Pins `tensor`'s buffer. burn's pending work is flushed first by the caller
    /// ([`flush`]), so everything burn recorded before runs before what is recorded here.
    pub(crate) fn new(arg: &'static str, tensor: &CubeTensor) -> Result<Self> {
        let dtype = kernel_dtype(arg, tensor.dtype)?;
        let managed = tensor
            .client
            .get_resource::<WgpuServer<AutoCompiler>>(tensor.handle.clone())
            .map_err(|e| Error::Burn(format!("{arg}: {e}")))?;
        let resource = managed.resource();
        let element = dtype.size();
        if !resource.offset.is_multiple_of(element) {
            return Err(Error::Burn(format!(
                "{arg} starts at byte {} of its buffer, not on an element",
                resource.offset
            )));
        }
        Ok(Self {
            buffer: resource.buffer.clone(),
            offset: (resource.offset / element) as usize,
            shape: tensor.meta.shape().to_vec(),
            strides: tensor.meta.strides().to_vec(),
            dtype,
            _resource: managed,
        })
    }

    /// A `[B, H, L, D]` burn tensor (any strides, D contiguous) as the kernels' `[B, L, H, D]` view.
    pub(crate) fn heads(&self, arg: &'static str) -> Result<HeadsView> {
        let [b, h, l, d] = self.shape[..] else {
            return Err(shape_error(
                arg,
                &self.shape,
                "expected [batch, heads, seq, head_dim]",
            ));
        };
        let [sb, sh, sl, sd] = self.strides[..] else {
            unreachable!("strides have the shape's rank")
        };
        debug_assert!(
            sd == 1 || d == 1,
            "made contiguous in head_dim by `contiguous_rows`"
        );
        Ok(HeadsView::new_typed(
            self.buffer.clone(),
            self.dtype,
            self.offset,
            [b, l, h, d],
            [sb, sl, sh],
        )?)
    }

    /// A `[B or 1, H or 1, Lq, Lk]` burn tensor (any strides) as a score bias view.
    pub(crate) fn bias(&self) -> Result<BiasView> {
        let [b, h, lq, lk] = self.shape[..] else {
            return Err(shape_error(
                "bias",
                &self.shape,
                "expected [B or 1, H or 1, Lq, Lk]",
            ));
        };
        if self.dtype != DType::F32 {
            return Err(Error::DType {
                arg: "bias",
                found: format!("{:?}", self.dtype),
                message: "a score bias is f32".into(),
            });
        }
        let [sb, sh, sq, sk] = self.strides[..] else {
            unreachable!("strides have the shape's rank")
        };
        Ok(BiasView::new(
            self.buffer.clone(),
            self.offset,
            [b, h, lq, lk],
            [sb, sh, sq, sk],
        )?)
    }

    /// A contiguous f32 tensor (of a buffer position the kernels can bind on its own) as a
    /// [`GpuTensor`] of its shape.
    pub(crate) fn dense(&self, arg: &'static str) -> Result<GpuTensor> {
        if self.dtype != DType::F32 {
            return Err(Error::DType {
                arg,
                found: format!("{:?}", self.dtype),
                message: "expected f32".into(),
            });
        }
        debug_assert_eq!(self.strides, contiguous_strides(&self.shape));
        Ok(GpuTensor::from_buffer_at(
            self.buffer.clone(),
            self.offset,
            &self.shape,
        )?)
    }
}

/// [`Pinned::new`] of a tensor that may be absent.
pub(crate) fn pin_optional(
    arg: &'static str,
    tensor: Option<&CubeTensor>,
) -> Result<Option<Pinned>> {
    tensor.map(|t| Pinned::new(arg, t)).transpose()
}

/// Submits the work burn recorded on `tensor`'s device, so that the kernels submitted next run
/// after it on the queue.
pub(crate) fn flush(tensor: &CubeTensor) -> Result<()> {
    tensor
        .client
        .flush()
        .map_err(|e| Error::Burn(format!("flush: {e}")))
}

/// `tensor` with a contiguous last dimension (the kernels' rows): unchanged when it has one,
/// otherwise a contiguous copy made by burn.
pub(crate) fn contiguous_rows(tensor: CubeTensor) -> CubeTensor {
    let shape = tensor.meta.shape();
    let last = shape.num_dims() - 1;
    match tensor.meta.strides()[last] == 1 || shape[last] == 1 {
        true => tensor,
        false => into_contiguous(tensor),
    }
}

/// `tensor` contiguous and at a position of its buffer a kernel binding can start at (256 bytes),
/// as the kernels' dense tensors (sinks, a relative table) must be: a copy in a buffer of its own
/// when it is not (these are small; burn's pools pack tensors at finer offsets).
pub(crate) fn contiguous_aligned(arg: &'static str, tensor: CubeTensor) -> Result<CubeTensor> {
    let contiguous = tensor.meta.strides()[..] == contiguous_strides(tensor.meta.shape())[..];
    let element = kernel_dtype(arg, tensor.dtype)?.size() as usize;
    let aligned = (Pinned::new(arg, &tensor)?.offset * element).is_multiple_of(BINDING_ALIGN);
    Ok(match contiguous && aligned {
        true => tensor,
        false => {
            let client = tensor.client.clone();
            client.memory_dedicated_allocation(tensor, |t| t.copy())
        }
    })
}

/// The offset alignment of a storage binding the kernels make of a dense tensor.
const BINDING_ALIGN: usize = wgpu_attention::tensor::TENSOR_ALIGN * 4;

/// A new, uninitialised tensor of `shape` on `like`'s device, in a wgpu buffer of its own.
///
/// burn's pools place many tensors in one wgpu buffer, and wgpu tracks usage per buffer: an output
/// sharing a buffer with an input of the same dispatch (read-only and read-write bindings of one
/// buffer) is a validation error. So outputs get a dedicated allocation (burn's
/// `memory_dedicated_allocation`, returned to the driver when the tensor is dropped); the inputs
/// stay where they are.
pub(crate) fn empty(like: &CubeTensor, shape: &[usize], dtype: BurnDType) -> CubeTensor {
    let elements: usize = shape.iter().product();
    let bytes = elements.max(1) * dtype.size();
    let handle = (like.client).memory_dedicated_allocation(bytes, |bytes| like.client.empty(bytes));
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape.to_vec()),
        handle,
        dtype,
    )
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

pub(crate) fn shape_error(arg: &'static str, shape: &[usize], message: &str) -> Error {
    Error::Shape {
        arg,
        found: shape.to_vec(),
        message: message.into(),
    }
}
