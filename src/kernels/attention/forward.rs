//! The fused forward: output tensors, the entry points, the CPU-driver family's kernel (the GPU
//! family's is in `gpu`) and the plan each problem gets.

use super::binding::{
    base_params, bind_block_table, bind_kv, bind_tensor, bind_view, encode_fused_chunks,
    inputs_on_vec4, set_grid, tile_rows, workgroup_size, Bound, Shared, ROWS, VIEW_K, VIEW_O,
    VIEW_Q, VIEW_V,
};
use super::call::{AttentionOutput, CacheRead, ForwardCall, ForwardViews};
use super::gpu::{encode_forward_gpu, GpuForward};
use super::options::AttentionOptions;
use super::shape::{
    allocating_f16, check_distinct, check_options, check_packed, check_tensor, check_view_typed,
    common_dtype, output_like, MAX_BLOCK_N,
};
use super::tune::{self, Tuned};
use super::variant::{
    cpu_family_arrays, FamilyBuild, FusedKernel, FusedVariant, MatrixBuild, QuadReads,
};
use super::{coop, qk_norm, sinks};
use crate::device::{Context, KernelChoice, KernelFamily};
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_f32};
use crate::kernels::dispatch::loop_chunks;
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, HeadsView, PackedSide, Region};

/// Checks a forward's outputs: `out [B, Lq, H, Dv]`, `lse [B, H, Lq]`, neither sharing a buffer
/// with an input of the call (`inputs`, and the tensors of `opts`) nor overlapping the other.
pub(crate) fn check_forward_outputs<'a>(
    ctx: &Context,
    s: &AttentionShape,
    out: &HeadsView,
    lse: &GpuTensor,
    inputs: &[(&'static str, Region<'a>)],
    opts: &AttentionOptions<'a>,
) -> Result<()> {
    check_view_typed("out", out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    check_tensor("lse", lse, &[s.batch, s.heads, s.q_seq])?;
    check_distinct(
        ctx,
        opts,
        &[("out", out.region()), ("lse", lse.region())],
        inputs,
    )
}

/// Checks `rows` is a non-empty range of the `q_seq` query rows (attention maps).
pub(crate) fn check_rows(rows: &std::ops::Range<usize>, q_seq: usize) -> Result<()> {
    if rows.start >= rows.end || rows.end > q_seq {
        return Err(Error::shape(
            "rows",
            format!("{rows:?} is not a non-empty range of the {q_seq} query rows"),
        ));
    }
    Ok(())
}

/// Fused attention forward into new tensors, submitted to the queue.
pub fn attention_forward(
    ctx: &Context,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionOutput> {
    let s = AttentionShape::of(q, k, v)?;
    check_f32(&[("q", q), ("k", k), ("v", v)]).map_err(allocating_f16)?;
    let (out, out_view) = output_like(
        ctx,
        "attention out",
        q,
        PackedSide::Queries,
        [s.heads, s.head_dim_v],
        opts,
    )?;
    let lse = GpuTensor::uninit(ctx, "attention lse", &[s.batch, s.heads, s.q_seq])?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    attention_forward_into(
        ctx,
        &mut encoder,
        &ForwardViews {
            q,
            k,
            v,
            out: &out_view,
            lse: &lse,
        },
        opts,
    )?;
    ctx.submit(encoder)?;
    Ok(AttentionOutput { out, lse })
}

/// [`attention_forward_into`] for callers that want O only (inference): the row log-sum-exp goes to
/// a scratch buffer the context keeps (allocated once, grown when a larger problem needs it)
/// instead of a tensor of the caller's. Bitwise the same `out`.
pub fn attention_forward_out_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let s = AttentionShape::of(q, k, v)?;
    let rows = [s.batch, s.heads, s.q_seq];
    let bytes = rows
        .iter()
        .try_fold(4u64, |acc, &n| acc.checked_mul(n as u64))
        .ok_or_else(|| Error::shape("lse", format!("{rows:?} f32 values overflow u64 bytes")))?;
    check_binding(ctx, "lse (scratch)", bytes)?;
    let lse = GpuTensor::from_buffer(
        ctx.scratch_buffer("attention lse (not kept)", bytes)?,
        &rows,
    )?;
    attention_forward_into(
        ctx,
        encoder,
        &ForwardViews {
            q,
            k,
            v,
            out,
            lse: &lse,
        },
        opts,
    )
}

/// Records the fused attention forward into `encoder`, writing `out` (a `[B, Lq, H, Dv]` view) and
/// `lse` (`[B, H, Lq]`). Nothing is recorded if the input is rejected.
pub fn attention_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    record_forward(ctx, encoder, views, opts, None)
}

