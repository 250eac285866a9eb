//! Decode attention (`shaders/attention/decode.wgsl`): the attention step of incremental
//! generation, a few new queries per sequence (`q_lens`, 1 to 8 when decoding, a prompt chunk when
//! prefilling) against a key/value cache `[B, max_len, Hkv, D]` holding `kv_lens` keys each, the
//! new ones last. Masks and score modifiers align on each sequence's own lengths: query `i` of
//! sequence `b` sits at position `kv_lens[b] - q_lens[b] + i`, so one batch holds sequences of
//! different lengths.
//!
//! The query heads that share a KV head are one workgroup's rows (GQA-aware: each K/V row is read
//! once per group); with the GPU kernel families caches are read a tile of keys at a time into
//! workgroup memory (coalesced, a step's loads issued together; f16 widened and int8 dequantised
//! as they are staged), with the CPU drivers' family in place; f32 caches whose rows start on
//! four-word boundaries are read a vec4 per access. Each tile's softmax runs on every invocation (row maxima and sums in two
//! steps, each key's P by its own invocation); the key range is split over workgroups when the grid would
//! leave a GPU idle (or llvmpipe's loop budget asks for it), the partial softmaxes merged in split
//! order: deterministic. CPU reference: [`crate::reference::attention::attention_decode`].

use super::binding::{
    base_params, bind_block_table, bind_tensor, bind_view, encode_kernel, inputs_on_vec4, set_grid,
    Bound, Kernel, Shared, FLAG_ALIGN_LENS, VIEW_K, VIEW_O, VIEW_Q, VIEW_V,
};
use super::call::{AttentionOutput, CacheRead, ForwardViews};
use super::forward::{attention_forward_into, check_forward_outputs, record_forward_cached};
use super::gpu::{encode_split_merge, split_scratch};
use super::header::{with_common, with_sizes, KV_PAGES};
use super::options::AttentionOptions;
use super::shape::{check_options_with, refuse_packed, MAX_HEAD_DIM};
use super::variant::KvWords;
use super::{qk_norm, sinks};
use crate::device::{Context, KernelFamily};
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_f32, check_packed_queries};
use crate::kernels::kv_cache::{check_f16_dims, BlockTable, Storage};
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, GpuTensorF16, GpuTensorQ8, HeadsView};

pub(super) const SOURCE: &str = include_str!("../../../shaders/attention/decode.wgsl");
/// The caches' bindings and reads: a word per access, or four (`VEC4`).
const CACHE_WORDS: &str = include_str!("../../../shaders/attention/decode_cache.wgsl");
const CACHE_WORDS_VEC4: &str = include_str!("../../../shaders/attention/decode_cache_vec4.wgsl");

/// Invocations per workgroup, and keys per tile (each invocation scores one key of a tile): the
/// first of these whose staged K/V tile fits the adapter's workgroup storage beside a few rows
/// (multiples of 4: the staged softmax steps over four keys).
const TILE_KEYS: [usize; 5] = [64, 32, 16, 8, 4];
/// Rows (query head, query) one workgroup owns at most (`MAX_ROWS` in the shader: each invocation
/// keeps one score per row); never more than its invocations (one owns each row's softmax).
const MAX_ROWS: usize = 64;
/// Rows a tile shape should hold beside its K/V tile before a narrower tile is preferred: the
/// query heads of a GQA group (and a few draft tokens) share each staged key.
const MIN_SHARED_ROWS: usize = 8;
/// O items (row, vec4 column) one invocation accumulates at most (`MAX_OWN`).
const MAX_OWN: usize = 16;
/// Private floats an invocation may keep in its score and accumulator arrays (`ROWS + 4 * OWN`):
/// beyond 64 the kernel needs more than the 128 VGPRs RDNA3 gives a wave64 invocation and spills
/// (RADV, gfx1100: 40 rows x Dv 64 spills, 32 rows does not; BENCHMARKS.md "Compiler statistics").
const MAX_PRIVATE_FLOATS: usize = 64;
/// Workgroups a decode grid should reach before split-KV stops paying: four per SM of an H100 on
/// GPUs; on CPU drivers, a few per core (llvmpipe runs a workgroup on one thread: one sequence and
/// KV head alone would use one core of many).
const SPLIT_TARGET_WORKGROUPS: usize = 528;
const SPLIT_TARGET_WORKGROUPS_CPU: usize = 8;
/// Fewest keys a split covers on a GPU, so the merge stays a small fraction of the work.
const SPLIT_MIN_KEYS: usize = 256;

