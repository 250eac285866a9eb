//! GPU tensors and strided head views.
//!
//! A [`GpuTensor`] is a contiguous row-major f32 array in a storage buffer (ours or the user's), a
//! [`GpuTensorF16`] the same in f16 (attention inputs and outputs where the adapter has
//! `SHADER_F16`). A [`HeadsView`] reads a `[batch, seq, heads, head_dim]` (BSHD) tensor of either
//! type out of any buffer by strides, so Q, K and V can live inside one packed `[B, L, 3 * H * D]`
//! projection: splitting heads is indexing, not a copy.

use std::sync::Arc;

use crate::device::{Allocation, Context, StorageBinding};
use crate::error::{Error, Result};

const F32: u64 = std::mem::size_of::<f32>() as u64;

/// Element type of a tensor or view in GPU memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// IEEE half precision; kernels that take it compute in f32.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
        }
    }
}

/// Checks that a view of `buffer` ending at element `end` fits in it and that the buffer can be
/// bound as storage; `describe` names the view's layout for the message.
fn check_fits(
    arg: &'static str,
    buffer: &wgpu::Buffer,
    dtype: DType,
    end: usize,
    describe: impl FnOnce() -> String,
) -> Result<()> {
    let available = (buffer.size() / dtype.size()) as usize;
    if end > available {
        return Err(Error::shape(
            arg,
            format!(
                "{} reach element {end} but the buffer holds {available}",
                describe()
            ),
        ));
    }
    if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
        return Err(Error::shape(arg, "the buffer lacks STORAGE usage"));
    }
    Ok(())
}

/// Alignment in elements of a [`GpuTensor`]'s start inside its buffer: 256 bytes, the largest
/// `min_storage_buffer_offset_alignment` WebGPU allows, so every tensor can be bound on its own on
/// every adapter.
pub const TENSOR_ALIGN: usize = 64;

/// The bytes of a buffer that one tensor or view occupies: what a kernel binds, and what the
/// aliasing checks compare (two tensors in one arena are distinct; in one buffer, overlapping, not).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub size: u64,
}

impl<'a> Region<'a> {
    /// All of `buffer`.
    pub fn whole(buffer: &'a wgpu::Buffer) -> Self {
        Self {
            buffer,
            offset: 0,
            size: buffer.size(),
        }
    }

    /// Whether the two share a byte.
    pub fn overlaps(&self, other: &Region<'_>) -> bool {
        self.buffer == other.buffer
            && self.offset < other.offset + other.size
            && other.offset < self.offset + self.size
    }

    /// The region bound at `binding`.
    pub fn bind(&self, binding: u32) -> StorageBinding<'a> {
        StorageBinding {
            binding,
            buffer: self.buffer,
            offset: self.offset,
            size: wgpu::BufferSize::new(self.size),
        }
    }
}

impl<'a> From<&'a wgpu::Buffer> for Region<'a> {
    fn from(buffer: &'a wgpu::Buffer) -> Self {
        Region::whole(buffer)
    }
}

/// A contiguous f32 tensor on the GPU: its own buffer, or a range of a shared one (a model's
/// parameter arena, see [`crate::layers::params::Params`]) starting at a multiple of [`TENSOR_ALIGN`].
#[derive(Clone, Debug)]
pub struct GpuTensor {
    buffer: Arc<wgpu::Buffer>,
    /// First element inside `buffer`.
    offset: usize,
    shape: Vec<usize>,
    /// Memory accounting of buffers this crate allocated (None for user buffers).
    _allocation: Option<Arc<Allocation>>,
}

