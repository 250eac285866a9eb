//! Key/value cache append (`shaders/kv_cache_append.wgsl`): a decoding step's new keys or values, a
//! strided `[B, L, H, D]` view (the K or V columns of a projection), copied into a cache
//! `[B, max_len, H, D]` after each sequence's cached tokens, or into a paged pool through a
//! [`BlockTable`]; and the gather out of a paged pool (`shaders/kv_cache_gather.wgsl`). The caches themselves (per layer, with their lengths) are
//! `wgpu_attention_serve::KvCache` and `wgpu_attention_serve::PagedKvCache`. CPU reference:
//! [`crate::reference::kv_cache`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::check_binding;
use crate::kernels::dispatch::{encode, grid_x, SimpleKernel};
use crate::tensor::{GpuTensor, GpuTensorF16, GpuTensorQ8, GpuTokens, HeadsView, SeqLens};

const APPEND: &str = concat!(
    include_str!("../../shaders/kv_cache_common.wgsl"),
    include_str!("../../shaders/kv_cache_append.wgsl")
);
const APPEND_INT8: &str = concat!(
    include_str!("../../shaders/kv_cache_common.wgsl"),
    include_str!("../../shaders/kv_cache_append_int8.wgsl")
);
const GATHER: &str = concat!(
    include_str!("../../shaders/kv_cache_common.wgsl"),
    include_str!("../../shaders/kv_cache_gather.wgsl")
);
const GATHER_INT8: &str = concat!(
    include_str!("../../shaders/kv_cache_common.wgsl"),
    include_str!("../../shaders/kv_cache_gather_int8.wgsl")
);
const APPEND_F16: &str = concat!(
    include_str!("../../shaders/kv_cache_common.wgsl"),
    include_str!("../../shaders/kv_cache_append_f16.wgsl")
);
const GATHER_F16: &str = concat!(
    include_str!("../../shaders/kv_cache_common.wgsl"),
    include_str!("../../shaders/kv_cache_gather_f16.wgsl")
);

/// The append shaders by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![
        ("kv_cache_append", APPEND.to_string()),
        ("kv_cache_append_int8", APPEND_INT8.to_string()),
        ("kv_cache_gather", GATHER.to_string()),
        ("kv_cache_gather_int8", GATHER_INT8.to_string()),
        ("kv_cache_append_f16", APPEND_F16.to_string()),
        ("kv_cache_gather_f16", GATHER_F16.to_string()),
    ]
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AppendParams {
    batch: u32,
    seq: u32,
    heads: u32,
    dim: u32,
    max_len: u32,
    grid_x: u32,
    view_offset: u32,
    stride_b: u32,
    stride_s: u32,
    stride_h: u32,
    packed: u32,
    /// Paged caches: the block table's stride and the pool's blocks ([`BlockTable::layout`]).
    table_stride: u32,
    pool_blocks: u32,
    pad: [u32; 3],
}

/// The block table of a paged key/value cache on the GPU: for each of `slots` sequences, `stride`
/// block ids into a pool of `pool_blocks` blocks of `page` rows each. Position `p` of sequence `b`
/// is pool row `table[b][p / page] * page + p % page`; a sequence holds up to `stride * page`
/// positions. Ids are checked when written, so kernels never read past the pool.
pub struct BlockTable {
    ids: GpuTokens,
    page: usize,
    stride: usize,
    pool_blocks: usize,
}

