//! GPU tensors and strided head views.
//!
//! A [`GpuTensor`] is a contiguous row-major f32 array in a storage buffer (ours or the user's), a
//! [`GpuTensorF16`] the same in f16 (attention inputs and outputs where the adapter has
//! `SHADER_F16`). A [`HeadsView`] reads a `[batch, seq, heads, head_dim]` (BSHD) tensor of either
//! type out of any buffer by strides, so Q, K and V can live inside one packed `[B, L, 3 * H * D]`
//! projection: splitting heads is indexing, not a copy.
//!
//! `dense.rs` (f32 tensors, arenas), `f16.rs`, `views.rs` (head and bias views), `ids.rs` (token ids,
//! sequence lengths), `readback.rs`; here the element types, the byte `Region`s kernels bind and
//! aliasing checks compare, and the shared size checks.

mod dense;
mod f16;
mod ids;
mod q8;
mod readback;
mod views;

pub use dense::zeros_in_arenas;
pub use dense::GpuTensor;
pub use f16::GpuTensorF16;
pub use ids::{GpuTokens, PackedSide, SeqLens, MAX_TREE_ROWS};
pub(crate) use q8::row_words;
pub use q8::GpuTensorQ8;
pub(crate) use readback::read_buffer;
pub use views::{BiasView, HeadsView};

use crate::device::{ContextId, StorageBinding};
use crate::error::{Error, Result};

const F32: u64 = std::mem::size_of::<f32>() as u64;

/// Element type of a tensor or view in GPU memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision.
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

    /// `f32` or `f16`.
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
    // Storage bindings (and queue writes) are whole 4-byte words: an f16 view ending inside the
    // buffer's last half word would be bound past its end.
    let bound = (end as u64 * dtype.size()).next_multiple_of(4);
    if bound > buffer.size() {
        return Err(Error::shape(
            arg,
            format!(
                "{} end at byte {}, and bindings are whole 4-byte words ({bound} bytes), but the \
                 buffer has {}: pad the buffer to a multiple of 4 bytes",
                describe(),
                end as u64 * dtype.size(),
                buffer.size()
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
    /// The context that allocated the buffer (`None`: a buffer the application wrapped).
    pub context: Option<ContextId>,
    /// Where the region is a strided view made of rows: which bytes of each row it touches, so
    /// that views interleaved in one buffer (Q, K and V of a packed projection) count as disjoint.
    pub rows: Option<RowLayout>,
}

/// The bytes a row-structured view touches in each row of its buffer: `heads` runs of `width`
/// bytes, `head_stride` apart, from byte `first` of a row of `row_stride` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowLayout {
    pub row_stride: u64,
    pub first: u64,
    pub head_stride: u64,
    pub heads: u64,
    pub width: u64,
}

impl RowLayout {
    /// Whether two views with this row stride touch a common byte of some row.
    fn columns_meet(&self, other: &RowLayout) -> bool {
        (0..self.heads).any(|i| {
            let a = self.first + i * self.head_stride;
            (0..other.heads).any(|j| {
                let b = other.first + j * other.head_stride;
                a < b + other.width && b < a + self.width
            })
        })
    }
}

impl<'a> Region<'a> {
    /// All of `buffer`.
    pub fn whole(buffer: &'a wgpu::Buffer) -> Self {
        Self {
            buffer,
            offset: 0,
            size: buffer.size(),
            context: None,
            rows: None,
        }
    }

    /// Elements `begin .. end` of `element_bytes` each (at least one: a binding is never empty).
    pub fn elements(
        buffer: &'a wgpu::Buffer,
        begin: usize,
        end: usize,
        element_bytes: u64,
    ) -> Self {
        Self {
            buffer,
            offset: begin as u64 * element_bytes,
            size: (end - begin).max(1) as u64 * element_bytes,
            context: None,
            rows: None,
        }
    }

    /// This region, of a buffer `context` allocated.
    pub fn of_context(self, context: Option<ContextId>) -> Self {
        Self { context, ..self }
    }

    /// Whether the two share a byte: their ranges meet and, for two row-structured views of one
    /// row stride, so do the bytes they touch in a row.
    pub fn overlaps(&self, other: &Region<'_>) -> bool {
        let ranges_meet = self.buffer == other.buffer
            && self.offset < other.offset + other.size
            && other.offset < self.offset + self.size;
        match (&self.rows, &other.rows) {
            (Some(a), Some(b)) if ranges_meet && a.row_stride == b.row_stride => a.columns_meet(b),
            _ => ranges_meet,
        }
    }

    /// This region grown to cover `other` too (a range of the same buffer).
    pub fn cover(&self, other: &Region<'_>) -> Region<'a> {
        let start = self.offset.min(other.offset);
        let end = (self.offset + self.size).max(other.offset + other.size);
        Region {
            buffer: self.buffer,
            offset: start,
            size: end - start,
            context: self.context,
            rows: None,
        }
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

/// The `[batch, seq, heads, head_dim]` split of a `[batch, seq, width]` tensor from `column`
/// (`GpuTensor::split_heads`, `GpuTensorF16::split_heads`).
fn split_heads(
    buffer: &wgpu::Buffer,
    dtype: DType,
    offset: usize,
    shape: &[usize],
    column: usize,
    heads: usize,
    head_dim: usize,
) -> Result<HeadsView> {
    let [b, s, width] = *shape else {
        return Err(Error::shape(
            "tensor",
            format!("shape {shape:?} is not [batch, seq, width]"),
        ));
    };
    let needed = column.saturating_add(heads.saturating_mul(head_dim));
    if needed > width {
        return Err(Error::shape(
            "split_heads",
            format!("column {column} + heads {heads} * head_dim {head_dim} = {needed} exceeds the width {width}"),
        ));
    }
    HeadsView::new_typed(
        buffer.clone(),
        dtype,
        offset + column,
        [b, s, heads, head_dim],
        [s * width, width, head_dim],
    )
}

fn element_count(arg: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::shape(arg, format!("shape {shape:?} overflows usize")))
}