fn element_count(arg: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::shape(arg, format!("shape {shape:?} overflows usize")))
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
            buffer: Arc::new(buffer),
            offset: 0,
            shape: shape.to_vec(),
            _allocation: Some(Arc::new(allocation)),
        })
    }

    /// Wraps a buffer the application owns. It must have `STORAGE` usage (and `COPY_SRC` for
    /// [`GpuTensor::to_vec`]) and hold at least `product(shape)` f32 values.
    pub fn from_buffer(buffer: Arc<wgpu::Buffer>, shape: &[usize]) -> Result<Self> {
        Self::from_buffer_at(buffer, 0, shape)
    }

    /// Wraps `product(shape)` f32 values of a buffer the application owns, from element `offset`
    /// (a multiple of [`TENSOR_ALIGN`], so the tensor can be bound on its own): one tensor of an
    /// arena the application manages.
    pub fn from_buffer_at(
        buffer: Arc<wgpu::Buffer>,
        offset: usize,
        shape: &[usize],
    ) -> Result<Self> {
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
        })
    }

    /// `shape` from element `offset` of `arena`'s buffer, accounted with it (crate arenas).
    pub(crate) fn view_of(arena: &GpuTensor, offset: usize, shape: &[usize]) -> Result<Self> {
        let mut t = Self::from_buffer_at(arena.buffer.clone(), arena.offset + offset, shape)?;
        t._allocation = arena._allocation.clone();
        Ok(t)
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer holding the tensor, from element [`GpuTensor::offset`] on.
    pub fn buffer(&self) -> &Arc<wgpu::Buffer> {
        &self.buffer
    }

    /// First element of the tensor inside [`GpuTensor::buffer`] (0 unless it is a range of a
    /// shared buffer).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Size in bytes of the data (not of the backing buffer).
    pub fn size_bytes(&self) -> u64 {
        self.len() as u64 * F32
    }

    /// The bytes the tensor occupies (at least one element's: a binding is never empty).
    pub(crate) fn region(&self) -> Region<'_> {
        Region {
            buffer: &self.buffer,
            offset: self.offset as u64 * F32,
            size: self.len().max(1) as u64 * F32,
        }
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
        pollster::block_on(self.to_vec_async(ctx))
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

    pub fn heads(&self) -> Result<HeadsView> {
        HeadsView::contiguous(&self.buffer, DType::F32, self.offset, &self.shape)
    }

    /// Views a `[batch, seq, heads, head_dim]` split of a `[batch, seq, width]` tensor, starting at
    /// column `column` of the last dimension. For a fused QKV projection `[B, L, 3 * H * D]`,
    /// `split_heads(0, H, D)`, `split_heads(H * D, H, D)` and `split_heads(2 * H * D, H, D)` are Q,
    /// K and V.
    pub fn split_heads(&self, column: usize, heads: usize, head_dim: usize) -> Result<HeadsView> {
        let [b, s, width] = *self.shape.as_slice() else {
            return Err(Error::shape(
                "tensor",
                format!("shape {:?} is not [batch, seq, width]", self.shape),
            ));
        };
        let needed = column.saturating_add(heads.saturating_mul(head_dim));
        if needed > width {
            return Err(Error::shape(
                "split_heads",
                format!("column {column} + heads {heads} * head_dim {head_dim} = {needed} exceeds the width {width}"),
            ));
        }
        Ok(HeadsView {
            buffer: self.buffer.clone(),
            dtype: DType::F32,
            offset: self.offset + column,
            shape: [b, s, heads, head_dim],
            strides: [s * width, width, head_dim],
        })
    }
}