impl BlockTable {
    /// A table of `slots` sequences of `stride` block ids each (all block 0 at first) into a pool of
    /// `pool_blocks` blocks of `page` rows.
    pub fn new(
        ctx: &Context,
        slots: usize,
        stride: usize,
        page: usize,
        pool_blocks: usize,
    ) -> Result<Self> {
        for (arg, value) in [
            ("slots", slots),
            ("blocks per sequence", stride),
            ("page", page),
            ("pool blocks", pool_blocks),
        ] {
            if value == 0 || value > u32::MAX as usize / 2 {
                return Err(Error::shape(
                    arg,
                    format!("is {value}; it must be 1 to 2^31 - 1"),
                ));
            }
        }
        if pool_blocks
            .checked_mul(page)
            .is_none_or(|rows| rows > u32::MAX as usize / 2)
        {
            return Err(Error::shape(
                "pool blocks",
                format!("{pool_blocks} blocks of {page} rows exceed 2^31 rows"),
            ));
        }
        Ok(Self {
            ids: GpuTokens::from_slice(ctx, &vec![0; slots * stride], &[slots, stride])?,
            page,
            stride,
            pool_blocks,
        })
    }

    /// Uploads the ids, `[slots, stride]` row-major, each below the pool's block count (checked
    /// first: on error nothing is written), for the calls recorded after this one
    /// ([`GpuTokens::write`]).
    pub fn write(&mut self, ctx: &Context, ids: &[u32]) -> Result<()> {
        if let Some(i) = ids.iter().position(|&id| id as usize >= self.pool_blocks) {
            return Err(Error::shape(
                "block table",
                format!(
                    "id {} at {i} is not below the pool's {} blocks",
                    ids[i], self.pool_blocks
                ),
            ));
        }
        self.ids.write(ctx, ids)
    }

    /// Rows per block.
    pub fn page(&self) -> usize {
        self.page
    }

    /// Sequences the table holds.
    pub fn slots(&self) -> usize {
        self.ids.shape()[0]
    }

    /// Block ids per sequence.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Blocks in the pool.
    pub fn pool_blocks(&self) -> usize {
        self.pool_blocks
    }

    /// The most positions a sequence can hold, `stride * page`.
    pub fn capacity(&self) -> usize {
        self.stride * self.page
    }

    /// The pool rows, `pool_blocks * page`.
    pub fn pool_rows(&self) -> usize {
        self.pool_blocks * self.page
    }

    pub(crate) fn buffer(&self) -> &wgpu::Buffer {
        self.ids.buffer()
    }

    /// The kernels' override constant: the page, which their code divides by. The table's size
    /// and the pool's are uniforms ([`BlockTable::layout`]), so that tables and pools of any size
    /// share pipelines.
    pub(crate) fn constants(&self) -> [(&'static str, u32); 1] {
        [("PAGE", self.page as u32)]
    }

    /// The kernels' uniforms: block ids per sequence, blocks in the pool.
    pub(crate) fn layout(&self) -> [u32; 2] {
        [self.stride as u32, self.pool_blocks as u32]
    }
}

/// How a key/value cache stores its values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvFormat {
    /// f32, as computed.
    #[default]
    F32,
    /// int8 with one f32 scale per token and head ([`GpuTensorQ8`]), dequantised inside the decode
    /// kernel: `4 + 4 / D` bytes per value instead of 4 (3.76x smaller at head_dim 64); head
    /// dimensions a multiple of 4.
    Int8,
    /// f16 ([`GpuTensorF16`], rounded to nearest even when appended: beyond f16's range an
    /// infinity, a NaN kept), widened to f32 inside the decode kernel: half the bytes of f32, and
    /// no adapter feature needed; head dimensions a multiple of 4.
    F16,
}

impl KvFormat {
    /// `"f32"`, `"f16"` or `"int8"`.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::Int8 => "int8",
            KvFormat::F16 => "f16",
        }
    }
}

/// A key or value cache (or paged pool) in either [`KvFormat`].
#[non_exhaustive]
pub enum KvStorage {
    /// f32 values.
    F32(GpuTensor),
    /// int8 values with per-row scales.
    Int8(GpuTensorQ8),
    /// f16 values.
    F16(GpuTensorF16),
}