/// New-row slots from which decode attention runs a step on the fused forward kernels (contiguous
/// f32 caches): the crossover measured on lavapipe lies between 16 and 64.
pub const PREFILL_FORWARD_ROWS: usize = 64;

/// How [`attention_decode_into`] runs a problem: `rows` (query head, query) rows per workgroup of
/// `tile_keys` invocations, `blocks` row blocks per (sequence, KV head), and the key range cut
/// into `splits` slices of `split_keys` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// Query rows (query heads of a group times new tokens) one workgroup owns.
    pub rows: usize,
    /// Workgroups per (sequence, kv head) over those rows.
    pub blocks: usize,
    /// Split-KV slices of the key range (1: no merge).
    pub splits: usize,
    /// Keys per slice.
    pub split_keys: usize,
    /// Keys per tile, and invocations per workgroup.
    pub tile_keys: usize,
    /// Whether each tile's keys and values are staged in workgroup memory (GPU kernel families;
    /// int8 values dequantised) or read in place (CPU drivers).
    pub staged: bool,
}

impl DecodePlan {
    /// The plan over an f32 cache for `s` (`kv_seq` the cache's capacity) when the longest
    /// sequence holds `longest` keys.
    pub fn new(ctx: &Context, s: &AttentionShape, longest: usize) -> Result<Self> {
        Self::plan(ctx, s, longest, false, stages_tiles(ctx))
    }

    /// [`DecodePlan::new`] over an int8 cache ([`crate::GpuTensorQ8`]): the same plan, its tiles
    /// dequantised as they are staged.
    pub fn new_int8(ctx: &Context, s: &AttentionShape, longest: usize) -> Result<Self> {
        Self::new(ctx, s, longest)
    }

    /// The plan for packed queries ([`crate::HeadsView::packed`]) over an f32 cache, whose longest
    /// sequence changes from call to call: rows per workgroup (a pipeline constant) as for the next
    /// power of two of `q_seq` rows, so a prefill of varied lengths compiles a few pipelines, not
    /// one per length.
    pub fn packed(ctx: &Context, s: &AttentionShape, longest: usize) -> Result<Self> {
        Self::plan(ctx, s, longest, true, stages_tiles(ctx))
    }

    /// The plan for `packed` queries or not, K/V tiles `staged` in workgroup memory (GPU families)
    /// or read in place (CPU drivers).
    fn plan(
        ctx: &Context,
        s: &AttentionShape,
        longest: usize,
        packed: bool,
        staged: bool,
    ) -> Result<Self> {
        let rounded = AttentionShape {
            q_seq: match packed {
                true => s.q_seq.next_power_of_two(),
                false => s.q_seq,
            },
            ..*s
        };
        let total = (rounded.heads / rounded.kv_heads) * rounded.q_seq;
        let (tile_keys, cap) = tile_shape(ctx, &rounded, total, staged)?;
        let rows = total.div_ceil(total.div_ceil(cap));
        Ok(Self::with_rows(ctx, s, longest, rows, tile_keys, staged))
    }

    /// The blocks and key splits of `rows` rows per workgroup of `tile_keys` invocations.
    fn with_rows(
        ctx: &Context,
        s: &AttentionShape,
        longest: usize,
        rows: usize,
        tile_keys: usize,
        staged: bool,
    ) -> Self {
        let total = (s.heads / s.kv_heads) * s.q_seq;
        let blocks = total.div_ceil(rows);
        let groups = blocks * s.batch * s.kv_heads;
        let tiles = longest.div_ceil(tile_keys).max(1);
        let target = match (ctx.decode_shape(), ctx.is_cpu()) {
            (Some((_, workgroups)), _) => workgroups as usize,
            (None, true) => SPLIT_TARGET_WORKGROUPS_CPU,
            (None, false) => SPLIT_TARGET_WORKGROUPS,
        };
        let splits = target
            .div_ceil(groups)
            .min(longest.div_ceil(SPLIT_MIN_KEYS))
            .max(1);
        let mut splits = if groups < target { splits } else { 1 };
        if let Some(budget) = ctx.loop_budget() {
            let (per_tile, fixed) = Self::loop_cost(s, rows, tile_keys, staged);
            let max_tiles = ((budget as usize).saturating_sub(fixed) / per_tile).max(1);
            splits = splits.max(tiles.div_ceil(max_tiles));
        }
        let split_keys = tiles.div_ceil(splits) * tile_keys;
        Self {
            rows,
            blocks,
            splits: tiles.div_ceil(split_keys / tile_keys),
            split_keys,
            tile_keys,
            staged,
        }
    }

