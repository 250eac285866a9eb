//! [`GpuTensor`]: a contiguous f32 array, alone in a buffer or a range of an arena.

use super::readback::read_buffer;
use super::{element_count, Region, F32, TENSOR_ALIGN};
use crate::device::{Allocation, Context, ContextId};
use crate::error::{Error, Result};
use std::sync::Arc;

/// A contiguous f32 tensor on the GPU: its own buffer, or a range of a shared one (a model's
/// parameter arena, see `wgpu_attention_transformer::layers::params::Params`) starting at a multiple of [`TENSOR_ALIGN`].
#[derive(Clone, Debug)]
pub struct GpuTensor {
    buffer: wgpu::Buffer,
    /// First element inside `buffer`.
    offset: usize,
    shape: Vec<usize>,
    /// Memory accounting of buffers this crate allocated (None for user buffers).
    _allocation: Option<Arc<Allocation>>,
    /// The context that allocated the buffer (None for user buffers).
    context: Option<ContextId>,
}
impl GpuTensor {
    /// Usage flags of buffers this crate allocates: kernels read and write them, and they can be
    /// copied to and from for upload and readback.
    pub const USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
        .union(wgpu::BufferUsages::COPY_SRC)
        .union(wgpu::BufferUsages::COPY_DST);

    /// Uploads `data` as a tensor of `shape`.
    pub fn from_slice(ctx: &Context, data: &[f32], shape: &[usize]) -> Result<Self> {
        let n = element_count("shape", shape)?;
        if n != data.len() {
            return Err(Error::shape(
                "data",
                format!("has {} elements but shape {shape:?} needs {n}", data.len()),
            ));
        }
        let t = Self::uninit(ctx, "tensor", shape)?;
        if !data.is_empty() {
            ctx.queue()
                .write_buffer(&t.buffer, 0, bytemuck::cast_slice(data));
        }
        Ok(t)
    }

    /// A zero-filled tensor of `shape`.
    pub fn zeros(ctx: &Context, shape: &[usize]) -> Result<Self> {
        // wgpu zero-initialises new buffers.
        Self::uninit(ctx, "zeros", shape)
    }

    pub(crate) fn uninit(ctx: &Context, label: &'static str, shape: &[usize]) -> Result<Self> {
        let n = element_count("shape", shape)?;
        // Zero-sized bindings are invalid; keep at least one element of backing store.
        let bytes = (n.max(1) as u64)
            .checked_mul(F32)
            .ok_or_else(|| Error::shape("shape", format!("{shape:?} overflows u64 bytes")))?;
        let (buffer, allocation) = ctx.create_buffer(label, bytes, Self::USAGE)?;
        Ok(Self {
            buffer,
            offset: 0,
            shape: shape.to_vec(),
            _allocation: Some(Arc::new(allocation)),
            context: Some(ctx.id()),
        })
    }

    /// Wraps a buffer the application owns. It must have `STORAGE` usage (and `COPY_SRC` for
    /// [`GpuTensor::to_vec`]) and hold at least `product(shape)` f32 values.
    pub fn from_buffer(buffer: wgpu::Buffer, shape: &[usize]) -> Result<Self> {
        Self::from_buffer_at(buffer, 0, shape)
    }

