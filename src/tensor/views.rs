//! Strided views: [`HeadsView`] (`[batch, seq, heads, head_dim]` of any buffer) and [`BiasView`]
//! (an additive score bias with broadcast dimensions).

use super::dense::GpuTensor;
use super::ids::{PackedSide, SeqLens};
use super::readback::{read_buffer, read_f16};
use super::{check_fits, split_heads, DType, Region, RowLayout, F32};
use crate::device::{Context, ContextId};
use crate::error::{Error, Result};

/// A strided `[batch, seq, heads, head_dim]` view of an f32 (or f16) buffer with a contiguous
/// head_dim.
#[derive(Clone, Debug)]
pub struct HeadsView {
    buffer: wgpu::Buffer,
    dtype: DType,
    offset: usize,
    shape: [usize; 4],
    strides: [usize; 3],
    /// The context that allocated the buffer (None for a buffer the application wrapped).
    context: Option<ContextId>,
    /// For a packed view ([`HeadsView::packed`]), the rows of its `[rows, heads, head_dim]` tensor
    /// and the side of the lengths it follows.
    packed: Option<(usize, PackedSide)>,
}

/// Head views of a dense tensor.
impl GpuTensor {
    /// A packed variable-length batch over this `[rows, heads, head_dim]` tensor: the sequences of
    /// `lens` one after another ([`HeadsView::packed`], [`SeqLens::packed`]).
    pub fn packed_heads(&self, lens: &SeqLens, side: PackedSide) -> Result<HeadsView> {
        HeadsView::packed_tensor(
            self.buffer(),
            DType::F32,
            self.offset(),
            self.shape(),
            self.context(),
        )?
        .packed(lens, side)
    }

    /// The tensor as a BSHD head view; it must be 4-D `[batch, seq, heads, head_dim]`.
    pub fn heads(&self) -> Result<HeadsView> {
        HeadsView::contiguous(
            self.buffer(),
            DType::F32,
            self.offset(),
            self.shape(),
            self.context(),
        )
    }

    /// Views a `[batch, seq, heads, head_dim]` split of a `[batch, seq, width]` tensor, starting at
    /// column `column` of the last dimension. For a fused QKV projection `[B, L, 3 * H * D]`,
    /// `split_heads(0, H, D)`, `split_heads(H * D, H, D)` and `split_heads(2 * H * D, H, D)` are Q,
    /// K and V.
    pub fn split_heads(&self, column: usize, heads: usize, head_dim: usize) -> Result<HeadsView> {
        let view = split_heads(
            self.buffer(),
            DType::F32,
            self.offset(),
            self.shape(),
            column,
            heads,
            head_dim,
        )?;
        Ok(view.of_context(self.context()))
    }
}

impl HeadsView {
    /// A view of f32 elements with explicit element `offset`, `shape = [batch, seq, heads,
    /// head_dim]` and `strides = [batch, seq, heads]` (head_dim is contiguous). Checked against the
    /// buffer size.
    pub fn new(
        buffer: wgpu::Buffer,
        offset: usize,
        shape: [usize; 4],
        strides: [usize; 3],
    ) -> Result<Self> {
        Self::new_typed(buffer, DType::F32, offset, shape, strides)
    }

    /// [`HeadsView::new`] over elements of `dtype` (offset and strides count elements).
    pub fn new_typed(
        buffer: wgpu::Buffer,
        dtype: DType,
        offset: usize,
        shape: [usize; 4],
        strides: [usize; 3],
    ) -> Result<Self> {
        let describe = || format!("offset {offset}, shape {shape:?}, strides {strides:?}");
        // Every element index a kernel or readback computes is below this end, so checking it
        // once (without wrapping) keeps all later arithmetic in range.
        let end = view_end(offset, &shape[..3], &strides, shape[3])
            .ok_or_else(|| Error::shape("view", format!("{} overflow usize", describe())))?;
        check_fits("view", &buffer, dtype, end, describe)?;
        Ok(Self {
            buffer,
            dtype,
            offset,
            shape,
            strides,
            context: None,
            packed: None,
        })
    }