impl KvStorage {
    /// Zeros of `shape` (`[.., head_dim]`) in `format`.
    pub fn zeros(ctx: &Context, shape: &[usize], format: KvFormat) -> Result<Self> {
        Ok(match format {
            KvFormat::F32 => KvStorage::F32(GpuTensor::zeros(ctx, shape)?),
            KvFormat::Int8 => KvStorage::Int8(GpuTensorQ8::zeros(ctx, shape)?),
            KvFormat::F16 => {
                check_f16_dims("cache", shape)?;
                KvStorage::F16(GpuTensorF16::zeros(ctx, shape)?)
            }
        })
    }

    /// The storage format.
    pub fn format(&self) -> KvFormat {
        match self {
            KvStorage::F32(_) => KvFormat::F32,
            KvStorage::Int8(_) => KvFormat::Int8,
            KvStorage::F16(_) => KvFormat::F16,
        }
    }

    /// The logical shape (values).
    pub fn shape(&self) -> &[usize] {
        Storage::from(self).shape()
    }

    /// Bytes of storage (scales included).
    pub fn size_bytes(&self) -> u64 {
        match self {
            KvStorage::F32(t) => t.size_bytes(),
            KvStorage::Int8(t) => t.size_bytes(),
            KvStorage::F16(t) => t.size_bytes(),
        }
    }

    /// The values held (blocking; int8 dequantised, f16 widened).
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        match self {
            KvStorage::F32(t) => t.to_vec(ctx),
            KvStorage::Int8(t) => t.to_vec(ctx),
            KvStorage::F16(t) => t.to_vec(ctx),
        }
    }

    /// The storage words (f32 values, int8 words and scales, or pairs of f16 values), for copies
    /// that move whole rows.
    pub fn words(&self) -> GpuTensor {
        Storage::from(self).words()
    }

    /// Records the append of `new` (see [`kv_cache_append_into`]) into this cache, or with `table`
    /// into this paged pool ([`kv_cache_append_paged_into`]).
    pub fn append_into(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        new: &HeadsView,
        table: Option<&BlockTable>,
        lens: &SeqLens,
    ) -> Result<()> {
        append(ctx, encoder, new, self.into(), table, lens)
    }
}

impl<'a> From<&'a KvStorage> for Storage<'a> {
    fn from(s: &'a KvStorage) -> Self {
        match s {
            KvStorage::F32(t) => Storage::F32(t),
            KvStorage::Int8(t) => Storage::Int8(t),
            KvStorage::F16(t) => Storage::F16(t),
        }
    }
}

/// Records the copy of `new [B, L, H, D]` into `cache [B, max_len, H, D]`: row `l < q_lens[b]` of
/// sequence `b` to position `kv_lens[b] - q_lens[b] + l` (`lens` as [`SeqLens::check_decode`]
/// describes: `kv_lens` counts the new rows). Nothing is recorded if the input is rejected.
pub fn kv_cache_append_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    new: &HeadsView,
    cache: &GpuTensor,
    lens: &SeqLens,
) -> Result<()> {
    append(ctx, encoder, new, Storage::F32(cache), None, lens)
}

/// [`kv_cache_append_into`] into a paged pool `[pool_blocks * page, H, D]` through `table` (one
/// table row per sequence of `new`): position `p` of sequence `b` goes to pool row
/// `table[b][p / page] * page + p % page`. The blocks the new rows fall in must be the sequence's
/// own (`wgpu_attention_serve::PagedKvCache` copies shared ones first).
pub fn kv_cache_append_paged_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    new: &HeadsView,
    pool: &GpuTensor,
    table: &BlockTable,
    lens: &SeqLens,
) -> Result<()> {
    append(ctx, encoder, new, Storage::F32(pool), Some(table), lens)
}

/// [`kv_cache_append_into`] into an int8 cache: `cache [B, max_len, H, D]`, or with `table` a
/// paged pool `[pool_blocks * page, H, D]`. Each new row of each head is quantised to int8 with its
/// own scale (see [`GpuTensorQ8`]); `D` is a multiple of 4.
pub fn kv_cache_append_int8_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    new: &HeadsView,
    cache: &GpuTensorQ8,
    table: Option<&BlockTable>,
    lens: &SeqLens,
) -> Result<()> {
    append(ctx, encoder, new, Storage::Int8(cache), table, lens)
}