    /// Loop iterations one invocation runs per key tile and outside the key loop, counted as if
    /// nothing were unrolled (for llvmpipe's loop budget; relative buckets count their threshold
    /// loop).
    fn loop_cost(s: &AttentionShape, rows: usize, wg: usize, staged: bool) -> (usize, usize) {
        let (dk4, dv4) = (s.head_dim_qk.div_ceil(4), s.head_dim_v.div_ceil(4));
        let (own, phases) = own_and_phases(rows, s, wg);
        // The softmax: partial maxima and sums over a lane's keys, the row's lanes combined, P of
        // the invocation's key in every row (LPR and KPL in the shader).
        let lanes_per_row = (wg / rows).clamp(1, 8);
        let softmax = 2 * wg.div_ceil(lanes_per_row) + 2 * lanes_per_row + rows;
        // Staged: staging (one element per iteration), scores, softmax, P V from workgroup memory;
        // in place: scores and P V reading the cache.
        let per_tile = match staged {
            true => {
                4 * (dk4 + dv4) * 3
                    + dk4 * (rows + 2)
                    + rows * 16
                    + softmax
                    + own * (wg / phases * 3 + 1)
                    + 8
            }
            false => dk4 * (rows + 5) + rows * 16 + softmax + own * (wg / phases * 5 + 1) + 8,
        };
        let fixed = (rows * dk4 * 4).div_ceil(wg) + own * 8 + phases + 32;
        (per_tile, fixed)
    }
}

/// Whether caches are staged a tile at a time in workgroup memory: with the GPU kernel families,
/// not with the CPU drivers' (f32: faster on an NVIDIA H200, slower on lavapipe, where workgroup
/// memory is ordinary memory and the copy overhead; benchmarks/decode-2026-11-28). Int8 tiles are
/// dequantised as they are staged (2026-11-29; the int8 kernel read in place ran at f32's time for
/// a quarter of the bytes on the H200, its P V waiting on a cache load per key).
fn stages_tiles(ctx: &Context) -> bool {
    ctx.kernel_family() != KernelFamily::CpuDriver
}

/// O items (row, vec4 column) per invocation of a workgroup of `rows` rows and `wg`
/// invocations, and key phases of the P V product (`OWN` and `KG` in the shader).
fn own_and_phases(rows: usize, s: &AttentionShape, wg: usize) -> (usize, usize) {
    let items = rows * s.head_dim_v.div_ceil(4);
    let lanes = items.min(wg);
    (items.div_ceil(wg), wg / lanes)
}

/// Keys per tile (invocations per workgroup) and the most rows a workgroup of them may own, for
/// `total` rows per (sequence, KV head): the widest tile whose workgroup storage (the shader's
/// arrays, below) fits the adapter with `MIN_SHARED_ROWS` rows (or all of them), else the widest
/// that fits one.
fn tile_shape(
    ctx: &Context,
    s: &AttentionShape,
    total: usize,
    staged: bool,
) -> Result<(usize, usize)> {
    let (dk4, dv4) = (s.head_dim_qk.div_ceil(4), s.head_dim_v.div_ceil(4));
    let storage = ctx.limits().max_compute_workgroup_storage_size as usize;
    // q_tile, s_tile, alpha/m/l per row; red, part_max and part_sum per key; staged, k_tile (rows
    // padded by a vec4) and v_tile per key, else the value scales.
    let tiles = |wg: usize| match staged {
        true => wg * (dk4 + 1) * 16 + wg * dv4 * 16,
        false => wg * 4,
    };
    let bytes = |rows: usize, wg: usize| rows * (dk4 * 16 + wg * 4 + 12) + wg * 24 + tiles(wg);
    let cap = |wg: usize| {
        let private = |rows: usize| rows + 4 * (rows * dv4).div_ceil(wg);
        (1..=MAX_ROWS.min(wg).min(MAX_OWN * wg / dv4.max(1)))
            .rev()
            .find(|&rows| {
                bytes(rows, wg) <= storage && (rows == 1 || private(rows) <= MAX_PRIVATE_FLOATS)
            })
    };
    if let Some((keys, _)) = ctx.decode_shape() {
        match cap(keys as usize) {
            Some(rows) => return Ok((keys as usize, rows)),
            None => log::warn!(
                "wgpu-attention: decode_shape {keys} keys per tile does not fit head dims {}/{} \
                 in {storage} bytes of workgroup storage: ignored",
                s.head_dim_qk,
                s.head_dim_v
            ),
        }
    }
    let shapes = || TILE_KEYS.iter().filter_map(|&wg| Some((wg, cap(wg)?)));
    shapes()
        .find(|&(_, rows)| rows >= total.min(MIN_SHARED_ROWS))
        .or_else(|| shapes().next())
        .ok_or(Error::Unsupported {
            arg: "head_dim (decode attention, workgroup storage)",
            value: s.head_dim_qk as u64,
            limit: MAX_HEAD_DIM as u64,
            hint: " for this adapter's workgroup storage",
        })
}