/// [`attention_forward_into`] running `choice`, or the context's choice for the call (tuned where
/// the context tunes) where it is `None`.
pub(super) fn record_forward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    opts: &AttentionOptions<'_>,
    choice: Option<KernelChoice>,
) -> Result<()> {
    let &ForwardViews { q, k, v, out, lse } = views;
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(ctx, &s, opts)?;
    use PackedSide::{Keys, Queries};
    check_packed(
        &[
            ("q", q, Queries),
            ("k", k, Keys),
            ("v", v, Keys),
            ("out", out, Queries),
        ],
        opts,
    )?;
    let views = [("q", q), ("k", k), ("v", v), ("out", out)];
    let dtype = common_dtype(ctx, &views, opts)?;
    check_forward_outputs(
        ctx,
        &s,
        out,
        lse,
        &[("q", q.region()), ("k", k.region()), ("v", v.region())],
        opts,
    )?;
    let choice = match choice {
        Some(choice) => choice,
        None => tune::call_choice(ctx, Tuned::Forward, &s, opts, dtype, [q, k])?,
    };
    // Cosine scores and key clipping: the kernels read transformed copies of Q and K.
    let (q, k) = qk_norm::encode_inputs(ctx, encoder, q, k, opts)?;
    let call = ForwardCall {
        s,
        scale,
        q: &q,
        k: &k,
        v,
        out,
        lse,
        opts,
        choice,
        cache: CacheRead::VIEWS,
    };
    encode_forward_call(ctx, encoder, &call, dtype)
}

/// Records the fused forward of a prefill-shaped decoding step over its cache (`views.k`,
/// `views.v`), read as `cache` says: a paged cache's pools (`[1, pool rows, Hkv, D]`) through its
/// block table, an int8 or f16 cache's words dequantised as they are staged. Checked by the
/// caller as shape `s` with `scale`; f32 queries and outputs; no cosine scores or key clipping
/// (which read transformed copies of the keys).
pub(super) fn record_forward_cached(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &ForwardViews<'_>,
    cache: CacheRead<'_>,
    (s, scale): (AttentionShape, f32),
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let &ForwardViews { q, k, v, out, lse } = views;
    let choice = tune::call_choice(ctx, Tuned::Forward, &s, opts, DType::F32, [q, k])?;
    let call = ForwardCall {
        s,
        scale,
        q,
        k,
        v,
        out,
        lse,
        opts,
        choice,
        cache,
    };
    encode_forward_call(ctx, encoder, &call, DType::F32)
}

/// Records a checked forward call on the family its choice and `dtype` (Q, K and V's) take, then
/// the attention sinks' correction.
fn encode_forward_call(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    call: &ForwardCall<'_>,
    dtype: DType,
) -> Result<()> {
    let ForwardCall {
        ref s,
        scale,
        choice,
        out,
        lse,
        opts,
        ..
    } = *call;
    let family = choice.family_on(ctx);
    if let Some(config) = coop::CoopForward::choose(ctx, s, choice)? {
        coop::encode_forward_coop(ctx, encoder, config, call)?;
    } else if family == KernelFamily::CpuDriver && dtype == DType::F32 {
        encode_forward_cpu_family(ctx, encoder, call)?;
    } else {
        // The GPU family; also f16 on every adapter (the CPU-driver kernels are f32 only), and the
        // tensor-core family's problems whose tiles exceed the workgroup storage.
        encode_forward_gpu(ctx, encoder, call)?;
    }
    sinks::encode_forward(ctx, encoder, s, scale, (out, lse), opts)
}

/// The CPU-driver family's forward: one dispatch per key chunk, each merging into O and lse.
pub(super) fn encode_forward_cpu_family(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    call: &ForwardCall<'_>,
) -> Result<()> {
    let ForwardCall {
        ref s,
        scale,
        q,
        k,
        v,
        out,
        lse,
        opts,
        ..
    } = *call;
    let block_n = tile_rows(ctx, s, 0, MAX_BLOCK_N);
    let mut params = base_params(s, scale, opts);
    let q_binding = bind_view(ctx, "q", q, VIEW_Q, &mut params)?;
    let [k_binding, v_binding] = bind_kv(ctx, [k, v], call.cache, &mut params)?;
    let mut bindings = vec![
        q_binding,
        k_binding,
        v_binding,
        bind_view(ctx, "out", out, VIEW_O, &mut params)?,
        bind_tensor(ctx, "lse", lse)?,
    ];
    bindings.extend(call.cache.table.map(|t| bind_block_table(t, &mut params)));
    let wg = workgroup_size(ctx, false, call.choice.workgroup);
    let blocks = s.q_seq.div_ceil((wg * ROWS) as usize);
    let grid = set_grid(ctx, &mut params, blocks, s.batch * s.heads)?;
    let chunks = forward_chunks(ctx, s, block_n);
    let mut pass = ctx.begin_pass(encoder, "attention_forward");
    let shared = Shared::scores(ctx, opts)?;
    let mut key = FusedVariant::new(
        FusedKernel::Forward,
        FamilyBuild::Cpu(QuadReads::choose(ctx, wg)),
    );
    key.arrays = cpu_family_arrays(s.head_dim_qk.max(s.head_dim_v), None);
    key.vec4_inputs = inputs_on_vec4(&params, &[VIEW_Q, VIEW_K, VIEW_V], s);
    key.constants = vec![
        ("WG", wg),
        ("BLOCK_N", block_n),
        ("DK", s.head_dim_qk as u32),
        ("DV", s.head_dim_v as u32),
    ];
    call.cache.specialise(&mut key);
    encode_fused_chunks(
        ctx,
        &mut pass,
        key,
        &mut params,
        Bound {
            shared,
            bindings: &bindings,
            grid,
        },
        &chunks,
    );
    Ok(())
}