/// Zero tensors of `shapes`, packed in order into as few buffers as the adapter can bind whole: each
/// at a multiple of [`TENSOR_ALIGN`] (the padding stays zero), a new arena begun where the next
/// tensor would pass `max_storage_buffer_binding_size` (or `max_buffer_size`), and a tensor larger
/// than that alone in a buffer of its own. A model's parameters, gradients and optimizer moments.
pub(crate) fn zeros_in_arenas(ctx: &Context, shapes: &[&[usize]]) -> Result<Vec<GpuTensor>> {
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

/// A contiguous f16 tensor on the GPU: inputs and outputs of the fused attention in half
/// precision (the kernels compute in f32). Other kernels take f32 [`GpuTensor`]s.
#[derive(Clone, Debug)]
pub struct GpuTensorF16 {
    buffer: Arc<wgpu::Buffer>,
    shape: Vec<usize>,
    _allocation: Option<Arc<Allocation>>,
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
            buffer: Arc::new(buffer),
            shape: shape.to_vec(),
            _allocation: Some(Arc::new(allocation)),
        })
    }

    /// Wraps a buffer the application owns: `STORAGE` usage (and `COPY_SRC` to read it back), at
    /// least `product(shape)` f16 values.
    pub fn from_buffer(buffer: Arc<wgpu::Buffer>, shape: &[usize]) -> Result<Self> {
        let n = element_count("shape", shape)?;
        check_fits("buffer", &buffer, DType::F16, n, || {
            format!("shape {shape:?}")
        })?;
        Ok(Self {
            buffer,
            shape: shape.to_vec(),
            _allocation: None,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn buffer(&self) -> &Arc<wgpu::Buffer> {
        &self.buffer
    }

    /// Size in bytes of the data (not of the backing buffer).
    pub fn size_bytes(&self) -> u64 {
        self.len() as u64 * DType::F16.size()
    }

    /// Its whole buffer (an f16 tensor always starts it; binding sizes are whole words).
    pub(crate) fn region(&self) -> Region<'_> {
        Region::whole(&self.buffer)
    }

    /// Overwrites the tensor's contents with `data` (same length).
    pub fn write(&self, ctx: &Context, data: &[half::f16]) -> Result<()> {
        if data.len() != self.len() {
            return Err(Error::shape(
                "data",
                format!("has {} elements, tensor holds {}", data.len(), self.len()),
            ));
        }
        ctx.check_lost()?;
        if !data.is_empty() {
            // write_buffer copies whole words: pad an odd count with one zero.
            let mut words: Vec<half::f16> = data.to_vec();
            words.resize(data.len().next_multiple_of(2), half::f16::ZERO);
            ctx.queue()
                .write_buffer(&self.buffer, 0, bytemuck::cast_slice(&words));
        }
        Ok(())
    }

    /// Reads the tensor back as f16, blocking until the GPU has finished.
    pub fn to_f16_vec(&self, ctx: &Context) -> Result<Vec<half::f16>> {
        pollster::block_on(read_f16(ctx, &self.buffer, self.len()))
    }

    /// Reads the tensor back converted to f32 (exactly).
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        Ok(self.to_f16_vec(ctx)?.into_iter().map(f32::from).collect())
    }

    /// The tensor as a BSHD head view; it must be 4-D `[batch, seq, heads, head_dim]`.
    pub fn heads(&self) -> Result<HeadsView> {
        HeadsView::contiguous(&self.buffer, DType::F16, 0, &self.shape)
    }
}

/// A strided `[batch, seq, heads, head_dim]` view of an f32 (or f16) buffer with a contiguous
/// head_dim.
#[derive(Clone, Debug)]
pub struct HeadsView {
    buffer: Arc<wgpu::Buffer>,
    dtype: DType,
    offset: usize,
    shape: [usize; 4],
    strides: [usize; 3],
}

impl HeadsView {
    /// A view of f32 elements with explicit element `offset`, `shape = [batch, seq, heads,
    /// head_dim]` and `strides = [batch, seq, heads]` (head_dim is contiguous). Checked against the
    /// buffer size.
    pub fn new(
        buffer: Arc<wgpu::Buffer>,
        offset: usize,
        shape: [usize; 4],
        strides: [usize; 3],
    ) -> Result<Self> {
        Self::new_typed(buffer, DType::F32, offset, shape, strides)
    }