/// Decode attention into new tensors, submitted to the queue: `out [B, Lq, H, Dv]`, `lse [B, H,
/// Lq]` (rows past `q_lens[b]` give 0 and `-inf`).
pub fn attention_decode(
    ctx: &Context,
    q: &HeadsView,
    k_cache: &HeadsView,
    v_cache: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionOutput> {
    let s = AttentionShape::of(q, k_cache, v_cache)?;
    AttentionOutput::recorded(ctx, &s, |encoder, out, lse| {
        attention_decode_into(
            ctx,
            encoder,
            &ForwardViews {
                q,
                k: k_cache,
                v: v_cache,
                out,
                lse,
            },
            opts,
        )
    })
}

/// Records decode attention: `q [B, Lq, H, Dk]` against `k_cache [B, max_len, Hkv, Dk]` and
/// `v_cache [B, max_len, Hkv, Dv]`, writing `out` (a `[B, Lq, H, Dv]` view) and `lse`
/// (`[B, H, Lq]`). `opts.seq_lens` must give `q_lens` (new queries per sequence, at most Lq) and
/// `kv_lens` (cached keys per sequence including the new ones, at most max_len). Causal, window,
/// ALiBi, softcap, sinks, relative buckets, cosine scores and key clipping apply as in
/// [`attention_forward_into`] (the last two transform the new queries and the cache's first
/// max(kv_lens) positions into scratch each call); an additive bias tensor is refused. Nothing is
/// recorded if the input is rejected.
pub fn attention_decode_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let s = AttentionShape::of(views.q, views.k, views.v)?;
    decode_into(ctx, encoder, views, CacheLayout::CONTIGUOUS, s, opts)
}

/// [`attention_decode_into`] against a paged cache: `views.k`, the key pool `[1, pool rows, Hkv,
/// Dk]`, and `views.v`, the value pool `[1, pool rows, Hkv, Dv]`, read through `table` (one row per sequence of `q`; key `j` of sequence
/// `b` is pool row `table[b][j / page] * page + j % page`), `kv_lens` at most the table's
/// capacity. Every mask and modifier of the contiguous cache applies (cosine scores and key
/// clipping transform the sequences' cached keys after gathering them into scratch).
pub fn attention_decode_paged_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    table: &BlockTable,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let s = AttentionShape::paged(
        views.q,
        views.k.shape(),
        views.v.shape(),
        table.pool_rows(),
        table.capacity(),
    )?;
    check_table(table, &s)?;
    let layout = CacheLayout {
        table: Some(table),
        stored: None,
    };
    decode_into(ctx, encoder, views, layout, s, opts)
}

/// An int8 KV cache (see [`GpuTensorQ8`]) as [`attention_decode_int8_into`] reads it: `k [B,
/// max_len, Hkv, Dk]` and `v [B, max_len, Hkv, Dv]`, or with `table` the pools `[pool rows, Hkv,
/// D]` of a paged cache read through it (as [`attention_decode_paged_into`]).
#[derive(Clone, Copy)]
pub struct QuantizedCache<'a> {
    /// The keys' int8 rows and scales.
    pub k: &'a GpuTensorQ8,
    /// The values' int8 rows and scales.
    pub v: &'a GpuTensorQ8,
    /// The block table of a paged cache, `None` for a contiguous one.
    pub table: Option<&'a BlockTable>,
}

