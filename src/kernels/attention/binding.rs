//! What every attention kernel is bound with: the uniform parameters (views, flags, grid), storage
//! bindings of views and tensors, tile sizes, and the recording of one kernel or its loop chunks.

use super::call::CacheRead;
use super::options::AttentionOptions;
use super::variant::FusedVariant;
use crate::device::{Context, StorageBinding};
use crate::error::{Error, Result};
use crate::kernels::arguments::check_binding;
use crate::kernels::kv_cache::BlockTable;
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, HeadsView, SeqLens};
use std::sync::Arc;

/// A buffer range bound for one dispatch and the element offset of the view inside it.
#[derive(Clone, Copy)]
pub(crate) struct Binding<'a> {
    pub(crate) buffer: &'a wgpu::Buffer,
    pub(crate) offset_bytes: u64,
    pub(crate) size_bytes: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct ViewParams {
    pub(super) offset: u32,
    pub(super) stride_b: u32,
    pub(super) stride_s: u32,
    pub(super) stride_h: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct Params {
    pub(super) batch: u32,
    pub(super) heads: u32,
    pub(super) kv_heads: u32,
    pub(super) q_seq: u32,
    pub(super) kv_seq: u32,
    pub(super) dk: u32,
    pub(super) dv: u32,
    pub(crate) flags: u32,
    pub(super) scale: f32,
    pub(super) blocks: u32,
    pub(super) grid_x: u32,
    pub(super) total_groups: u32,
    pub(crate) chunk_begin: u32,
    pub(crate) chunk_end: u32,
    pub(super) accumulate: u32,
    pub(super) splits: u32,
    pub(super) softcap: f32,
    pub(super) window_left: u32,
    pub(super) window_right: u32,
    pub(super) bias_offset: u32,
    pub(super) bias_strides: [u32; 4],
    pub(super) bias_batch: u32,
    pub(super) bias_heads: u32,
    pub(super) rel_buckets: u32,
    pub(super) rel_exact: u32,
    pub(super) rel_threshold_vec4s: u32,
    pub(super) rel_table_stride: u32,
    pub(super) split_keys: u32,
    /// One bit per packed view (`1 << VIEW_*`), whose sequences start at the rows in `seq_lens`:
    /// [`encode_kernel`] specialises the pipeline with it (`PACKED_VIEWS`).
    pub(super) packed_views: u32,
    /// Decode attention's paged cache: block ids per sequence, blocks in the pool.
    pub(super) table_stride: u32,
    pub(super) pool_blocks: u32,
    pub(super) pad: [u32; 2],
    pub(super) rel_thresholds: [[u32; 4]; MAX_REL_THRESHOLDS / 4],
    pub(super) alibi_slopes: [[f32; 4]; MAX_ALIBI_SLOPES / 4],
    pub(super) views: [ViewParams; 8],
}

pub(crate) const VIEW_Q: usize = 0;
pub(crate) const VIEW_K: usize = 1;
pub(crate) const VIEW_V: usize = 2;
pub(crate) const VIEW_O: usize = 3;
pub(crate) const VIEW_DO: usize = 4;
pub(crate) const VIEW_DQ: usize = 5;
pub(crate) const VIEW_DK: usize = 6;
pub(crate) const VIEW_DV: usize = 7;

pub(super) const FLAG_CAUSAL: u32 = 1;
pub(super) const FLAG_Q_LENS: u32 = 2;
pub(super) const FLAG_KV_LENS: u32 = 4;
pub(super) const FLAG_SOFTCAP: u32 = 8;
pub(super) const FLAG_ALIBI: u32 = 16;
pub(super) const FLAG_WINDOW: u32 = 32;
pub(super) const FLAG_BIAS: u32 = 64;
pub(super) const FLAG_RELATIVE: u32 = 128;
pub(super) const FLAG_REL_BIDIRECTIONAL: u32 = 256;
pub(super) const FLAG_ALIBI_SLOPES: u32 = 512;
pub(crate) const FLAG_ALIGN_LENS: u32 = 1024;
pub(super) const FLAG_SHARED_OUTPUTS: u32 = 2048;
/// Query heads whose ALiBi slopes the parameter block can hold ([`AttentionOptions::alibi_slopes`]).
pub const MAX_ALIBI_SLOPES: usize = 64;

/// Binding of the score bias or relative table in every kernel that calls `modify_scores`.
pub(super) const SCORE_BIAS_BINDING: u32 = 15;
/// Thresholds of log-spaced relative-position buckets the parameter block holds.
pub(super) const MAX_REL_THRESHOLDS: usize = 32;

/// Binds the smallest aligned range of `view`'s buffer that covers it and records its strides.
/// The shader's addressing of `view` in a binding that starts at element `binding_start` of its
/// buffer: offset and strides in elements, each within u32.
pub(super) fn view_params(
    arg: &'static str,
    view: &HeadsView,
    binding_start: usize,
) -> Result<ViewParams> {
    let narrow = |x: usize| {
        u32::try_from(x).map_err(|_| Error::Unsupported {
            arg,
            value: x as u64,
            limit: u32::MAX as u64,
            hint: " (offset or stride in elements)",
        })
    };
    let [sb, ss, sh] = view.strides();
    Ok(ViewParams {
        offset: narrow(view.offset() - binding_start)?,
        stride_b: narrow(sb)?,
        stride_s: narrow(ss)?,
        stride_h: narrow(sh)?,
    })
}

pub(crate) fn bind_view<'a>(
    ctx: &Context,
    arg: &'static str,
    view: &'a HeadsView,
    slot: usize,
    params: &mut Params,
) -> Result<Binding<'a>> {
    let align = ctx.limits().min_storage_buffer_offset_alignment as u64;
    let element = view.dtype().size();
    let start_bytes = view.offset() as u64 * element;
    let offset_bytes = start_bytes / align * align;
    // Whole words: storage bindings are sized in multiples of 4 bytes (f16 tensors are padded).
    let end_bytes = (view.end_element() as u64 * element).next_multiple_of(4);
    let size_bytes = end_bytes.max(offset_bytes + 4) - offset_bytes;
    check_binding(ctx, arg, size_bytes)?;
    params.views[slot] = view_params(arg, view, (offset_bytes / element) as usize)?;
    if view.packed_rows().is_some() {
        params.packed_views |= 1 << slot;
    }
    Ok(Binding {
        buffer: view.buffer(),
        offset_bytes,
        size_bytes,
    })
}