/// [`kv_cache_append_into`] into an f16 cache: `cache [B, max_len, H, D]`, or with `table` a
/// paged pool `[pool_blocks * page, H, D]`. Each new value is rounded to f16 (nearest even);
/// `D` is a multiple of 4.
pub fn kv_cache_append_f16_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    new: &HeadsView,
    cache: &GpuTensorF16,
    table: Option<&BlockTable>,
    lens: &SeqLens,
) -> Result<()> {
    append(ctx, encoder, new, Storage::F16(cache), table, lens)
}

/// An f16 cache's rows are read as pairs, and by the decode kernel four values at a time: `arg`'s
/// head dim (the last of `shape`) must be a multiple of 4.
pub(crate) fn check_f16_dims(arg: &'static str, shape: &[usize]) -> Result<()> {
    match shape.last() {
        Some(d) if d.is_multiple_of(4) => Ok(()),
        _ => Err(Error::shape(
            arg,
            format!("has shape {shape:?}; an f16 cache's head_dim must be a multiple of 4"),
        )),
    }
}

/// Records the gather of the first `rows` positions of every sequence of a paged f32 `pool` (`[1,
/// pool rows, H, D]`, any strides with contiguous head dims) through `table` into `out [B, rows, H,
/// D]` (contiguous), zeros past each sequence's `kv_lens` (`lens` as [`SeqLens::check_decode`]
/// describes, `rows` at most the table's capacity). A prefill-shaped step over a paged cache runs
/// the fused forward on what this gathers. Nothing is recorded if an argument is rejected.
pub fn kv_cache_gather_paged_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    pool: &HeadsView,
    table: &BlockTable,
    lens: &SeqLens,
    rows: usize,
    out: &GpuTensor,
) -> Result<()> {
    crate::kernels::arguments::check_f32(&[("pool", pool)])?;
    let [one, pool_rows, h, d] = pool.shape();
    if one != 1 || pool_rows != table.pool_rows() {
        return Err(Error::shape(
            "pool",
            format!(
                "has shape {:?}; the table's pool needs [1, {}, heads, head_dim]",
                pool.shape(),
                table.pool_rows()
            ),
        ));
    }
    check_gather(
        ctx,
        table.slots(),
        table.capacity(),
        [h, d],
        lens,
        rows,
        out,
    )?;
    crate::kernels::arguments::check_call(
        ctx,
        &[("out", out.region())],
        &[("pool", pool.region()), ("seq_lens", lens.region())],
    )?;
    check_binding(ctx, "kv cache pool", pool.buffer().size())?;
    let narrow = |v| narrow("pool (offset or stride in elements)", v);
    let [_, ss, sh] = pool.strides();
    let view = [narrow(pool.offset())?, narrow(ss)?, narrow(sh)?];
    let n = table.slots() * rows * h * d;
    let gather = Gather {
        name: "kv_cache_gather",
        source: GATHER,
        cache: pool.buffer(),
        table: Some(table),
        dims: [table.slots(), h, d],
        max_len: table.capacity(),
        view,
        invocations: n,
    };
    gather.encode(ctx, encoder, lens, rows, out)
}

/// Records the gather of the first `rows` positions of every sequence of an int8 `cache` (`[B,
/// max_len, H, D]`, or with `table` a paged pool `[pool rows, H, D]` read through it), dequantised
/// (each value `unpack(word) * scale`, see [`GpuTensorQ8`]), into `out [B, rows, H, D]` (f32,
/// contiguous), zeros past each sequence's `kv_lens`. A prefill-shaped step over an int8 cache runs
/// the fused forward on what this gathers. Nothing is recorded if an argument is rejected.
pub fn kv_cache_gather_int8_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    cache: &GpuTensorQ8,
    table: Option<&BlockTable>,
    lens: &SeqLens,
    rows: usize,
    out: &GpuTensor,
) -> Result<()> {
    gather_rows(ctx, encoder, Storage::Int8(cache), table, lens, rows, out)
}