    /// A packed variable-length batch (FlashAttention's varlen layout) over this `[1, rows, heads,
    /// head_dim]` view: the sequences of `lens` one after another, sequence `b` in rows
    /// `starts[b] .. starts[b] + lens[b]` of `side` ([`SeqLens::packed`]). The result has the logical
    /// shape `[batch, longest, heads, head_dim]` the attention entry points check, and they read and
    /// write only each sequence's own rows: no padding is stored and none is computed past the
    /// lengths. Pass the same `lens` as `AttentionOptions::seq_lens`. The fused forward and backward
    /// take packed views; other kernels refuse them. A view of a fused projection works too:
    /// `split_heads` of a `[1, rows, 3 * H * D]` tensor.
    pub fn packed(&self, lens: &SeqLens, side: PackedSide) -> Result<HeadsView> {
        let [b, rows, h, d] = self.shape;
        if self.packed.is_some() || b != 1 {
            return Err(Error::shape(
                "view",
                format!(
                    "has shape {:?}; a packed batch is made from a [1, rows, heads, head_dim] view",
                    self.shape
                ),
            ));
        }
        let Some(starts) = lens.packed_starts(side) else {
            return Err(Error::shape(
                "lens",
                "are not packed; build them with SeqLens::packed",
            ));
        };
        let lengths = lens.lens(side).expect("packed lengths hold both sides");
        let total = lens.packed_total(side);
        if total > rows {
            return Err(Error::shape(
                "view",
                format!("has {rows} rows; the packed {side:?} of the lengths need {total}"),
            ));
        }
        let longest = lengths.iter().copied().max().unwrap_or(0).max(1) as usize;
        debug_assert_eq!(starts.len(), lens.batch());
        Ok(HeadsView {
            shape: [lens.batch(), longest, h, d],
            strides: [0, self.strides[1], self.strides[2]],
            packed: Some((rows, side)),
            ..self.clone()
        })
    }

    /// The rows of a packed view's `[rows, heads, head_dim]` tensor ([`HeadsView::packed`]), `None`
    /// for a padded view.
    pub fn packed_rows(&self) -> Option<usize> {
        self.packed.map(|(rows, _)| rows)
    }

    /// The side of the lengths a packed view follows ([`HeadsView::packed`]), `None` for a padded
    /// view.
    pub fn packed_side(&self) -> Option<PackedSide> {
        self.packed.map(|(_, side)| side)
    }

    /// The shape the view spans in its buffer: `[batch, seq, heads, head_dim]`, or a packed view's
    /// `[1, rows, heads, head_dim]`.
    fn stored_shape(&self) -> [usize; 4] {
        match self.packed {
            Some((rows, _)) => [1, rows, self.shape[2], self.shape[3]],
            None => self.shape,
        }
    }

    /// This view, of a buffer `context` allocated.
    pub(super) fn of_context(self, context: Option<ContextId>) -> Self {
        Self { context, ..self }
    }

    /// The context that allocated the viewed buffer (`None` for a buffer the application wrapped).
    pub fn context(&self) -> Option<ContextId> {
        self.context
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The first `rows` positions of each sequence (same buffer, offset and strides); not of a
    /// packed view.
    pub fn first_rows(&self, rows: usize) -> Result<HeadsView> {
        let [b, s, h, d] = self.shape;
        if self.packed.is_some() {
            return Err(Error::shape(
                "view",
                "is packed; its sequences' rows are set by their lengths",
            ));
        }
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
    pub(super) fn contiguous(
        buffer: &wgpu::Buffer,
        dtype: DType,
        offset: usize,
        shape: &[usize],
        context: Option<ContextId>,
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
            context,
            packed: None,
        })
    }

    /// The whole of a contiguous `[rows, heads, head_dim]` tensor as a `[1, rows, heads, head_dim]`
    /// view, to be packed ([`HeadsView::packed`]).
    pub(super) fn packed_tensor(
        buffer: &wgpu::Buffer,
        dtype: DType,
        offset: usize,
        shape: &[usize],
        context: Option<ContextId>,
    ) -> Result<Self> {
        let [rows, heads, dim] = *shape else {
            return Err(Error::shape(
                "tensor",
                format!("shape {shape:?} is not [rows, heads, head_dim]"),
            ));
        };
        Self::contiguous(buffer, dtype, offset, &[1, rows, heads, dim], context)
    }