/// Binds a kernel's two output views (dK and dV) at consecutive bindings. WebGPU refuses a dispatch
/// whose writable bindings overlap in a buffer (Chromium checks it, wgpu 30 does not), and strided
/// views of one packed gradient buffer (dQKV, as the Transformer writes) do overlap, though no
/// element is in both: such a pair is bound once, over both views, at the first binding, a dummy at
/// the second, and the kernel writes both through the first (`FLAG_SHARED_OUTPUTS`: a flag of the
/// parameter block, not a constant, so no pipeline variant).
pub(crate) fn bind_output_pair<'a>(
    ctx: &'a Context,
    [(arg0, view0, slot0), (arg1, view1, slot1)]: [(&'static str, &'a HeadsView, usize); 2],
    params: &mut Params,
) -> Result<[Binding<'a>; 2]> {
    let first = bind_view(ctx, arg0, view0, slot0, params)?;
    let second = bind_view(ctx, arg1, view1, slot1, params)?;
    let end = |b: &Binding<'_>| b.offset_bytes + b.size_bytes;
    let overlap = first.buffer == second.buffer
        && first.offset_bytes < end(&second)
        && second.offset_bytes < end(&first);
    if !overlap {
        return Ok([first, second]);
    }
    let offset_bytes = first.offset_bytes.min(second.offset_bytes);
    let size_bytes = end(&first).max(end(&second)) - offset_bytes;
    check_binding(ctx, arg0, size_bytes)?;
    let element = view0.dtype().size();
    params.views[slot0] = view_params(arg0, view0, (offset_bytes / element) as usize)?;
    params.views[slot1] = view_params(arg1, view1, (offset_bytes / element) as usize)?;
    let union = Binding {
        buffer: first.buffer,
        offset_bytes,
        size_bytes,
    };
    params.flags |= FLAG_SHARED_OUTPUTS;
    Ok([union, empty_rw_binding(ctx)])
}

/// The context's read-write dummy, bound where a kernel's read-write binding is absent.
pub(crate) fn empty_rw_binding(ctx: &Context) -> Binding<'_> {
    Binding {
        buffer: ctx.empty_storage_rw(0),
        offset_bytes: 0,
        size_bytes: 8,
    }
}