/// The gathers out of int8 and f16 caches (dense rows of words, contiguous or paged): what
/// [`kv_cache_gather_int8_into`] and [`kv_cache_gather_f16_into`] record.
pub(crate) fn gather_rows(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    cache: Storage<'_>,
    table: Option<&BlockTable>,
    lens: &SeqLens,
    rows: usize,
    out: &GpuTensor,
) -> Result<()> {
    let (batch, max_len, [h, d]) = match (table, cache.shape()) {
        (None, &[b, max_len, h, d]) => (b, max_len, [h, d]),
        (Some(t), &[pool_rows, h, d]) if pool_rows == t.pool_rows() => {
            (t.slots(), t.capacity(), [h, d])
        }
        (_, shape) => {
            return Err(Error::shape(
                "cache",
                format!(
                    "has shape {shape:?}; expected {}",
                    match table {
                        None => "[batch, max_len, heads, head_dim]".to_string(),
                        Some(t) =>
                            format!("[{}, heads, head_dim] (the table's pool)", t.pool_rows()),
                    }
                ),
            ))
        }
    };
    if let Storage::F16(t) = cache {
        check_f16_dims("cache", t.shape())?;
    }
    check_gather(ctx, batch, max_len, [h, d], lens, rows, out)?;
    let words = cache.words();
    crate::kernels::arguments::check_call(
        ctx,
        &[("out", out.region())],
        &[("cache", words.region()), ("seq_lens", lens.region())],
    )?;
    check_binding(ctx, "kv cache", words.size_bytes())?;
    // One invocation per word: four int8 values, or two f16.
    let (name, source, per_word) = match cache {
        Storage::Int8(_) => ("kv_cache_gather_int8", GATHER_INT8, 4),
        _ => ("kv_cache_gather_f16", GATHER_F16, 2),
    };
    let gather = Gather {
        name,
        source,
        cache: words.buffer(),
        table,
        dims: [batch, h, d],
        max_len,
        view: [0; 3],
        invocations: batch * rows * h * d / per_word,
    };
    gather.encode(ctx, encoder, lens, rows, out)
}

/// Records the gather of the first `rows` positions of every sequence of an f16 `cache` (`[B,
/// max_len, H, D]`, or with `table` a paged pool `[pool rows, H, D]` read through it), widened to
/// f32, into `out [B, rows, H, D]` (contiguous), zeros past each sequence's `kv_lens`. A
/// prefill-shaped step over an f16 cache runs the fused forward on what this gathers. Nothing is
/// recorded if an argument is rejected.
pub fn kv_cache_gather_f16_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    cache: &GpuTensorF16,
    table: Option<&BlockTable>,
    lens: &SeqLens,
    rows: usize,
    out: &GpuTensor,
) -> Result<()> {
    gather_rows(ctx, encoder, Storage::F16(cache), table, lens, rows, out)
}

/// `v` as the kernels' u32, or a typed error naming `arg`.
fn narrow(arg: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::Unsupported {
        arg,
        value: v as u64,
        limit: u32::MAX as u64,
        hint: "",
    })
}

/// What both gathers check: `lens` has kv_lens for the `batch` sequences, none beyond `max_len`,
/// `rows` is at most `max_len`, and `out` is `[batch, rows, heads, dim]`.
fn check_gather(
    ctx: &Context,
    batch: usize,
    max_len: usize,
    [h, d]: [usize; 2],
    lens: &SeqLens,
    rows: usize,
    out: &GpuTensor,
) -> Result<()> {
    if rows > max_len {
        return Err(Error::shape(
            "rows",
            format!("is {rows}; the cache holds {max_len} positions per sequence"),
        ));
    }
    if out.shape() != [batch, rows, h, d] {
        return Err(Error::shape(
            "out",
            format!(
                "has shape {:?}; gathering needs [{batch}, {rows}, {h}, {d}]",
                out.shape()
            ),
        ));
    }
    let Some(kv_lens) = lens.kv_lens().filter(|_| lens.batch() == batch) else {
        return Err(Error::shape(
            "seq_lens",
            format!("gathering needs kv_lens for the cache's {batch} sequences"),
        ));
    };
    if let Some((i, len)) = kv_lens
        .iter()
        .enumerate()
        .find(|(_, len)| **len as usize > max_len)
    {
        return Err(Error::shape(
            "kv_lens",
            format!("entry {i} is {len}, beyond the cache's {max_len} positions"),
        ));
    }
    check_binding(ctx, "gathered kv rows", out.size_bytes())
}