/// An f16 KV cache as [`attention_decode_f16_into`] reads it: `k [B, max_len, Hkv, Dk]` and `v
/// [B, max_len, Hkv, Dv]` ([`GpuTensorF16`], head dims multiples of 4), or with `table` the pools
/// `[pool rows, Hkv, D]` of a paged cache read through it (as [`attention_decode_paged_into`]).
#[derive(Clone, Copy)]
pub struct HalfCache<'a> {
    /// The keys.
    pub k: &'a GpuTensorF16,
    /// The values.
    pub v: &'a GpuTensorF16,
    /// The block table of a paged cache, `None` for a contiguous one.
    pub table: Option<&'a BlockTable>,
}

/// [`attention_decode_into`] against an int8 cache, dequantised in registers by the decode kernel
/// (a prefill-shaped step: by the fused forward as it stages the cache). Every mask and
/// modifier applies (cosine scores and key clipping transform the keys after dequantising them into
/// scratch). Against the f32 cache of the same keys and values each cached value moves by at most
/// `max |row| / 254`.
pub fn attention_decode_int8_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    q: &HeadsView,
    cache: QuantizedCache<'_>,
    out: &HeadsView,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let stored = [Storage::Int8(cache.k), Storage::Int8(cache.v)];
    decode_stored(ctx, encoder, [q, out], stored, cache.table, lse, opts)
}

/// [`attention_decode_into`] against an f16 cache, widened to f32 in registers by the decode kernel
/// (a prefill-shaped step: by the fused forward as it stages the cache). Every mask and modifier applies. The
/// result is the f32 cache's over the f16-rounded keys and values, at f32's tolerances; no adapter
/// feature is needed (the kernel reads the halves as words).
pub fn attention_decode_f16_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    q: &HeadsView,
    cache: HalfCache<'_>,
    out: &HeadsView,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let stored = [Storage::F16(cache.k), Storage::F16(cache.v)];
    decode_stored(ctx, encoder, [q, out], stored, cache.table, lse, opts)
}

/// The int8 and f16 entries: the caches' logical shapes checked, their words viewed as the kernel
/// reads them.
fn decode_stored(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    [q, out]: [&HeadsView; 2],
    stored: [Storage<'_>; 2],
    table: Option<&BlockTable>,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let dims = |arg: &'static str, shape: &[usize], paged: bool| -> Result<[usize; 4]> {
        match (shape, paged) {
            (&[b, l, h, d], false) => Ok([b, l, h, d]),
            (&[rows, h, d], true) => Ok([1, rows, h, d]),
            (shape, _) => Err(Error::shape(
                arg,
                format!(
                    "has shape {shape:?}; expected {}",
                    match paged {
                        false => "[batch, max_len, kv heads, head_dim]",
                        true => "[pool rows, kv heads, head_dim] (a paged pool)",
                    }
                ),
            )),
        }
    };
    let paged = table.is_some();
    let [k_shape, v_shape] = stored.map(|t| t.shape());
    let (k_dims, v_dims) = (
        dims("k_cache", k_shape, paged)?,
        dims("v_cache", v_shape, paged)?,
    );
    if let Storage::F16(_) = stored[0] {
        check_f16_dims("k_cache", k_shape)?;
        check_f16_dims("v_cache", v_shape)?;
    }
    let s = match table {
        None => AttentionShape::of_dims(q.shape(), k_dims, v_dims)?,
        Some(t) => {
            let s = AttentionShape::paged(q, k_dims, v_dims, t.pool_rows(), t.capacity())?;
            check_table(t, &s)?;
            s
        }
    };
    // The kernel reads words: int8 rows of D / 4 + 1 of them, f16 rows of D / 2, the view's
    // head_dim.
    let [k_words, v_words] = stored.map(|t| t.words());
    let words = |t: GpuTensor, [b, l, h, d]: [usize; 4]| {
        let row = match stored[0] {
            Storage::Int8(_) => crate::tensor::row_words(d),
            _ => d / 2,
        };
        t.reshape(&[b, l, h, row])?.heads()
    };
    let (k_words, v_words) = (words(k_words, k_dims)?, words(v_words, v_dims)?);
    let views = ForwardViews {
        q,
        k: &k_words,
        v: &v_words,
        out,
        lse,
    };
    let layout = CacheLayout {
        table,
        stored: Some(stored),
    };
    decode_into(ctx, encoder, &views, layout, s, opts)
}