pub(crate) fn bind_tensor<'a>(
    ctx: &Context,
    arg: &'static str,
    t: &'a GpuTensor,
) -> Result<Binding<'a>> {
    let size_bytes = t.size_bytes().max(4);
    check_binding(ctx, arg, size_bytes)?;
    Ok(Binding {
        buffer: t.buffer(),
        offset_bytes: t.region().offset,
        size_bytes,
    })
}

/// Binds a forward's K and V views (bindings 3 and 4) as `cache` reads them: a cache stored in
/// words is addressed in its values (bytes or halves), so its views' offsets and strides are
/// scaled from words to values.
pub(super) fn bind_kv<'a>(
    ctx: &Context,
    [k, v]: [&'a HeadsView; 2],
    cache: CacheRead<'_>,
    params: &mut Params,
) -> Result<[Binding<'a>; 2]> {
    let bindings = [
        bind_view(ctx, "k", k, VIEW_K, params)?,
        bind_view(ctx, "v", v, VIEW_V, params)?,
    ];
    if let Some(words) = cache.words {
        for (arg, slot) in [("k_cache", VIEW_K), ("v_cache", VIEW_V)] {
            let view = &mut params.views[slot];
            for x in [
                &mut view.offset,
                &mut view.stride_b,
                &mut view.stride_s,
                &mut view.stride_h,
            ] {
                *x = x.checked_mul(words.per_word()).ok_or(Error::Unsupported {
                    arg,
                    value: u64::from(*x) * u64::from(words.per_word()),
                    limit: u32::MAX as u64,
                    hint: " (offset or stride in cached values)",
                })?;
            }
        }
    }
    Ok(bindings)
}

/// Binds a paged cache's block table, read by `attention/kv_pages.wgsl` at binding 7 (the binding
/// after a forward or decode kernel's own), and records its layout in `params`.
pub(super) fn bind_block_table<'a>(table: &'a BlockTable, params: &mut Params) -> Binding<'a> {
    [params.table_stride, params.pool_blocks] = table.layout();
    Binding {
        buffer: table.buffer(),
        offset_bytes: 0,
        size_bytes: table.buffer().size(),
    }
}

/// The inputs every backward kernel of both families binds, from binding 2 on: Q, K, V, dO and the
/// (lse, D) stats; the kernel's outputs follow.
pub(super) fn bind_backward_inputs<'a>(
    ctx: &Context,
    params: &mut Params,
    [q, k, v, d_out]: [&'a HeadsView; 4],
    stats: &'a GpuTensor,
) -> Result<Vec<Binding<'a>>> {
    Ok(vec![
        bind_view(ctx, "q", q, VIEW_Q, params)?,
        bind_view(ctx, "k", k, VIEW_K, params)?,
        bind_view(ctx, "v", v, VIEW_V, params)?,
        bind_view(ctx, "d_out", d_out, VIEW_DO, params)?,
        bind_tensor(ctx, "workspace", stats)?,
    ])
}

/// Whether the views bound in `params` at `slots` start every row on a four-element boundary
/// (offset in the binding and every stride multiples of four) and the head dims are multiples of
/// four, so that a kernel may read four elements per access (`attention/input_rows_vec4.wgsl`).
pub(super) fn inputs_on_vec4(params: &Params, slots: &[usize], s: &AttentionShape) -> bool {
    s.head_dim_qk.is_multiple_of(4)
        && s.head_dim_v.is_multiple_of(4)
        && slots.iter().all(|&slot| {
            let v = &params.views[slot];
            [v.offset, v.stride_b, v.stride_s, v.stride_h]
                .iter()
                .all(|x| x.is_multiple_of(4))
        })
}

/// Rows of Q (forward, dQ) or keys (dK/dV) one invocation owns: one per vec4 lane.
pub(super) const ROWS: u32 = 4;

/// Invocations per workgroup of the one-row-per-invocation kernels (preprocess, unfused softmax).
pub(crate) const SIMPLE_WG: u32 = 64;