/// One gather dispatch: its kernel, the cache's buffer and layout.
struct Gather<'a> {
    name: &'static str,
    source: &'static str,
    cache: &'a wgpu::Buffer,
    table: Option<&'a BlockTable>,
    /// Sequences, heads, head dim.
    dims: [usize; 3],
    max_len: usize,
    /// The f32 cache's offset and position and head strides, in elements.
    view: [u32; 3],
    invocations: usize,
}

impl Gather<'_> {
    fn encode(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        lens: &SeqLens,
        rows: usize,
        out: &GpuTensor,
    ) -> Result<()> {
        let [b, h, d] = self.dims;
        let [view_offset, stride_s, stride_h] = self.view;
        let paging = Paging::of(self.table, lens);
        let [table_stride, pool_blocks] = paging.layout;
        let params = AppendParams {
            batch: b as u32,
            seq: rows as u32,
            heads: h as u32,
            dim: d as u32,
            max_len: self.max_len as u32,
            grid_x: grid_x(ctx, self.invocations)?,
            view_offset,
            stride_b: 0,
            stride_s,
            stride_h,
            packed: 0,
            table_stride,
            pool_blocks,
            pad: [0; 3],
        };
        encode(
            ctx,
            encoder,
            SimpleKernel {
                name: self.name,
                source: self.source,
                constants: &paging.constants,
            },
            bytemuck::bytes_of(&params),
            &[self.cache, out.buffer(), lens.buffer(), paging.table],
            self.invocations,
        )
    }
}

/// What a cache kernel takes from its block table: the page (an override constant), the table's
/// buffer and its stride and pool size (uniforms). A contiguous cache has no page and binds the
/// lengths where the table would be (the shader does not read it).
struct Paging<'a> {
    constants: Vec<(&'static str, u32)>,
    table: &'a wgpu::Buffer,
    layout: [u32; 2],
}

impl<'a> Paging<'a> {
    fn of(table: Option<&'a BlockTable>, lens: &'a SeqLens) -> Self {
        match table {
            Some(t) => Self {
                constants: t.constants().to_vec(),
                table: t.buffer(),
                layout: t.layout(),
            },
            None => Self {
                constants: Vec::new(),
                table: lens.buffer(),
                layout: [0, 0],
            },
        }
    }
}