    /// `[batch, seq, heads, head_dim]` (of a packed view: `seq` is the longest sequence's length).
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }

    /// Element strides of batch, sequence and head (head_dim is contiguous); a packed view's batch
    /// stride is 0 (its sequences start where their lengths put them).
    pub fn strides(&self) -> [usize; 3] {
        self.strides
    }

    /// The first element's index in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The viewed buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// The bytes from the view's first element to its last (at least one element's).
    pub(crate) fn region(&self) -> Region<'_> {
        let region = Region::elements(
            &self.buffer,
            self.offset,
            self.end_element(),
            self.dtype.size(),
        )
        .of_context(self.context);
        Region {
            rows: self.row_layout(),
            ..region
        }
    }

    /// The view's bytes per row of its buffer, where it is made of rows: every batch starts a
    /// whole number of rows later (`stride_b % stride_s == 0`) and a position's heads fit in one
    /// row (no wrap into the next).
    fn row_layout(&self) -> Option<RowLayout> {
        let [sb, ss, sh] = self.strides;
        let [_, _, h, d] = self.shape;
        if self.stored_shape().contains(&0) {
            return None;
        }
        let footprint = (h - 1).checked_mul(sh)?.checked_add(d)?;
        let first = self.offset % ss.max(1);
        if ss == 0 || !sb.is_multiple_of(ss) || first + footprint > ss || (h > 1 && sh < d) {
            return None;
        }
        let bytes = self.dtype.size();
        Some(RowLayout {
            row_stride: ss as u64 * bytes,
            first: first as u64 * bytes,
            head_stride: sh as u64 * bytes,
            heads: h as u64,
            width: d as u64 * bytes,
        })
    }

    /// One past the last element the view touches (0 for an empty view).
    pub fn end_element(&self) -> usize {
        let shape = self.stored_shape();
        view_end(self.offset, &shape[..3], &self.strides, shape[3])
            .expect("a view's end is checked when the view is made")
    }

    /// Reads the viewed elements back in `[batch, seq, heads, head_dim]` order (f16 converted); a
    /// packed view's as `[rows, heads, head_dim]`.
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        crate::device::block_on("HeadsView::to_vec", self.to_vec_async(ctx))
    }

    /// Async form of [`HeadsView::to_vec`] (what a browser must use).
    pub async fn to_vec_async(&self, ctx: &Context) -> Result<Vec<f32>> {
        let end = self.end_element();
        let all = match self.dtype {
            DType::F32 => read_buffer(ctx, &self.buffer, 0, end).await?,
            DType::F16 => read_f16(ctx, &self.buffer, 0, end)
                .await?
                .into_iter()
                .map(f32::from)
                .collect(),
        };
        let [b, s, h, d] = self.stored_shape();
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
    buffer: wgpu::Buffer,
    offset: usize,
    shape: [usize; 4],
    strides: [usize; 4],
    context: Option<ContextId>,
}

impl BiasView {
    /// A view with element `offset`, `shape = [batch or 1, heads or 1, Lq, Lk]` and element
    /// `strides` for the four dimensions. Checked against the buffer size.
    pub fn new(
        buffer: wgpu::Buffer,
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
            context: None,
        };
        let describe = || format!("offset {offset}, shape {shape:?}, strides {strides:?}");
        let end = view_end(offset, &shape, &view.strides(), 1)
            .ok_or_else(|| Error::shape("bias", format!("{} overflow usize", describe())))?;
        check_fits("bias", &view.buffer, DType::F32, end, describe)?;
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
        let view = Self::new(
            t.buffer().clone(),
            t.offset(),
            shape,
            [h * lq * lk, lq * lk, lk, 1],
        )?;
        Ok(Self {
            context: t.context(),
            ..view
        })
    }

    /// The context that allocated the viewed buffer (`None` for a buffer the application wrapped).
    pub fn context(&self) -> Option<ContextId> {
        self.context
    }

    /// `[batch or 1, heads or 1, Lq, Lk]`.
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
        Region::elements(&self.buffer, self.offset, self.end_element(), F32)
            .of_context(self.context)
    }

    /// The first element's index in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The viewed buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// One past the last element the view touches.
    pub fn end_element(&self) -> usize {
        view_end(self.offset, &self.shape, &self.strides(), 1)
            .expect("a view's end is checked when the view is made")
    }

    /// Reads the viewed elements back in `[batch, heads, Lq, Lk]` order.
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        crate::device::block_on("BiasView::to_vec", self.to_vec_async(ctx))
    }

    /// Async form of [`BiasView::to_vec`] (what a browser must use).
    pub async fn to_vec_async(&self, ctx: &Context) -> Result<Vec<f32>> {
        let all = read_buffer(ctx, &self.buffer, 0, self.end_element()).await?;
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

/// One past the last element of a view from `offset` with strided dimensions `shape` and `last`
/// contiguous elements, or `None` if that overflows (an empty view ends at `offset`).
fn view_end(offset: usize, shape: &[usize], strides: &[usize], last: usize) -> Option<usize> {
    if shape.contains(&0) || last == 0 {
        return Some(offset);
    }
    shape
        .iter()
        .zip(strides)
        .try_fold(offset, |end, (&n, &stride)| {
            end.checked_add((n - 1).checked_mul(stride)?)
        })?
        .checked_add(last)
}