/// How a decode call's cache is stored beyond the f32 views it is read through: paged through a
/// block table, and as f32 values (`stored: None`, read through the views) or as int8 or f16
/// tensors of keys and values (the views then see their words).
#[derive(Clone, Copy)]
struct CacheLayout<'a> {
    table: Option<&'a BlockTable>,
    stored: Option<[Storage<'a>; 2]>,
}

impl CacheLayout<'_> {
    /// A contiguous f32 cache.
    const CONTIGUOUS: Self = Self {
        table: None,
        stored: None,
    };
}

/// The first `rows` positions of every sequence of a decode call's cache as contiguous f32 views:
/// a contiguous f32 cache's own rows, or, gathered into the context's scratch buffers (reused by
/// the next call that asks for them: this one's readers are recorded before it), a paged pool's
/// rows or an int8 cache's dequantised.
fn cached_rows(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    caches: [&HeadsView; 2],
    CacheLayout { table, stored }: CacheLayout<'_>,
    opts: &AttentionOptions<'_>,
    rows: usize,
) -> Result<(HeadsView, HeadsView)> {
    use crate::kernels::kv_cache::{gather_rows, kv_cache_gather_paged_into};
    let lens = match (opts.seq_lens, stored, table) {
        (Some(lens), Some(_), _) | (Some(lens), None, Some(_)) => lens,
        _ => return Ok((caches[0].first_rows(rows)?, caches[1].first_rows(rows)?)),
    };
    // Side 0 (keys) or 1 (values), `[B, rows, H, D]` in the scratch buffer `what`.
    let mut gather = |side: usize, what: &'static str| -> Result<HeadsView> {
        let (heads, dim) = match stored {
            None => {
                let [_, _, heads, dim] = caches[side].shape();
                (heads, dim)
            }
            Some(stored) => {
                let s = stored[side].shape();
                (s[s.len() - 2], s[s.len() - 1])
            }
        };
        let shape = [lens.batch(), rows, heads, dim];
        let bytes = shape.iter().product::<usize>() as u64 * 4;
        let out = GpuTensor::from_buffer(ctx.scratch_buffer(what, bytes)?, &shape)?;
        match (stored, table) {
            (Some(stored), _) => gather_rows(ctx, encoder, stored[side], table, lens, rows, &out)?,
            (None, Some(table)) => {
                kv_cache_gather_paged_into(ctx, encoder, caches[side], table, lens, rows, &out)?
            }
            (None, None) => unreachable!("a contiguous f32 cache returned above"),
        }
        out.heads()
    };
    Ok((
        gather(0, "gathered cache keys")?,
        gather(1, "gathered cache values")?,
    ))
}

fn check_table(table: &BlockTable, s: &AttentionShape) -> Result<()> {
    if table.slots() != s.batch {
        return Err(Error::shape(
            "block table",
            format!("has {} sequences; q has {}", table.slots(), s.batch),
        ));
    }
    Ok(())
}