/// A cache's storage in any format (decode attention's int8 and f16 caches are these too).
#[derive(Clone, Copy)]
pub(crate) enum Storage<'a> {
    F32(&'a GpuTensor),
    Int8(&'a GpuTensorQ8),
    F16(&'a GpuTensorF16),
}

impl<'a> Storage<'a> {
    /// The logical shape (values).
    pub(crate) fn shape(&self) -> &'a [usize] {
        match *self {
            Storage::F32(t) => t.shape(),
            Storage::Int8(t) => t.shape(),
            Storage::F16(t) => t.shape(),
        }
    }

    /// The buffer's words as the kernel binds them.
    pub(crate) fn words(&self) -> GpuTensor {
        match *self {
            Storage::F32(t) => t.clone(),
            Storage::Int8(t) => t.words().clone(),
            Storage::F16(t) => t.words(),
        }
    }
}

fn append(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    new: &HeadsView,
    storage: Storage<'_>,
    table: Option<&BlockTable>,
    lens: &SeqLens,
) -> Result<()> {
    if let Storage::F16(t) = storage {
        check_f16_dims("cache", t.shape())?;
    }
    let cache = &storage.words();
    crate::kernels::arguments::check_f32(&[("new", new)])?;
    let [b, l, h, d] = new.shape();
    let max_len = match table {
        None => {
            let &[cb, max_len, ch, cd] = storage.shape() else {
                return Err(Error::shape(
                    "cache",
                    format!(
                        "has shape {:?}; expected [batch, max_len, heads, head_dim]",
                        storage.shape()
                    ),
                ));
            };
            if [cb, ch, cd] != [b, h, d] {
                return Err(Error::shape(
                    "cache",
                    format!(
                        "has shape {:?}; the new rows {:?} need [{b}, max_len, {h}, {d}]",
                        storage.shape(),
                        new.shape()
                    ),
                ));
            }
            max_len
        }
        Some(t) => {
            let expected = [t.pool_rows(), h, d];
            if storage.shape() != expected {
                return Err(Error::shape(
                    "pool",
                    format!(
                        "has shape {:?}; the table's pool and the new rows {:?} need {expected:?}",
                        storage.shape(),
                        new.shape()
                    ),
                ));
            }
            if t.slots() != b {
                return Err(Error::shape(
                    "block table",
                    format!("has {} sequences; the new rows have {b}", t.slots()),
                ));
            }
            t.capacity()
        }
    };
    lens.check_decode(b, l, max_len)?;
    crate::kernels::arguments::check_call(
        ctx,
        &[("cache", cache.region())],
        &[("new", new.region()), ("seq_lens", lens.region())],
    )?;
    check_binding(ctx, "kv cache", cache.size_bytes())?;
    check_binding(ctx, "new kv rows", new.buffer().size())?;
    // Packed new rows (a packed prefill) follow the queries' side of the packed lengths.
    crate::kernels::arguments::check_packed_queries(&[("new", new)], Some(lens))?;
    let narrow = |v| narrow("new kv rows (offset or stride in elements)", v);
    let [sb, ss, sh] = new.strides();
    // One invocation per element (f32), per pair (f16), or per row of one head (int8: the row's
    // scale first).
    let (name, source, n) = match storage {
        Storage::F32(_) => ("kv_cache_append", APPEND, b * l * h * d),
        Storage::Int8(_) => ("kv_cache_append_int8", APPEND_INT8, b * l * h),
        Storage::F16(_) => ("kv_cache_append_f16", APPEND_F16, b * l * h * d / 2),
    };
    let paging = Paging::of(table, lens);
    let [table_stride, pool_blocks] = paging.layout;
    let params = AppendParams {
        batch: b as u32,
        seq: l as u32,
        heads: h as u32,
        dim: d as u32,
        max_len: max_len as u32,
        grid_x: grid_x(ctx, n)?,
        view_offset: narrow(new.offset())?,
        stride_b: narrow(sb)?,
        stride_s: narrow(ss)?,
        stride_h: narrow(sh)?,
        packed: new.packed_side().is_some() as u32,
        table_stride,
        pool_blocks,
        pad: [0; 3],
    };
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name,
            source,
            constants: &paging.constants,
        },
        bytemuck::bytes_of(&params),
        &[new.buffer(), cache.buffer(), lens.buffer(), paging.table],
        n,
    )
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    let append = uniform_layout!(
        "kv_cache_append",
        "Params",
        AppendParams {
            batch,
            seq,
            heads,
            dim,
            max_len,
            grid_x,
            view_offset,
            stride_b,
            stride_s,
            stride_h,
            packed,
            table_stride,
            pool_blocks,
        }
    );
    append.also_read_by(&[
        "kv_cache_append_int8",
        "kv_cache_gather",
        "kv_cache_gather_int8",
        "kv_cache_append_f16",
        "kv_cache_gather_f16",
    ])
}