/// Invocations per workgroup of the fused kernels, so a workgroup owns `ROWS * WG` rows (queries in
/// the forward and dQ, keys in dK/dV). Wide workgroups amortise each staged tile over more rows;
/// narrow ones put more workgroups in flight. On an H100 the forward was fastest at 64 and the
/// backward at 32 (benchmarks/HISTORY.md, "Figures that code comments carried"); CPU drivers run a
/// workgroup as SIMD loops and prefer 64 everywhere. `wanted` (the call's
/// [`KernelChoice::workgroup`](crate::KernelChoice): [`Context::set_attention_workgroup`], or the
/// tuned width) overrides both.
pub(super) fn workgroup_size(ctx: &Context, backward: bool, wanted: Option<u32>) -> u32 {
    match wanted {
        Some(wg) => wg,
        None if backward && !ctx.is_cpu() => 32,
        None => 64,
    }
}

/// Rows of the CPU-driver kernels' staged tiles that fit the adapter's workgroup storage (rows of
/// whole quads: an even number of vec4s).
pub(super) fn tile_rows(
    ctx: &Context,
    shape: &AttentionShape,
    extra_bytes_per_row: u32,
    max: u32,
) -> u32 {
    let dk4 = shape.head_dim_qk.div_ceil(8) as u32 * 2;
    let dv4 = shape.head_dim_v.div_ceil(8) as u32 * 2;
    let per_row = (dk4 + dv4) * 16 + extra_bytes_per_row;
    (ctx.limits().max_compute_workgroup_storage_size / per_row).clamp(1, max)
}

pub(crate) fn base_params(
    shape: &AttentionShape,
    scale: f32,
    opts: &AttentionOptions<'_>,
) -> Params {
    let mut flags = 0;
    if opts.causal {
        flags |= FLAG_CAUSAL;
    }
    if opts.softcap.is_some() {
        flags |= FLAG_SOFTCAP;
    }
    if opts.alibi {
        flags |= FLAG_ALIBI;
    }
    let mut alibi_slopes = [[0.0; 4]; MAX_ALIBI_SLOPES / 4];
    if let Some(slopes) = opts.alibi_slopes {
        flags |= FLAG_ALIBI | FLAG_ALIBI_SLOPES;
        // check_options kept the count within MAX_ALIBI_SLOPES.
        for (h, &slope) in slopes.iter().enumerate().take(MAX_ALIBI_SLOPES) {
            alibi_slopes[h / 4][h % 4] = slope;
        }
    }
    // Window sizes past both lengths change nothing; clamping keeps the kernels' i32 arithmetic exact.
    let reach = (shape.q_seq + shape.kv_seq) as u32;
    let (window_left, window_right) = opts.window.map_or((0, 0), |(l, r)| {
        (l.min(reach as usize) as u32, r.min(reach as usize) as u32)
    });
    if opts.window.is_some() {
        flags |= FLAG_WINDOW;
    }
    if opts.align_lens {
        flags |= FLAG_ALIGN_LENS;
    }
    if let Some(lens) = opts.seq_lens {
        if lens.q_lens().is_some() {
            flags |= FLAG_Q_LENS;
        }
        if lens.kv_lens().is_some() {
            flags |= FLAG_KV_LENS;
        }
    }
    let mut params = Params {
        batch: shape.batch as u32,
        heads: shape.heads as u32,
        kv_heads: shape.kv_heads as u32,
        q_seq: shape.q_seq as u32,
        kv_seq: shape.kv_seq as u32,
        dk: shape.head_dim_qk as u32,
        dv: shape.head_dim_v as u32,
        flags,
        scale,
        softcap: opts.softcap.unwrap_or(0.0),
        window_left,
        window_right,
        alibi_slopes,
        ..Default::default()
    };
    fill_bias_params(&mut params, opts);
    params
}

/// The 2-D grid of `blocks` workgroups per (batch, head) group of `groups`, refused where it is
/// more than the device dispatches.
pub(crate) fn attention_grid(ctx: &Context, blocks: usize, groups: usize) -> Result<(u32, u32)> {
    ctx.grid_2d_for(
        blocks as u64 * groups as u64,
        "workgroups (batch * heads * sequence blocks)",
        "; split the batch",
    )
}

/// Sets the 2-D grid for `blocks` workgroups per (batch, head) group of `groups`, within the
/// device's workgroups per dimension ([`attention_grid`]).
pub(crate) fn set_grid(
    ctx: &Context,
    params: &mut Params,
    blocks: usize,
    groups: usize,
) -> Result<(u32, u32)> {
    let (gx, gy) = attention_grid(ctx, blocks, groups)?;
    params.blocks = blocks as u32;
    params.total_groups = (blocks * groups) as u32;
    params.grid_x = gx;
    Ok((gx, gy))
}

