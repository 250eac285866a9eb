//! [`GpuTensorF16`]: a contiguous f16 array (attention inputs and outputs, f16 GEMM operands).

use super::dense::GpuTensor;
use super::ids::{PackedSide, SeqLens};
use super::readback::read_f16;
use super::views::HeadsView;
use super::{check_fits, element_count, split_heads, DType, Region, TENSOR_ALIGN};
use crate::device::{Allocation, Context, ContextId};
use crate::error::{Error, Result};
use std::sync::Arc;

/// A contiguous f16 tensor on the GPU: inputs and outputs of the fused attention in half
/// precision (the kernels compute in f32). Other kernels take f32 [`GpuTensor`]s.
#[derive(Clone, Debug)]
pub struct GpuTensorF16 {
    buffer: wgpu::Buffer,
    /// First element inside `buffer` (a multiple of `2 * TENSOR_ALIGN`: 256 bytes).
    offset: usize,
    shape: Vec<usize>,
    _allocation: Option<Arc<Allocation>>,
    context: Option<ContextId>,
}

impl GpuTensorF16 {
    /// Uploads `data` as a tensor of `shape`.
    pub fn from_slice(ctx: &Context, data: &[half::f16], shape: &[usize]) -> Result<Self> {
        let n = element_count("shape", shape)?;
        if n != data.len() {
            return Err(Error::shape(
                "data",
                format!("has {} elements but shape {shape:?} needs {n}", data.len()),
            ));
        }
        let t = Self::zeros(ctx, shape)?;
        t.write(ctx, data)?;
        Ok(t)
    }

    /// Rounds `data` to f16 (to nearest even) and uploads it.
    pub fn from_f32(ctx: &Context, data: &[f32], shape: &[usize]) -> Result<Self> {
        let halves: Vec<half::f16> = data.iter().map(|&x| half::f16::from_f32(x)).collect();
        Self::from_slice(ctx, &halves, shape)
    }

    /// A zero-filled tensor of `shape`.
    pub fn zeros(ctx: &Context, shape: &[usize]) -> Result<Self> {
        let n = element_count("shape", shape)?;
        // Whole 4-byte words: storage bindings and copies are sized in them.
        let bytes = (n.max(2) as u64)
            .checked_mul(DType::F16.size())
            .ok_or_else(|| Error::shape("shape", format!("{shape:?} overflows u64 bytes")))?
            .next_multiple_of(4);
        let (buffer, allocation) = ctx.create_buffer("f16 tensor", bytes, GpuTensor::USAGE)?;
        Ok(Self {
            buffer,
            offset: 0,
            shape: shape.to_vec(),
            _allocation: Some(Arc::new(allocation)),
            context: Some(ctx.id()),
        })
    }

    /// Wraps a buffer the application owns: `STORAGE` usage (and `COPY_SRC` to read it back), at
    /// least `product(shape)` f16 values.
    pub fn from_buffer(buffer: wgpu::Buffer, shape: &[usize]) -> Result<Self> {
        Self::from_buffer_at(buffer, 0, shape)
    }

    /// Wraps `product(shape)` f16 values of a buffer the application owns from element `offset`,
    /// a multiple of `2 * TENSOR_ALIGN` (256 bytes, so the tensor binds on its own): one tensor of
    /// an arena. The buffer must hold the tensor's last 4-byte word.
    pub fn from_buffer_at(buffer: wgpu::Buffer, offset: usize, shape: &[usize]) -> Result<Self> {
        let n = element_count("shape", shape)?;
        if !offset.is_multiple_of(2 * TENSOR_ALIGN) {
            return Err(Error::shape(
                "offset",
                format!(
                    "is element {offset}; an f16 tensor must start at a multiple of {} elements \
                     (256 bytes, the storage binding alignment)",
                    2 * TENSOR_ALIGN
                ),
            ));
        }
        let end = offset
            .checked_add(n)
            .ok_or_else(|| Error::shape("offset", format!("{offset} + {n} overflows usize")))?;
        check_fits("buffer", &buffer, DType::F16, end.max(offset + 2), || {
            format!("shape {shape:?} from element {offset}")
        })?;
        Ok(Self {
            buffer,
            offset,
            shape: shape.to_vec(),
            _allocation: None,
            context: None,
        })
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Its element count.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer holding it (from byte 0).
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Size in bytes of the data (not of the backing buffer).
    pub fn size_bytes(&self) -> u64 {
        self.len() as u64 * DType::F16.size()
    }

    /// Its bytes, in whole 4-byte words (binding sizes are).
    pub(crate) fn region(&self) -> Region<'_> {
        let words = self.len().max(2).next_multiple_of(2);
        Region::elements(
            &self.buffer,
            self.offset,
            self.offset + words,
            DType::F16.size(),
        )
        .of_context(self.context)
    }