    /// [`HeadsView::new`] over elements of `dtype` (offset and strides count elements).
    pub fn new_typed(
        buffer: Arc<wgpu::Buffer>,
        dtype: DType,
        offset: usize,
        shape: [usize; 4],
        strides: [usize; 3],
    ) -> Result<Self> {
        let view = Self {
            buffer,
            dtype,
            offset,
            shape,
            strides,
        };
        check_fits("view", &view.buffer, dtype, view.end_element(), || {
            format!("offset {offset}, shape {shape:?}, strides {strides:?}")
        })?;
        Ok(view)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The first `rows` positions of each sequence (same buffer, offset and strides).
    pub fn first_rows(&self, rows: usize) -> Result<HeadsView> {
        let [b, s, h, d] = self.shape;
        if rows > s {
            return Err(Error::shape(
                "rows",
                format!("is {rows}; the view has {s} positions per sequence"),
            ));
        }
        Ok(HeadsView {
            shape: [b, rows, h, d],
            ..self.clone()
        })
    }

    /// The whole of a contiguous tensor of `shape` `[batch, seq, heads, head_dim]`.
    fn contiguous(
        buffer: &Arc<wgpu::Buffer>,
        dtype: DType,
        offset: usize,
        shape: &[usize],
    ) -> Result<Self> {
        let [b, s, h, d] = *shape else {
            return Err(Error::shape(
                "tensor",
                format!("shape {shape:?} is not [batch, seq, heads, head_dim]"),
            ));
        };
        Ok(HeadsView {
            buffer: buffer.clone(),
            dtype,
            offset,
            shape: [b, s, h, d],
            strides: [s * h * d, h * d, d],
        })
    }

    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }

    pub fn strides(&self) -> [usize; 3] {
        self.strides
    }

    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn buffer(&self) -> &Arc<wgpu::Buffer> {
        &self.buffer
    }

    /// The bytes from the view's first element to its last (at least one element's).
    pub(crate) fn region(&self) -> Region<'_> {
        let size = self.dtype.size();
        Region {
            buffer: &self.buffer,
            offset: self.offset as u64 * size,
            size: (self.end_element() - self.offset).max(1) as u64 * size,
        }
    }

    /// One past the last element the view touches (0 for an empty view).
    pub fn end_element(&self) -> usize {
        let [b, s, h, d] = self.shape;
        if b == 0 || s == 0 || h == 0 || d == 0 {
            return self.offset;
        }
        self.offset
            + (b - 1) * self.strides[0]
            + (s - 1) * self.strides[1]
            + (h - 1) * self.strides[2]
            + d
    }

    /// Reads the viewed elements back in `[batch, seq, heads, head_dim]` order (f16 converted).
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        let end = self.end_element();
        let all = match self.dtype {
            DType::F32 => pollster::block_on(read_buffer(ctx, &self.buffer, 0, end))?,
            DType::F16 => pollster::block_on(read_f16(ctx, &self.buffer, end))?
                .into_iter()
                .map(f32::from)
                .collect(),
        };
        let [b, s, h, d] = self.shape;
        let mut out = Vec::with_capacity(b * s * h * d);
        for bi in 0..b {
            for si in 0..s {
                for hi in 0..h {
                    let base = self.offset
                        + bi * self.strides[0]
                        + si * self.strides[1]
                        + hi * self.strides[2];
                    out.extend_from_slice(&all[base..base + d]);
                }
            }
        }
        Ok(out)
    }
}

/// A strided `[batch or 1, heads or 1, Lq, Lk]` view of an f32 buffer: an additive attention-score
/// bias (`AttentionOptions::bias`). A dimension of size 1 is broadcast over the batch or the query
/// heads (its stride is ignored); any stride may be 0, so a `[Lq, Lk]` matrix can serve every batch
/// and head without a copy. The bias gradient has the view's shape, reduced over the broadcast
/// dimensions.
#[derive(Clone, Debug)]
pub struct BiasView {
    buffer: Arc<wgpu::Buffer>,
    offset: usize,
    shape: [usize; 4],
    strides: [usize; 4],
}

impl BiasView {
    /// A view with element `offset`, `shape = [batch or 1, heads or 1, Lq, Lk]` and element
    /// `strides` for the four dimensions. Checked against the buffer size.
    pub fn new(
        buffer: Arc<wgpu::Buffer>,
        offset: usize,
        shape: [usize; 4],
        strides: [usize; 4],
    ) -> Result<Self> {
        if shape.contains(&0) {
            return Err(Error::shape(
                "bias",
                format!("shape {shape:?} has a zero dimension"),
            ));
        }
        let view = Self {
            buffer,
            offset,
            shape,
            strides,
        };
        check_fits("bias", &view.buffer, DType::F32, view.end_element(), || {
            format!("offset {offset}, shape {shape:?}, strides {strides:?}")
        })?;
        Ok(view)
    }