/// The buffer bound as `seq_lens`: the caller's, or the context's empty one (bindings cannot be absent).
pub(crate) fn seq_lens_buffer<'a>(
    ctx: &'a Context,
    opts: &AttentionOptions<'a>,
) -> &'a wgpu::Buffer {
    opts.seq_lens.map_or(ctx.empty_storage(), SeqLens::buffer)
}

/// The storage a kernel binds besides its own tensors: the sequence lengths at binding 1 (kernels
/// that read them) and the score bias at [`SCORE_BIAS_BINDING`] (kernels that call `modify_scores`).
#[derive(Clone, Copy, Default)]
pub(crate) struct Shared<'a> {
    pub(super) seq_lens: Option<&'a wgpu::Buffer>,
    pub(super) score_bias: Option<Binding<'a>>,
    /// The kernel calls modify_scores but the call has no score bias or relative table: it is
    /// compiled without the score_bias binding (`score_bias_none.wgsl`, `SCORE_BIAS = false`).
    pub(super) elide_score_bias: bool,
}

impl<'a> Shared<'a> {
    pub(crate) const NONE: Shared<'static> = Shared {
        seq_lens: None,
        score_bias: None,
        elide_score_bias: false,
    };

    pub(crate) fn lens(seq_lens: &'a wgpu::Buffer) -> Self {
        Shared {
            seq_lens: Some(seq_lens),
            ..Shared::NONE
        }
    }

    /// What a score kernel binds: the sequence lengths and the bias tensor, the relative table or a
    /// dummy.
    pub(super) fn scores(ctx: &'a Context, opts: &AttentionOptions<'a>) -> Result<Self> {
        let score_bias = score_bias_binding(ctx, opts)?;
        Ok(Shared {
            seq_lens: Some(seq_lens_buffer(ctx, opts)),
            score_bias,
            elide_score_bias: score_bias.is_none(),
        })
    }
}

/// An attention-family kernel other than the fused ones: its pipeline name, its source (given
/// whether the call binds a score bias, see [`Shared::elide_score_bias`]) and its override
/// constants.
pub(crate) struct Kernel<'a, S> {
    pub name: &'static str,
    pub source: S,
    pub constants: &'a [(&'static str, u32)],
}

/// What one dispatch binds besides its parameter block: the sequence lengths at binding 1 and the
/// score bias ([`Shared`]), the kernel's own `bindings` from binding 2 on, and its grid.
#[derive(Clone, Copy)]
pub(crate) struct Bound<'a> {
    pub shared: Shared<'a>,
    pub bindings: &'a [Binding<'a>],
    pub grid: (u32, u32),
}

/// Records one dispatch of `kernel` with the parameter block `params` at binding 0 and `bound`.
pub(crate) fn encode_kernel(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    kernel: Kernel<'_, impl FnOnce(bool) -> String>,
    params: &Params,
    bound: Bound<'_>,
) {
    let pipeline = kernel_pipeline(
        ctx,
        kernel.name,
        kernel.source,
        kernel.constants,
        params,
        bound,
    );
    record(ctx, pass, &pipeline, kernel.name, params, bound);
}

/// Records one dispatch of `kernel` per loop chunk (`[begin, end)` ranges from [`loop_chunks`]);
/// every chunk after the first adds to what the earlier ones wrote.
pub(crate) fn encode_chunks(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    kernel: Kernel<'_, impl FnOnce(bool) -> String>,
    params: &mut Params,
    bound: Bound<'_>,
    chunks: &[(u32, u32)],
) {
    let pipeline = kernel_pipeline(
        ctx,
        kernel.name,
        kernel.source,
        kernel.constants,
        params,
        bound,
    );
    for (index, &(begin, end)) in chunks.iter().enumerate() {
        params.chunk_begin = begin;
        params.chunk_end = end;
        params.accumulate = (index > 0) as u32;
        record(ctx, pass, &pipeline, kernel.name, params, bound);
    }
}