    /// Its values as the words that hold them, two halves each: what kernels that read f16
    /// without the `shader-f16` feature bind (`unpack2x16float`). Shaped as the tensor with its
    /// last dimension halved where that is even (a row of words per row of values), else flat (a
    /// whole word for an odd last value).
    pub fn words(&self) -> GpuTensor {
        let shape = match self.shape.split_last() {
            Some((&last, rest)) if last.is_multiple_of(2) && last > 0 => {
                [rest, &[last / 2]].concat()
            }
            _ => vec![self.len().max(2).div_ceil(2)],
        };
        GpuTensor::words_of(
            &self.buffer,
            self.offset / 2,
            &shape,
            self._allocation.clone(),
            self.context,
        )
    }

    /// First element of the tensor inside [`GpuTensorF16::buffer`].
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The context that allocated this tensor's buffer (`None` for a buffer the application
    /// wrapped).
    pub fn context(&self) -> Option<ContextId> {
        self.context
    }

    /// Overwrites the tensor's contents with `data` (same length).
    pub fn write(&self, ctx: &Context, data: &[half::f16]) -> Result<()> {
        if data.len() != self.len() {
            return Err(Error::shape(
                "data",
                format!("has {} elements, tensor holds {}", data.len(), self.len()),
            ));
        }
        ctx.check_owns("tensor", self.context)?;
        ctx.check_lost()?;
        if !data.is_empty() {
            // write_buffer copies whole words: pad an odd count with one zero.
            let mut words: Vec<half::f16> = data.to_vec();
            words.resize(data.len().next_multiple_of(2), half::f16::ZERO);
            ctx.queue().write_buffer(
                &self.buffer,
                self.offset as u64 * DType::F16.size(),
                bytemuck::cast_slice(&words),
            );
        }
        Ok(())
    }

    /// Reads the tensor back as f16, blocking until the GPU has finished.
    pub fn to_f16_vec(&self, ctx: &Context) -> Result<Vec<half::f16>> {
        crate::device::block_on("GpuTensorF16::to_f16_vec", self.to_f16_vec_async(ctx))
    }

    /// Async form of [`GpuTensorF16::to_f16_vec`] (what a browser must use).
    pub async fn to_f16_vec_async(&self, ctx: &Context) -> Result<Vec<half::f16>> {
        read_f16(ctx, &self.buffer, self.offset, self.len()).await
    }

    /// Reads the tensor back converted to f32 (exactly).
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        crate::device::block_on("GpuTensorF16::to_vec", self.to_vec_async(ctx))
    }

    /// Async form of [`GpuTensorF16::to_vec`].
    pub async fn to_vec_async(&self, ctx: &Context) -> Result<Vec<f32>> {
        let halves = self.to_f16_vec_async(ctx).await?;
        Ok(halves.into_iter().map(f32::from).collect())
    }

    /// A packed variable-length batch over this `[rows, heads, head_dim]` tensor: the sequences of
    /// `lens` one after another ([`HeadsView::packed`], [`SeqLens::packed`]).
    pub fn packed_heads(&self, lens: &SeqLens, side: PackedSide) -> Result<HeadsView> {
        HeadsView::packed_tensor(
            &self.buffer,
            DType::F16,
            self.offset,
            &self.shape,
            self.context,
        )?
        .packed(lens, side)
    }

    /// The tensor as a BSHD head view; it must be 4-D `[batch, seq, heads, head_dim]`.
    pub fn heads(&self) -> Result<HeadsView> {
        HeadsView::contiguous(
            &self.buffer,
            DType::F16,
            self.offset,
            &self.shape,
            self.context,
        )
    }

    /// Views a `[batch, seq, heads, head_dim]` split of a `[batch, seq, width]` tensor from column
    /// `column` (see [`GpuTensor::split_heads`]): Q, K and V of a packed f16 projection.
    pub fn split_heads(&self, column: usize, heads: usize, head_dim: usize) -> Result<HeadsView> {
        let view = split_heads(
            &self.buffer,
            DType::F16,
            self.offset,
            &self.shape,
            column,
            heads,
            head_dim,
        )?;
        Ok(view.of_context(self.context))
    }
}