    /// A contiguous tensor of shape `[Lq, Lk]`, `[Hb, Lq, Lk]` or `[Bb, Hb, Lq, Lk]` (missing leading
    /// dimensions are 1, i.e. broadcast).
    pub fn of(t: &GpuTensor) -> Result<Self> {
        let shape = match *t.shape() {
            [lq, lk] => [1, 1, lq, lk],
            [h, lq, lk] => [1, h, lq, lk],
            [b, h, lq, lk] => [b, h, lq, lk],
            _ => {
                return Err(Error::shape(
                    "bias",
                    format!(
                        "shape {:?} is not [Lq, Lk], [H, Lq, Lk] or [B, H, Lq, Lk]",
                        t.shape()
                    ),
                ))
            }
        };
        let [_, h, lq, lk] = shape;
        Self::new(
            t.buffer().clone(),
            t.offset(),
            shape,
            [h * lq * lk, lq * lk, lk, 1],
        )
    }

    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }

    /// Element strides, 0 for the broadcast (size-1) dimensions.
    pub fn strides(&self) -> [usize; 4] {
        let mut strides = self.strides;
        for (stride, &n) in strides.iter_mut().zip(&self.shape) {
            if n == 1 {
                *stride = 0;
            }
        }
        strides
    }

    /// The bytes from the view's first element to its last (at least one element's).
    pub(crate) fn region(&self) -> Region<'_> {
        Region {
            buffer: &self.buffer,
            offset: self.offset as u64 * F32,
            size: (self.end_element() - self.offset).max(1) as u64 * F32,
        }
    }

    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn buffer(&self) -> &Arc<wgpu::Buffer> {
        &self.buffer
    }

    /// One past the last element the view touches.
    pub fn end_element(&self) -> usize {
        let strides = self.strides();
        self.offset
            + self
                .shape
                .iter()
                .zip(strides)
                .map(|(&n, s)| (n - 1) * s)
                .sum::<usize>()
            + 1
    }

    /// Reads the viewed elements back in `[batch, heads, Lq, Lk]` order.
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        let all = pollster::block_on(read_buffer(ctx, &self.buffer, 0, self.end_element()))?;
        let [sb, sh, si, sj] = self.strides();
        let [b, h, lq, lk] = self.shape;
        let mut out = Vec::with_capacity(b * h * lq * lk);
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..lq {
                    for j in 0..lk {
                        out.push(all[self.offset + bi * sb + hi * sh + i * si + j * sj]);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Integer ids on the GPU (tokens, class targets): a `u32` storage buffer with its shape, and a host
/// copy so that ops can reject ids beyond a vocabulary before dispatching.
#[derive(Clone, Debug)]
pub struct GpuTokens {
    buffer: Arc<wgpu::Buffer>,
    shape: Vec<usize>,
    values: Arc<Vec<u32>>,
    _allocation: Arc<Allocation>,
}

impl GpuTokens {
    pub fn from_slice(ctx: &Context, data: &[u32], shape: &[usize]) -> Result<Self> {
        let len: usize = shape.iter().product();
        if len != data.len() || len == 0 {
            return Err(Error::shape(
                "tokens",
                format!(
                    "{} values for shape {shape:?} ({len} elements, at least 1 needed)",
                    data.len()
                ),
            ));
        }
        let (buffer, allocation) = ctx.create_buffer(
            "tokens",
            len as u64 * 4,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
        )?;
        ctx.queue()
            .write_buffer(&buffer, 0, bytemuck::cast_slice(data));
        Ok(Self {
            buffer: Arc::new(buffer),
            shape: shape.to_vec(),
            values: Arc::new(data.to_vec()),
            _allocation: Arc::new(allocation),
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn buffer(&self) -> &Arc<wgpu::Buffer> {
        &self.buffer
    }

    /// Overwrites the ids (same count) through the queue, ahead of work submitted after this call.
    pub fn write(&mut self, ctx: &Context, data: &[u32]) -> Result<()> {
        if data.len() != self.len() {
            return Err(Error::shape(
                "tokens",
                format!("{} values for a buffer of {}", data.len(), self.len()),
            ));
        }
        ctx.check_lost()?;
        ctx.queue()
            .write_buffer(&self.buffer, 0, bytemuck::cast_slice(data));
        self.values = Arc::new(data.to_vec());
        Ok(())
    }

    /// The first id at or beyond `limit` that is not `ignore`, with its index: what an op with a
    /// vocabulary or class count of `limit` rejects.
    pub fn first_out_of_range(&self, limit: u32, ignore: Option<u32>) -> Option<(usize, u32)> {
        self.values
            .iter()
            .copied()
            .enumerate()
            .find(|&(_, v)| v >= limit && Some(v) != ignore)
    }
}

/// Per-batch valid sequence lengths for padding / variable-length attention, held on the GPU as one
/// buffer `[q_lens (batch), kv_lens (batch)]` with a host copy for validation.
#[derive(Clone, Debug)]
pub struct SeqLens {
    buffer: Arc<wgpu::Buffer>,
    q_lens: Option<Vec<u32>>,
    kv_lens: Option<Vec<u32>>,
    batch: usize,
}

impl SeqLens {
    /// Valid query lengths (`q_lens`, rows past them give O = 0) and/or key lengths (`kv_lens`, keys
    /// past them are masked), one entry per batch element. At least one must be given.
    pub fn new(ctx: &Context, q_lens: Option<&[u32]>, kv_lens: Option<&[u32]>) -> Result<Self> {
        let batch = match (q_lens, kv_lens) {
            (Some(q), Some(k)) if q.len() != k.len() => {
                return Err(Error::shape(
                    "kv_lens",
                    format!("has {} entries but q_lens has {}", k.len(), q.len()),
                ))
            }
            (Some(q), _) => q.len(),
            (None, Some(k)) => k.len(),
            (None, None) => {
                return Err(Error::shape(
                    "SeqLens",
                    "give q_lens, kv_lens or both (or pass no SeqLens at all)",
                ))
            }
        };
        let mut data = vec![u32::MAX; 2 * batch.max(1)];
        if let Some(q) = q_lens {
            data[..batch].copy_from_slice(q);
        }
        if let Some(k) = kv_lens {
            data[batch..2 * batch].copy_from_slice(k);
        }
        let buffer = ctx.create_uncounted_buffer(
            "seq_lens",
            data.len() as u64 * 4,
            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        )?;
        ctx.queue()
            .write_buffer(&buffer, 0, bytemuck::cast_slice(&data));
        Ok(Self {
            buffer: Arc::new(buffer),
            q_lens: q_lens.map(<[u32]>::to_vec),
            kv_lens: kv_lens.map(<[u32]>::to_vec),
            batch,
        })
    }

    /// Overwrites the lengths through the queue (no allocation). The same lengths must be given as
    /// at creation (`Some`/`None` alike) for the same batch.
    pub fn write(
        &mut self,
        ctx: &Context,
        q_lens: Option<&[u32]>,
        kv_lens: Option<&[u32]>,
    ) -> Result<()> {
        for (arg, new, old) in [
            ("q_lens", q_lens, self.q_lens.as_deref()),
            ("kv_lens", kv_lens, self.kv_lens.as_deref()),
        ] {
            if new.map(<[u32]>::len) != old.map(<[u32]>::len) {
                return Err(Error::shape(
                    arg,
                    format!(
                        "has {:?} entries; this SeqLens was created with {:?}",
                        new.map(<[u32]>::len),
                        old.map(<[u32]>::len)
                    ),
                ));
            }
        }
        let batch = self.batch;
        let mut data = vec![u32::MAX; 2 * batch.max(1)];
        if let Some(q) = q_lens {
            data[..batch].copy_from_slice(q);
        }
        if let Some(k) = kv_lens {
            data[batch..2 * batch].copy_from_slice(k);
        }
        ctx.queue()
            .write_buffer(&self.buffer, 0, bytemuck::cast_slice(&data));
        self.q_lens = q_lens.map(<[u32]>::to_vec);
        self.kv_lens = kv_lens.map(<[u32]>::to_vec);
        Ok(())
    }

    /// Checks lengths that place new tokens at the end of cached sequences (decoding): both given for
    /// `batch` sequences, `q_lens[b]` (new tokens) at most `new_slots` and at most `kv_lens[b]`
    /// (tokens cached, the new ones included), which is at most `capacity`. Returns the longest
    /// `kv_lens` entry.
    pub fn check_decode(&self, batch: usize, new_slots: usize, capacity: usize) -> Result<usize> {
        let (Some(q), Some(kv)) = (self.q_lens(), self.kv_lens()) else {
            return Err(Error::shape(
                "seq_lens",
                "decoding needs SeqLens with q_lens (new tokens per sequence) and kv_lens (cached tokens per sequence, the new ones included)",
            ));
        };
        if self.batch != batch {
            return Err(Error::shape(
                "seq_lens",
                format!("has {} entries but the batch is {batch}", self.batch),
            ));
        }
        for b in 0..batch {
            let (n, len) = (q[b] as usize, kv[b] as usize);
            if n > new_slots {
                return Err(Error::shape(
                    "q_lens",
                    format!("entry {b} is {n}, beyond the {new_slots} new-token slots"),
                ));
            }
            if n > len {
                return Err(Error::shape(
                    "q_lens",
                    format!("entry {b} is {n} but kv_lens[{b}] is {len}: the new tokens are the last cached positions, so q_lens <= kv_lens"),
                ));
            }
            if len > capacity {
                return Err(Error::shape(
                    "kv_lens",
                    format!("entry {b} is {len}, beyond the capacity {capacity}"),
                ));
            }
        }
        Ok(kv.iter().copied().max().unwrap_or(0) as usize)
    }

    pub fn q_lens(&self) -> Option<&[u32]> {
        self.q_lens.as_deref()
    }

    pub fn kv_lens(&self) -> Option<&[u32]> {
        self.kv_lens.as_deref()
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub(crate) fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }
}

/// Copies `len` f32 values starting at element `offset` of `buffer` back to the host.
pub(crate) async fn read_buffer(
    ctx: &Context,
    buffer: &wgpu::Buffer,
    offset: usize,
    len: usize,
) -> Result<Vec<f32>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if !buffer.usage().contains(wgpu::BufferUsages::COPY_SRC) {
        return Err(Error::Readback("the buffer lacks COPY_SRC usage".into()));
    }
    let bytes = len as u64 * F32;
    let staging = ctx.create_uncounted_buffer(
        "readback",
        bytes,
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
    )?;
    let mut encoder = ctx
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("readback"),
        });
    encoder.copy_buffer_to_buffer(buffer, offset as u64 * F32, &staging, 0, bytes);
    ctx.submit(encoder)?;

    read_mapped(ctx, &staging).await
}

/// Reads the first `len` f16 elements of `buffer` (whole words are copied).
pub(crate) async fn read_f16(
    ctx: &Context,
    buffer: &wgpu::Buffer,
    len: usize,
) -> Result<Vec<half::f16>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let words = read_buffer(ctx, buffer, 0, len.div_ceil(2)).await?;
    let mut halves: Vec<half::f16> = bytemuck::cast_slice(&words).to_vec();
    halves.truncate(len);
    Ok(halves)
}

/// Maps a whole `MAP_READ` buffer once the submitted work is done and copies it out as `T`s: the
/// one readback path (tensors, profiler timestamps, bench timer).
pub(crate) async fn read_mapped<T: bytemuck::Pod>(
    ctx: &Context,
    buffer: &wgpu::Buffer,
) -> Result<Vec<T>> {
    let slice = buffer.slice(..);
    let (sender, receiver) = futures_intrusive::channel::shared::oneshot_channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = sender.send(r);
    });
    ctx.synchronize()?;
    match receiver.receive().await {
        Some(Ok(())) => {}
        Some(Err(e)) => return Err(Error::Readback(e.to_string())),
        None => return Err(Error::Readback("map callback dropped".into())),
    }
    let data = {
        let view = slice
            .get_mapped_range()
            .map_err(|e| Error::Readback(e.to_string()))?;
        bytemuck::pod_collect_to_vec(&view[..])
    };
    buffer.unmap();
    Ok(data)
}