fn decode_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    layout: CacheLayout<'_>,
    s: AttentionShape,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let &ForwardViews {
        q,
        k: k_cache,
        v: v_cache,
        out,
        lse,
    } = views;
    check_f32(&[
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("out", out),
    ])?;
    let scale = check_options_with(ctx, &s, opts, true)?;
    let longest = check_decode_lens("decode attention", [s.batch, s.q_seq, s.kv_seq], opts)?;
    if opts.bias.is_some() {
        return Err(Error::shape(
            "bias",
            "is not supported by decode attention (its rows would need the cache's positions); use attention_forward_into",
        ));
    }
    refuse_packed(
        &[("k_cache", k_cache), ("v_cache", v_cache)],
        "decode attention's caches",
    )?;
    if check_packed_queries(&[("q", q), ("out", out)], opts.seq_lens)? && qk_norm::transforms(opts)
    {
        return Err(Error::shape(
            "cosine/key_norm_clip",
            "cosine scores and key clipping take padded new rows",
        ));
    }
    check_forward_outputs(
        ctx,
        &s,
        out,
        lse,
        &[
            ("q", q.region()),
            ("k_cache", k_cache.region()),
            ("v_cache", v_cache.region()),
        ],
        opts,
    )?;
    // Prefill-shaped steps run on the fused forward kernels (K/V staged in tiles shared by a block
    // of rows; the decode kernel's rows each read every key), which overtake the decode kernel
    // from about 64 new rows (benchmarks/HISTORY.md, "Figures that code comments carried"; a
    // paged prefill on the decode kernel was far slower on an H100). They read the cache as the
    // decode kernel does: a paged one's pools through its block table, int8 and f16 words
    // dequantised as they are staged. Where cosine scores or key clipping transform the keys, the
    // cache's first `longest` positions are gathered (dequantised) into scratch first and
    // transformed there. Draft trees stay on the decode kernel.
    let tree = opts.seq_lens.and_then(|l| l.tree_slots()).is_some();
    if s.q_seq >= PREFILL_FORWARD_ROWS && !tree {
        let prefill = AttentionOptions {
            align_lens: true,
            ..*opts
        };
        let cached = layout.table.is_some() || layout.stored.is_some();
        if cached && !qk_norm::transforms(opts) {
            let cache = CacheRead {
                table: layout.table,
                words: layout.stored.and_then(|[k, _]| match k {
                    Storage::Int8(_) => Some(KvWords::Int8),
                    Storage::F16(_) => Some(KvWords::F16),
                    Storage::F32(_) => None,
                }),
            };
            // The kernels' key loops end at each sequence's length; the shape's key count bounds
            // the tiles and splits they plan.
            let s = AttentionShape {
                kv_seq: longest.max(1),
                ..s
            };
            return record_forward_cached(ctx, encoder, views, cache, (s, scale), &prefill);
        }
        let (k_read, v_read) = cached_rows(
            ctx,
            encoder,
            [k_cache, v_cache],
            layout,
            opts,
            longest.max(1),
        )?;
        return attention_forward_into(
            ctx,
            encoder,
            &ForwardViews {
                q,
                k: &k_read,
                v: &v_read,
                out,
                lse,
            },
            &prefill,
        );
    }
    let staged = stages_tiles(ctx);
    let plan = DecodePlan::plan(ctx, &s, longest, q.packed_rows().is_some(), staged)?;
    let (own, _) = own_and_phases(plan.rows, &s, plan.tile_keys);
    let shared = Shared::scores(ctx, opts)?;
    // Cosine scores and key clipping: the new queries and the cache's first `longest` positions (all
    // that any sequence reads) transformed into scratch, O(longest) per step like the attention
    // itself; the cache keeps raw keys. The kernel then reads caches of `longest` positions.
    // A paged, int8 or f16 cache is gathered (dequantised) into f32 scratch first, which the
    // kernel then reads as a contiguous f32 cache.
    let (q, k_cache, v_cache, s, CacheLayout { table, stored }) = if qk_norm::transforms(opts) {
        let (k_read, v_read) =
            cached_rows(ctx, encoder, [k_cache, v_cache], layout, opts, longest)?;
        let (q, k_read) = qk_norm::encode_inputs(ctx, encoder, q, &k_read, opts)?;
        let s = AttentionShape::of(&q, &k_read, &v_read)?;
        (q, k_read, v_read, s, CacheLayout::CONTIGUOUS)
    } else {
        (q.clone(), k_cache.clone(), v_cache.clone(), s, layout)
    };
    let (q, k_cache, v_cache) = (&q, &k_cache, &v_cache);
    let mut params = base_params(&s, scale, opts);
    params.flags |= FLAG_ALIGN_LENS;
    params.splits = plan.splits as u32;
    params.split_keys = plan.split_keys as u32;
    let q_binding = bind_view(ctx, "q", q, VIEW_Q, &mut params)?;
    let k_binding = bind_view(ctx, "k_cache", k_cache, VIEW_K, &mut params)?;
    let v_binding = bind_view(ctx, "v_cache", v_cache, VIEW_V, &mut params)?;
    let grid = set_grid(
        ctx,
        &mut params,
        plan.blocks,
        plan.splits * s.batch * s.kv_heads,
    )?;
    let scratch = split_scratch(ctx, &s, plan.splits)?;
    let partials = scratch.as_ref().map(|scratch| scratch.bind(&mut params));
    let [o_binding, lse_binding] = match partials {
        Some(partials) => partials,
        None => [
            bind_view(ctx, "out", out, VIEW_O, &mut params)?,
            bind_tensor(ctx, "lse", lse)?,
        ],
    };
    let mut constants = vec![
        ("WG", plan.tile_keys as u32),
        ("ROWS", plan.rows as u32),
        ("DK", s.head_dim_qk as u32),
        ("DV", s.head_dim_v as u32),
    ];
    // The int8 and f16 builds (f32 storage is never `Some`: it is read through the views).
    let format = stored.map(|s| s[0]);
    match format {
        Some(Storage::Int8(_)) => constants.push(("INT8", 1)),
        Some(Storage::F16(_)) => constants.push(("F16", 1)),
        _ => {}
    }
    // f32 caches whose rows start on four-word boundaries (the pools' rows too: a block is whole
    // rows) are read a vec4 per access, and so are such f16 caches where tiles are staged (rows
    // of a multiple of 8 values: an item's two words from one load). Read in place, f16 rows
    // stay word reads (lavapipe: as fast as f32 with vec4s, 1.15-1.26x faster with words), and
    // int8 rows (D / 4 words and a scale) are not aligned.
    let aligned = inputs_on_vec4(&params, &[VIEW_K, VIEW_V], &s);
    let vec4 = match format {
        None => aligned,
        Some(Storage::F16(_)) => aligned && plan.staged,
        Some(_) => false,
    };
    if vec4 {
        constants.push(("VEC4", 1));
    }
    if !plan.staged {
        constants.push(("STAGED", 0));
    }
    // Checked to match the queries' rows in check_options_with.
    if opts.seq_lens.and_then(|l| l.tree_slots()).is_some() {
        constants.push(("TREE", 1));
    }
    // A contiguous cache binds Q where the block table would be (the shader does not read it).
    let table_binding = match table {
        Some(t) => {
            constants.extend(t.constants());
            bind_block_table(t, &mut params)
        }
        None => q_binding,
    };
    let mut pass = ctx.begin_pass(encoder, "attention_decode");
    encode_kernel(
        ctx,
        &mut pass,
        Kernel {
            name: "attention_decode",
            source: |score_bias| {
                with_common(&sized(plan.rows as u32, own as u32, vec4), score_bias)
            },
            constants: &constants,
        },
        &params,
        Bound {
            shared,
            bindings: &[
                q_binding,
                k_binding,
                v_binding,
                o_binding,
                lse_binding,
                table_binding,
            ],
            grid,
        },
    );
    if let Some(partials) = partials {
        let merged = (out, lse);
        encode_split_merge(
            ctx,
            &mut pass,
            &s,
            scale,
            opts,
            (plan.splits, partials),
            merged,
        )?;
    }
    drop(pass);
    sinks::encode_forward(ctx, encoder, &s, scale, (out, lse), opts)
}