/// The pipeline of kernel `name` for a call bound by `params` and `bound`: its constants with the
/// call's `PACKED_VIEWS` and, without a score bias, `SCORE_BIAS = 0`.
fn kernel_pipeline(
    ctx: &Context,
    name: &'static str,
    source: impl FnOnce(bool) -> String,
    constants: &[(&'static str, u32)],
    params: &Params,
    bound: Bound<'_>,
) -> Arc<wgpu::ComputePipeline> {
    let mut specialised = constants.to_vec();
    if params.packed_views != 0 {
        specialised.push(("PACKED_VIEWS", params.packed_views));
    }
    let score_bias = !bound.shared.elide_score_bias;
    if !score_bias {
        specialised.push(("SCORE_BIAS", 0));
    }
    ctx.pipeline(name, || source(score_bias), &specialised)
}

/// Records one dispatch of the fused kernel `key`, its call's packed views and score bias taken from
/// `params` and `bound` into the key.
pub(super) fn encode_fused(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    key: FusedVariant,
    params: &Params,
    bound: Bound<'_>,
) {
    let (pipeline, name) = fused_pipeline(ctx, key, params, bound.shared);
    record(ctx, pass, &pipeline, &name, params, bound);
}

/// Records the fused kernel `key` once per loop chunk, as [`encode_chunks`] does (see
/// [`encode_fused`]).
pub(super) fn encode_fused_chunks(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    key: FusedVariant,
    params: &mut Params,
    bound: Bound<'_>,
    chunks: &[(u32, u32)],
) {
    let (pipeline, name) = fused_pipeline(ctx, key, params, bound.shared);
    for (index, &(begin, end)) in chunks.iter().enumerate() {
        params.chunk_begin = begin;
        params.chunk_end = end;
        params.accumulate = (index > 0) as u32;
        record(ctx, pass, &pipeline, &name, params, bound);
    }
}

/// Records one dispatch of `pipeline`: the parameter block at binding 0, the sequence lengths at
/// binding 1 (for kernels that read them), the score bias and the kernel's bindings from binding 2.
fn record(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    pipeline: &wgpu::ComputePipeline,
    name: &str,
    params: &Params,
    bound: Bound<'_>,
) {
    let Bound {
        shared,
        bindings,
        grid,
    } = bound;
    let mut storage = Vec::with_capacity(bindings.len() + 2);
    if let Some(seq_lens) = shared.seq_lens {
        storage.push(StorageBinding {
            binding: 1,
            buffer: seq_lens,
            offset: 0,
            size: None,
        });
    }
    if let Some(b) = shared.score_bias {
        storage.push(StorageBinding {
            binding: SCORE_BIAS_BINDING,
            buffer: b.buffer,
            offset: b.offset_bytes,
            size: wgpu::BufferSize::new(b.size_bytes),
        });
    }
    storage.extend(bindings.iter().enumerate().map(|(i, b)| StorageBinding {
        binding: i as u32 + 2,
        buffer: b.buffer,
        offset: b.offset_bytes,
        size: wgpu::BufferSize::new(b.size_bytes),
    }));
    let bind_group = ctx.bind_group(pipeline, name, bytemuck::bytes_of(params), &storage);
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(grid.0, grid.1, 1);
}

/// The flags of the calls that get a build with their flags fixed where a kernel has one
/// (`FusedVariant::fixed_flags_build`: the GPU and tensor-core families' backward): no mask, or
/// causal alone (outputs shared or not). On an H200 those builds halved the GPU family's backward
/// for both (unmasked 24.1 -> 13.0 ms, causal 12.5 -> 6.6 ms, B1 H8 D64 L 4096;
/// `benchmarks/uniform-vs-override-2026-11-27/`); other masks and modifiers share the pipeline
/// that reads them from the uniform. On GPUs only by default ([`Context::fixed_flag_builds`]):
/// lavapipe ran them no faster, and they added a quarter to the backward tests' compile time.
const FIXED_FLAG_CALLS: u32 = FLAG_CAUSAL | FLAG_SHARED_OUTPUTS;

/// The pipeline of `key` for a call bound by `params` and `shared` (its packed views, score bias,
/// and flags where the kernel fixes them: [`FIXED_FLAG_CALLS`]), and its name.
fn fused_pipeline(
    ctx: &Context,
    mut key: FusedVariant,
    params: &Params,
    shared: Shared<'_>,
) -> (Arc<wgpu::ComputePipeline>, String) {
    key.packed_views = params.packed_views;
    key.score_bias = !shared.elide_score_bias;
    if key.fixed_flags_build && ctx.fixed_flag_builds() && params.flags & !FIXED_FLAG_CALLS == 0 {
        key.fixed_flags = Some(params.flags);
    }
    key.pipeline(ctx)
}

/// The parameter blocks of this module against `attention/common.wgsl` ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(super) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    vec![
        uniform_layout!(
            "attention_forward_merge",
            "Params",
            Params {
                batch, heads, kv_heads, q_seq, kv_seq, dk, dv, flags, scale, blocks, grid_x,
                total_groups, chunk_begin, chunk_end, accumulate, splits, softcap, window_left,
                window_right, bias_offset, bias_strides, bias_batch, bias_heads, rel_buckets,
                rel_exact, rel_threshold_vec4s, rel_table_stride, split_keys, packed_views,
                table_stride, pool_blocks, rel_thresholds, alibi_slopes,
            }
            nested { views }
            constants {
                VIEW_Q, VIEW_K, VIEW_V, VIEW_O, VIEW_DO, VIEW_DQ, VIEW_DK, VIEW_DV, FLAG_CAUSAL,
                FLAG_Q_LENS, FLAG_KV_LENS, FLAG_SOFTCAP, FLAG_ALIBI, FLAG_WINDOW, FLAG_BIAS,
                FLAG_RELATIVE, FLAG_REL_BIDIRECTIONAL, FLAG_ALIBI_SLOPES, FLAG_ALIGN_LENS,
                FLAG_SHARED_OUTPUTS,
            }
        ),
        uniform_layout!(
            "attention_forward_merge",
            "View",
            ViewParams {
                offset,
                stride_b,
                stride_s,
                stride_h
            }
        ),
    ]
}