    /// Wraps `product(shape)` f32 values of a buffer the application owns, from element `offset`
    /// (a multiple of [`TENSOR_ALIGN`], so the tensor can be bound on its own): one tensor of an
    /// arena the application manages.
    pub fn from_buffer_at(buffer: wgpu::Buffer, offset: usize, shape: &[usize]) -> Result<Self> {
        let n = element_count("shape", shape)?;
        if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
            return Err(Error::shape(
                "buffer",
                format!("usage {:?} lacks STORAGE", buffer.usage()),
            ));
        }
        if !offset.is_multiple_of(TENSOR_ALIGN) {
            return Err(Error::shape(
                "offset",
                format!(
                    "is element {offset}; a tensor must start at a multiple of {TENSOR_ALIGN} \
                     elements (256 bytes, the storage binding alignment)"
                ),
            ));
        }
        let end = offset.checked_add(n.max(1));
        if end.is_none_or(|end| end as u64 * F32 > buffer.size()) {
            return Err(Error::shape(
                "buffer",
                format!(
                    "holds {} bytes but shape {shape:?} from element {offset} needs {}",
                    buffer.size(),
                    (offset as u64 + n.max(1) as u64) * F32
                ),
            ));
        }
        Ok(Self {
            buffer,
            offset,
            shape: shape.to_vec(),
            _allocation: None,
            context: None,
        })
    }

    /// Words of `shape` in `buffer` from word `offset`, accounted and owned as the tensor they
    /// hold (f16 values read as words).
    pub(crate) fn words_of(
        buffer: &wgpu::Buffer,
        offset: usize,
        shape: &[usize],
        allocation: Option<Arc<Allocation>>,
        context: Option<ContextId>,
    ) -> Self {
        Self {
            buffer: buffer.clone(),
            offset,
            shape: shape.to_vec(),
            _allocation: allocation,
            context,
        }
    }

    /// `shape` from element `offset` of `arena`'s buffer, accounted with it (a view into a
    /// parameter or activation arena).
    pub fn view_of(arena: &GpuTensor, offset: usize, shape: &[usize]) -> Result<Self> {
        let mut t = Self::from_buffer_at(arena.buffer.clone(), arena.offset + offset, shape)?;
        t._allocation = arena._allocation.clone();
        t.context = arena.context;
        Ok(t)
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

    /// The buffer holding the tensor, from element [`GpuTensor::offset`] on.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// First element of the tensor inside [`GpuTensor::buffer`] (0 unless it is a range of a
    /// shared buffer).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// [`GpuTensor::offset`] in bytes: where a buffer copy of the tensor starts.
    pub fn byte_offset(&self) -> u64 {
        self.offset as u64 * F32
    }

    /// Size in bytes of the data (not of the backing buffer).
    pub fn size_bytes(&self) -> u64 {
        self.len() as u64 * F32
    }

    /// The bytes the tensor occupies (at least one element's: a binding is never empty).
    pub(crate) fn region(&self) -> Region<'_> {
        Region::elements(&self.buffer, self.offset, self.offset + self.len(), F32)
            .of_context(self.context)
    }

    /// The context that allocated this tensor's buffer (`None` for a buffer the application
    /// wrapped).
    pub fn context(&self) -> Option<ContextId> {
        self.context
    }

    /// Whether the two tensors share memory (a kernel may not write one while reading the other).
    pub fn overlaps(&self, other: &GpuTensor) -> bool {
        self.region().overlaps(&other.region())
    }

    /// Overwrites the tensor's contents with `data` (same length).
    pub fn write(&self, ctx: &Context, data: &[f32]) -> Result<()> {
        if data.len() != self.len() {
            return Err(Error::shape(
                "data",
                format!("has {} elements, tensor holds {}", data.len(), self.len()),
            ));
        }
        // Another context's queue may be another device's: a wgpu error, not ours to cause.
        ctx.check_owns("tensor", self.context)?;
        ctx.check_lost()?;
        if !data.is_empty() {
            ctx.queue().write_buffer(
                &self.buffer,
                self.offset as u64 * F32,
                bytemuck::cast_slice(data),
            );
        }
        Ok(())
    }

    /// Records a copy of `src` (same element count) over this tensor's elements.
    pub fn copy_from_into(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        src: &GpuTensor,
    ) -> Result<()> {
        if src.len() != self.len() {
            return Err(Error::shape(
                "src",
                format!("has {} elements, tensor holds {}", src.len(), self.len()),
            ));
        }
        if !self.is_empty() {
            encoder.copy_buffer_to_buffer(
                &src.buffer,
                src.offset as u64 * F32,
                &self.buffer,
                self.offset as u64 * F32,
                self.size_bytes(),
            );
        }
        Ok(())
    }

    /// Reads the tensor back, blocking until the GPU has finished.
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        crate::device::block_on("GpuTensor::to_vec", self.to_vec_async(ctx))
    }

    /// Reads the tensor back. The future completes once the device has been polled (this function
    /// polls it itself, so awaiting it on any executor works).
    pub async fn to_vec_async(&self, ctx: &Context) -> Result<Vec<f32>> {
        read_buffer(ctx, &self.buffer, self.offset, self.len()).await
    }

    /// The tensor as a BSHD head view; it must be 4-D `[batch, seq, heads, head_dim]`.
    /// The same buffer under another shape with the same element count (no copy).
    pub fn reshape(&self, shape: &[usize]) -> Result<GpuTensor> {
        if element_count("shape", shape)? != self.len() {
            return Err(Error::shape(
                "shape",
                format!(
                    "{shape:?} does not hold the {} elements of {:?}",
                    self.len(),
                    self.shape
                ),
            ));
        }
        Ok(GpuTensor {
            shape: shape.to_vec(),
            ..self.clone()
        })
    }
}

/// Zero tensors of `shapes`, packed in order into as few buffers as the adapter can bind whole: each
/// at a multiple of [`TENSOR_ALIGN`] (the padding stays zero), a new arena begun where the next
/// tensor would pass `max_storage_buffer_binding_size` (or `max_buffer_size`), and a tensor larger
/// than that alone in a buffer of its own. A model's parameters, gradients and optimizer moments.
pub fn zeros_in_arenas(ctx: &Context, shapes: &[&[usize]]) -> Result<Vec<GpuTensor>> {
    let limits = ctx.limits();
    let limit = limits
        .max_storage_buffer_binding_size
        .min(limits.max_buffer_size);
    let mut slots = Vec::with_capacity(shapes.len());
    for shape in shapes {
        let len = element_count("shape", shape)?;
        slots.push(len.max(1).next_multiple_of(TENSOR_ALIGN));
    }
    let mut tensors = Vec::with_capacity(shapes.len());
    let mut first = 0;
    while first < shapes.len() {
        // The run of tensors from `first` that fits (at least one).
        let (mut end, mut elements) = (first + 1, slots[first]);
        while end < shapes.len() && (elements + slots[end]) as u64 * F32 <= limit {
            elements += slots[end];
            end += 1;
        }
        let arena = GpuTensor::zeros(ctx, &[elements])?;
        let mut offset = 0;
        for (shape, slot) in shapes[first..end].iter().zip(&slots[first..end]) {
            tensors.push(GpuTensor::view_of(&arena, offset, shape)?);
            offset += slot;
        }
        first = end;
    }
    Ok(tensors)
}
