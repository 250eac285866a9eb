//! Key/value cache append (`shaders/kv_cache_append.wgsl`): a decoding step's new keys or values, a
//! strided `[B, L, H, D]` view (the K or V columns of a projection), copied into a cache
//! `[B, max_len, H, D]` after each sequence's cached tokens, or into a paged pool through a
//! [`BlockTable`]. The caches themselves (per layer, with their lengths) are
//! [`crate::inference::KvCache`] and [`crate::inference::PagedKvCache`]. CPU reference:
//! [`crate::reference::kv_cache`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::check_binding;
use crate::kernels::dispatch::{encode, grid_x};
use crate::tensor::{GpuTensor, GpuTokens, HeadsView, SeqLens};

const APPEND: &str = include_str!("../../shaders/kv_cache_append.wgsl");

/// The append shader by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![("kv_cache_append", APPEND.to_string())]
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
    pad: [u32; 2],
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
    /// first: on error nothing is written).
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

    /// The kernels' override constants.
    pub(crate) fn constants(&self) -> [(&'static str, u32); 3] {
        [
            ("PAGE", self.page as u32),
            ("TABLE_STRIDE", self.stride as u32),
            ("POOL_BLOCKS", self.pool_blocks as u32),
        ]
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
    append(ctx, encoder, new, cache, None, lens)
}

/// [`kv_cache_append_into`] into a paged pool `[pool_blocks * page, H, D]` through `table` (one
/// table row per sequence of `new`): position `p` of sequence `b` goes to pool row
/// `table[b][p / page] * page + p % page`. The blocks the new rows fall in must be the sequence's
/// own ([`crate::inference::PagedKvCache`] copies shared ones first).
pub fn kv_cache_append_paged_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    new: &HeadsView,
    pool: &GpuTensor,
    table: &BlockTable,
    lens: &SeqLens,
) -> Result<()> {
    append(ctx, encoder, new, pool, Some(table), lens)
}

fn append(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    new: &HeadsView,
    cache: &GpuTensor,
    table: Option<&BlockTable>,
    lens: &SeqLens,
) -> Result<()> {
    crate::kernels::attention::check_f32(&[("new", new)])?;
    let [b, l, h, d] = new.shape();
    let max_len = match table {
        None => {
            let &[cb, max_len, ch, cd] = cache.shape() else {
                return Err(Error::shape(
                    "cache",
                    format!(
                        "has shape {:?}; expected [batch, max_len, heads, head_dim]",
                        cache.shape()
                    ),
                ));
            };
            if [cb, ch, cd] != [b, h, d] {
                return Err(Error::shape(
                    "cache",
                    format!(
                        "has shape {:?}; the new rows {:?} need [{b}, max_len, {h}, {d}]",
                        cache.shape(),
                        new.shape()
                    ),
                ));
            }
            max_len
        }
        Some(t) => {
            let expected = [t.pool_rows(), h, d];
            if cache.shape() != expected {
                return Err(Error::shape(
                    "pool",
                    format!(
                        "has shape {:?}; the table's pool and the new rows {:?} need {expected:?}",
                        cache.shape(),
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
    let narrow = |v: usize| {
        u32::try_from(v).map_err(|_| Error::Unsupported {
            arg: "new kv rows (offset or stride in elements)",
            value: v as u64,
            limit: u32::MAX as u64,
            hint: "",
        })
    };
    let [sb, ss, sh] = new.strides();
    let n = b * l * h * d;
    let params = AppendParams {
        batch: b as u32,
        seq: l as u32,
        heads: h as u32,
        dim: d as u32,
        max_len: max_len as u32,
        grid_x: grid_x(n),
        view_offset: narrow(new.offset())?,
        stride_b: narrow(sb)?,
        stride_s: narrow(ss)?,
        stride_h: narrow(sh)?,
        pad: [0; 2],
    };
    // A contiguous cache binds the lengths where the table would be (the shader does not read it).
    let (constants, table_buffer) = match table {
        Some(t) => (t.constants().to_vec(), t.buffer()),
        None => (Vec::new(), lens.buffer()),
    };
    encode(
        ctx,
        encoder,
        "kv_cache_append",
        APPEND,
        &constants,
        bytemuck::bytes_of(&params),
        &[new.buffer(), cache.buffer(), lens.buffer(), table_buffer],
        n,
    );
    Ok(())
}