/// A 4-byte writable storage buffer for bindings a dispatch does not use (a buffer cannot be bound
/// read-only and writable in one dispatch, so it is not the context's read-only dummy).
pub(super) fn unused_writable(ctx: &Context) -> Result<wgpu::Buffer> {
    ctx.scratch_buffer("attention unused writable binding", 4)
}

/// The parameter-block fields of the bias or relative table (called by `base_params`).
fn fill_bias_params(params: &mut Params, opts: &AttentionOptions<'_>) {
    params.bias_batch = 1;
    params.bias_heads = 1;
    if let Some(bias) = opts.bias {
        params.flags |= FLAG_BIAS;
        // Bound from element 0 of its buffer; check() kept every index within u32.
        params.bias_offset = bias.view.offset() as u32;
        params.bias_strides = bias.view.strides().map(|x| x as u32);
        let [bb, hb, _, _] = bias.view.shape();
        params.bias_batch = bb as u32;
        params.bias_heads = hb as u32;
    }
    if let Some((buckets, _)) = opts.relative {
        params.flags |= FLAG_RELATIVE;
        if buckets.bidirectional {
            params.flags |= FLAG_REL_BIDIRECTIONAL;
        }
        params.rel_buckets = buckets.per_direction() as u32;
        params.rel_exact = buckets.exact() as u32;
        params.rel_table_stride = buckets.buckets as u32;
        let thresholds = buckets.thresholds();
        params.rel_threshold_vec4s = thresholds.len().div_ceil(4) as u32;
        let mut packed = [u32::MAX; MAX_REL_THRESHOLDS];
        packed[..thresholds.len()].copy_from_slice(&thresholds);
        for (slot, chunk) in params.rel_thresholds.iter_mut().zip(packed.chunks(4)) {
            slot.copy_from_slice(chunk);
        }
    }
}

/// What score kernels bind at `SCORE_BIAS_BINDING`: the bias's buffer from element 0 to its last
/// element, or the relative table; `None` without either (the kernels are then compiled without
/// the binding: `score_bias_none.wgsl`).
fn score_bias_binding<'a>(
    ctx: &'a Context,
    opts: &AttentionOptions<'a>,
) -> Result<Option<Binding<'a>>> {
    if let Some(bias) = opts.bias {
        let size_bytes = bias.view.end_element() as u64 * 4;
        check_binding(ctx, "bias", size_bytes)?;
        return Ok(Some(Binding {
            buffer: bias.view.buffer(),
            offset_bytes: 0,
            size_bytes,
        }));
    }
    opts.relative
        .map(|(_, table)| bind_tensor(ctx, "relative table", table))
        .transpose()
}