/// Checks that the options carry both per-sequence lengths, no query count above its key count;
/// returns the longest key count.
/// The most cached keys of any sequence, once `opts.seq_lens` is checked for decoding `batch`
/// sequences of `new_slots` query slots against caches of `capacity` (`what` names the caller).
pub(crate) fn check_decode_lens(
    what: &str,
    [batch, new_slots, capacity]: [usize; 3],
    opts: &AttentionOptions<'_>,
) -> Result<usize> {
    match opts.seq_lens {
        Some(lens) => lens.check_decode(batch, new_slots, capacity),
        None => Err(Error::shape(
            "seq_lens",
            format!("{what} needs SeqLens with q_lens (new queries per sequence) and kv_lens (cached keys per sequence, the new ones included)"),
        )),
    }
}

/// The kernel with its per-invocation arrays sized for `rows` query rows and `own` value dims per
/// invocation, reading its caches a word or (`vec4`) four words per access.
fn sized(rows: u32, own: u32, vec4: bool) -> String {
    let cache = match vec4 {
        true => CACHE_WORDS_VEC4,
        false => CACHE_WORDS,
    };
    with_sizes(
        &[("MAX_ROWS", rows), ("MAX_OWN", own)],
        // The block table's overrides ahead of the kernel that reads them: naga 30's override
        // processing panics on an override declared after a function that uses it.
        &format!("{cache}\n{KV_PAGES}\n{SOURCE}"),
    )
}

/// The kernel's sources for the translation tests, with the largest arrays a plan takes: the
/// word-per-access build and (`_vec4`) the four-word one.
pub(super) fn shader_sources() -> [(&'static str, String); 2] {
    [
        ("attention_decode", with_common(&sized(64, 16, false), true)),
        (
            "attention_decode_vec4",
            with_common(&sized(64, 16, true), true),
        ),
    ]
}