/// How the fused forward runs a problem on a context: what [`attention_forward_into`] records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardPlan {
    /// The kernel family the plan runs.
    pub family: KernelFamily,
    /// Invocations per workgroup.
    pub workgroup: u32,
    /// Query rows per workgroup.
    pub block_m: u32,
    /// Keys per staged K/V tile.
    pub block_n: u32,
    /// Pieces of each row's key range: split-KV workgroups merged by a second kernel (GPU family),
    /// or chunk dispatches under a driver's loop cap (CPU-driver family). 1 is one pass over the
    /// keys.
    pub splits: u32,
    /// Subgroup operations where [`Context::subgroup_size`] allows: the GPU family's row maxima
    /// combined by shuffles rather than through workgroup memory, the CPU-driver family's staged
    /// tiles shared by broadcasts (subgroups of eight).
    pub subgroups: bool,
    /// The tensor-core family's matrix build (`None` for the other families).
    pub matrix: Option<MatrixBuild>,
}

impl std::fmt::Display for ForwardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}x{}/{}",
            self.family.name(),
            self.block_m,
            self.block_n,
            self.workgroup
        )?;
        if self.subgroups {
            write!(f, " subgroup")?;
        }
        if let Some(matrix) = self.matrix {
            write!(f, " {}", matrix.name())?;
        }
        if self.splits > 1 {
            write!(f, " split {}", self.splits)?;
        }
        Ok(())
    }
}

/// The kernel family, tile shape and key split the fused forward uses for `shape` on `ctx` (f32
/// inputs, no mask; f16 ones run the GPU family where the CPU-driver family is set): the context's
/// settings, over the choice tuned for the shape where one was made (nothing is tuned here). Under
/// the tensor-core family this decides, at the first call, which matrix build the device runs.
pub fn attention_forward_plan(ctx: &Context, shape: &AttentionShape) -> Result<ForwardPlan> {
    let s = shape;
    let choice = tune::choice_so_far(ctx, Tuned::Forward, s, DType::F32);
    let family = choice.family_on(ctx);
    if let Some(config) = coop::CoopForward::choose(ctx, s, choice)? {
        return Ok(ForwardPlan {
            family: KernelFamily::Coop,
            workgroup: config.wg(),
            block_m: config.block_m() as u32,
            block_n: config.block_n,
            splits: config.splits(ctx, s, choice.splits) as u32,
            subgroups: false,
            matrix: Some(config.build),
        });
    }
    if family != KernelFamily::CpuDriver {
        let config = GpuForward::choose(ctx, s, choice.tiles[0])?;
        return Ok(ForwardPlan {
            family: KernelFamily::Gpu,
            workgroup: config.wg,
            block_m: config.block_m,
            block_n: config.block_n,
            splits: config.splits(ctx, s, choice.splits) as u32,
            subgroups: config.subgroups(ctx, s),
            matrix: None,
        });
    }
    let block_n = tile_rows(ctx, s, 0, MAX_BLOCK_N);
    let wg = workgroup_size(ctx, false, choice.workgroup);
    Ok(ForwardPlan {
        family: KernelFamily::CpuDriver,
        workgroup: wg,
        block_m: wg * ROWS,
        block_n,
        splits: forward_chunks(ctx, s, block_n).len() as u32,
        subgroups: QuadReads::choose(ctx, wg) == QuadReads::Subgroup,
        matrix: None,
    })
}

/// Key chunks of the CPU-driver forward under the loop budget (one chunk elsewhere).
pub(super) fn forward_chunks(ctx: &Context, s: &AttentionShape, block_n: u32) -> Vec<(u32, u32)> {
    let (dk4, dv4) = (s.head_dim_qk.div_ceil(4), s.head_dim_v.div_ceil(4));
    // Per key: the score, exp and P.V loops and their inner loops over the head dimension.
    loop_chunks(
        ctx,
        s.kv_seq,
        dk4 + dv4 + 8,
        4 * (s.head_dim_qk + s.head_dim_v) + 8 * (dk4 + dv4),
        block_n as usize,
    )
}
