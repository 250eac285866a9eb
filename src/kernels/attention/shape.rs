//! The sizes of one attention problem (`AttentionShape`) and the checks every entry point runs on
//! its views, tensors and element types.

use super::binding::MAX_ALIBI_SLOPES;
use super::options::AttentionOptions;
use super::qk_norm;
use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{
    check_call, check_context, check_f32, check_packed_view, packed_lens_missing,
};
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, HeadsView, PackedSide, Region, SeqLens};

impl AttentionShape {
    /// Checks that `q [B, Lq, H, Dk]`, `k [B, Lk, Hkv, Dk]` and `v [B, Lk, Hkv, Dv]` agree.
    pub fn of(q: &HeadsView, k: &HeadsView, v: &HeadsView) -> Result<Self> {
        Self::of_dims(q.shape(), k.shape(), v.shape())
    }

    /// The problem of queries `q` against a paged cache: pools `k_pool`, `v_pool` `[1, pool rows,
    /// Hkv, D]` (shapes, in values) read through a block table that gives each of `q`'s sequences
    /// `capacity` positions.
    pub(crate) fn paged(
        q: &HeadsView,
        k_pool: [usize; 4],
        v_pool: [usize; 4],
        pool_rows: usize,
        capacity: usize,
    ) -> Result<Self> {
        let b = q.shape()[0];
        let mut logical = [[0; 4]; 2];
        for (i, (arg, pool)) in [("k_pool", k_pool), ("v_pool", v_pool)]
            .into_iter()
            .enumerate()
        {
            let [pb, rows, heads, dim] = pool;
            if pb != 1 || rows != pool_rows {
                return Err(Error::shape(
                    arg,
                    format!(
                        "has shape {pool:?}; the block table's pool needs [1, {pool_rows}, kv heads, head_dim]"
                    ),
                ));
            }
            logical[i] = [b, capacity, heads, dim];
        }
        Self::of_dims(q.shape(), logical[0], logical[1])
    }

    pub(crate) fn of_dims(
        [b, lq, h, dk]: [usize; 4],
        [kb, lk, hkv, kdk]: [usize; 4],
        [vb, vlk, vhkv, dv]: [usize; 4],
    ) -> Result<Self> {
        for (arg, value) in [
            ("q batch", b),
            ("q seq", lq),
            ("q heads", h),
            ("q head_dim", dk),
            ("k seq", lk),
            ("k heads", hkv),
            ("v head_dim", dv),
        ] {
            if value == 0 {
                return Err(Error::shape(
                    arg,
                    "is 0; every dimension must be at least 1",
                ));
            }
        }
        if kb != b || vb != b {
            return Err(Error::shape(
                "k/v batch",
                format!("q has batch {b}, k {kb}, v {vb}; they must be equal"),
            ));
        }
        if vlk != lk {
            return Err(Error::shape(
                "v seq",
                format!("k has {lk} keys but v has {vlk}"),
            ));
        }
        if vhkv != hkv {
            return Err(Error::shape(
                "v heads",
                format!("k has {hkv} heads but v has {vhkv}"),
            ));
        }
        if kdk != dk {
            return Err(Error::shape(
                "k head_dim",
                format!("q has head_dim {dk} but k has {kdk}; Q and K must share Dk"),
            ));
        }
        if h % hkv != 0 {
            return Err(Error::shape(
                "k heads",
                format!("query heads {h} are not a multiple of kv heads {hkv} (H % Hkv must be 0)"),
            ));
        }
        for (arg, value) in [("q/k head_dim", dk), ("v head_dim", dv)] {
            if value > MAX_HEAD_DIM {
                return Err(Error::Unsupported {
                    arg,
                    value: value as u64,
                    limit: MAX_HEAD_DIM as u64,
                    hint: "; split the head dimension or use more heads",
                });
            }
        }
        for (arg, value) in [("q seq", lq), ("k seq", lk), ("batch", b), ("heads", h)] {
            if value > i32::MAX as usize {
                return Err(Error::Unsupported {
                    arg,
                    value: value as u64,
                    limit: i32::MAX as u64,
                    hint: "",
                });
            }
        }
        Ok(Self {
            batch: b,
            q_seq: lq,
            kv_seq: lk,
            heads: h,
            kv_heads: hkv,
            head_dim_qk: dk,
            head_dim_v: dv,
        })
    }
}

pub(crate) fn check_options(
    ctx: &Context,
    shape: &AttentionShape,
    opts: &AttentionOptions<'_>,
) -> Result<f32> {
    check_options_with(ctx, shape, opts, false)
}

/// [`check_options`] for a kernel that reads draft trees from `opts.seq_lens` when `trees` (decode
/// attention); the others refuse them.
pub(super) fn check_options_with(
    ctx: &Context,
    shape: &AttentionShape,
    opts: &AttentionOptions<'_>,
    trees: bool,
) -> Result<f32> {
    if let Some(slots) = opts.seq_lens.and_then(|l| l.tree_slots()) {
        if !trees || slots != shape.q_seq {
            return Err(Error::shape(
                "seq_lens",
                format!(
                    "holds draft trees of {slots} rows; {}",
                    match trees {
                        true => format!("the queries have {} rows", shape.q_seq),
                        false => "only decode attention reads trees".into(),
                    }
                ),
            ));
        }
    }
    let mut tensors = option_inputs(opts);
    tensors.extend(
        opts.learned_cosine
            .map(|l| ("cosine scale grad", l.grad.region())),
    );
    tensors.extend(opts.relative_grad.map(|g| ("relative_grad", g.region())));
    check_context(ctx, &tensors)?;
    if let Some(lens) = opts.seq_lens {
        if lens.batch() != shape.batch {
            return Err(Error::shape(
                "seq_lens",
                format!(
                    "has {} entries but the batch is {}",
                    lens.batch(),
                    shape.batch
                ),
            ));
        }
        for (arg, values, limit) in [
            ("q_lens", lens.q_lens(), shape.q_seq),
            ("kv_lens", lens.kv_lens(), shape.kv_seq),
        ] {
            if let Some(values) = values {
                if let Some((b, &len)) =
                    values.iter().enumerate().find(|(_, &l)| l as usize > limit)
                {
                    return Err(Error::shape(
                        arg,
                        format!("entry {b} is {len}, beyond the sequence length {limit}"),
                    ));
                }
            }
        }
    }
    let scale = opts
        .scale
        .unwrap_or(1.0 / (shape.head_dim_qk as f32).sqrt());
    let temperature = opts.temperature.unwrap_or(1.0);
    if !scale.is_finite() {
        return Err(Error::shape(
            "scale",
            format!("is {scale}; it must be finite"),
        ));
    }
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(Error::shape(
            "temperature",
            format!("is {temperature}; it must be finite and positive"),
        ));
    }
    if let Some(sinks) = opts.sinks {
        check_tensor("sinks", sinks, &[shape.heads])?;
    }
    for (arg, value) in [("cosine", opts.cosine), ("key_norm_clip", opts.key_clip)] {
        if let Some(x) = value {
            if !(x.is_finite() && x > 0.0) {
                return Err(Error::shape(
                    arg,
                    format!("is {x}; it must be finite and positive"),
                ));
            }
        }
    }
    if (opts.cosine.is_some() || opts.learned_cosine.is_some()) && opts.scale.is_some() {
        return Err(Error::shape(
            "scale/cosine",
            "cosine scores carry their own scale; set one of scale and cosine",
        ));
    }
    if let Some(learned) = opts.learned_cosine {
        if opts.cosine.is_some() {
            return Err(Error::shape(
                "cosine/cosine_learned",
                "set one cosine scale: fixed (cosine) or learned (cosine_learned)",
            ));
        }
        check_tensor("cosine scale", learned.scale, &[shape.heads])?;
        check_tensor("cosine scale grad", learned.grad, &[shape.heads])?;
        if learned.grad.overlaps(learned.scale) {
            return Err(Error::shape(
                "cosine scale grad",
                "shares a buffer with the scale; write the gradient to a separate tensor",
            ));
        }
    }
    check_bias(shape, opts)?;
    if let Some(slopes) = opts.alibi_slopes {
        if slopes.len() != shape.heads {
            return Err(Error::shape(
                "alibi_slopes",
                format!(
                    "has {} slopes for {} query heads; give one per head",
                    slopes.len(),
                    shape.heads
                ),
            ));
        }
        if slopes.len() > MAX_ALIBI_SLOPES {
            return Err(Error::Unsupported {
                arg: "alibi_slopes (query heads)",
                value: slopes.len() as u64,
                limit: MAX_ALIBI_SLOPES as u64,
                hint: "; use the default geometric slopes (alibi(true)) or fewer heads",
            });
        }
        if let Some(x) = slopes.iter().find(|x| !x.is_finite()) {
            return Err(Error::shape(
                "alibi_slopes",
                format!("contains {x}; every slope must be finite"),
            ));
        }
    }
    // Cosine scores bring their own scale (a learned one multiplies the queries instead).
    let scale = match (opts.cosine, opts.learned_cosine) {
        (_, Some(_)) => 1.0,
        (Some(cosine), None) => cosine,
        (None, None) => scale,
    };
    if let Some(cap) = opts.softcap {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(Error::shape(
                "softcap",
                format!("is {cap}; it must be finite and positive (e.g. 30 or 50)"),
            ));
        }
    }
    Ok(scale / temperature)
}

/// Checks an f32 view's shape: every attention op but the fused forward and backward takes f32, and
/// padded views.
pub(crate) fn check_view(arg: &'static str, view: &HeadsView, expected: [usize; 4]) -> Result<()> {
    check_f32(&[(arg, view)])?;
    refuse_packed(&[(arg, view)], "this operation")?;
    check_view_typed(arg, view, expected)
}

/// Checks a view's shape, whatever its element type.
pub(super) fn check_view_typed(
    arg: &'static str,
    view: &HeadsView,
    expected: [usize; 4],
) -> Result<()> {
    if view.shape() != expected {
        return Err(Error::shape(
            arg,
            format!("has shape {:?}, expected {:?}", view.shape(), expected),
        ));
    }
    Ok(())
}

pub(crate) fn check_tensor(arg: &'static str, t: &GpuTensor, expected: &[usize]) -> Result<()> {
    if t.shape() != expected {
        return Err(Error::shape(
            arg,
            format!("has shape {:?}, expected {:?}", t.shape(), expected),
        ));
    }
    Ok(())
}

/// The element type every view of a fused forward or backward shares. f16 needs `SHADER_F16` and
/// excludes the options whose kernels read or write Q, K, V or O in f32 (sinks, cosine scores, key
/// clipping).
pub(super) fn common_dtype(
    ctx: &Context,
    views: &[(&'static str, &HeadsView)],
    opts: &AttentionOptions<'_>,
) -> Result<DType> {
    let (first, dtype) = (views[0].0, views[0].1.dtype());
    for &(arg, view) in views {
        if view.dtype() != dtype {
            return Err(Error::DType {
                arg,
                found: view.dtype().name(),
                message: format!(
                    "{first} is {}; the views of one call share one element type",
                    dtype.name()
                ),
            });
        }
    }
    if dtype == DType::F16 {
        ctx.require_f16(
            "f16 attention",
            "; the GL back end has none: use f32 tensors (GpuTensor) there",
        )?;
        if opts.sinks.is_some() || qk_norm::active(opts) {
            return Err(Error::DType {
                arg: first,
                found: "f16",
                message: "attention sinks, cosine scores and key clipping take f32 views".into(),
            });
        }
    }
    Ok(dtype)
}

/// The tensors `opts` makes every score kernel read: sequence lengths, score bias, relative table,
/// sinks and the learned cosine scale.
pub(super) fn option_inputs<'a>(opts: &AttentionOptions<'a>) -> Vec<(&'static str, Region<'a>)> {
    let mut inputs = Vec::new();
    if let Some(lens) = opts.seq_lens {
        inputs.push(("seq_lens", lens.region()));
    }
    if let Some(bias) = opts.bias {
        inputs.push(("bias", bias.view.region()));
    }
    if let Some((_, table)) = opts.relative {
        inputs.push(("relative table", table.region()));
    }
    if let Some(sinks) = opts.sinks {
        inputs.push(("sinks", sinks.region()));
    }
    if let Some(learned) = opts.learned_cosine {
        inputs.push(("cosine scale", learned.scale.region()));
    }
    inputs
}

/// The aliasing rules of one attention call (`kernels::arguments::check_call`): `outputs` share
/// no buffer with `inputs` nor with the tensors the options bind, and do not overlap each other;
/// every tensor belongs to `ctx`.
pub(crate) fn check_distinct<'a>(
    ctx: &Context,
    opts: &AttentionOptions<'a>,
    outputs: &[(&'static str, Region<'_>)],
    inputs: &[(&'static str, Region<'a>)],
) -> Result<()> {
    let mut all = option_inputs(opts);
    all.extend_from_slice(inputs);
    check_call(ctx, outputs, &all)
}

/// Checks the packed views of a fused forward or backward ([`HeadsView::packed`]) against the
/// call's lengths: packed ones (`SeqLens::packed`) whose sequences fit each view's rows, and masks
/// that align queries and keys at a sequence's first rows only where its queries are its keys.
pub(super) fn check_packed(
    views: &[(&'static str, &HeadsView, PackedSide)],
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    if views
        .iter()
        .all(|(_, view, _)| view.packed_rows().is_none())
    {
        return Ok(());
    }
    let lens = packed_lens(opts)?;
    for &(arg, view, side) in views {
        if let Some(packed) = view.packed_side().filter(|&packed| packed != side) {
            return Err(Error::shape(
                arg,
                format!("is packed on the lengths' {packed:?}; it takes the {side:?}' rows"),
            ));
        }
        check_packed_view(arg, view, lens)?;
    }
    let positional = opts.causal || opts.window.is_some() || opts.alibi || opts.relative.is_some();
    // Decoding aligns each sequence's queries as its last keys, whatever the lengths.
    if positional && lens.q_lens() != lens.kv_lens() && !opts.align_lens {
        return Err(Error::shape(
            "seq_lens",
            "packed lengths with q_lens != kv_lens: causal masks, windows, ALiBi and relative \
             buckets align each sequence's queries and keys at their first rows, so they need \
             q_lens == kv_lens (self-attention)",
        ));
    }
    if qk_norm::active(opts) {
        return Err(Error::shape(
            "cosine/key_norm_clip",
            "cosine scores and key clipping take padded views; packed views are not supported there",
        ));
    }
    Ok(())
}

/// The packed lengths a call with packed views needs (`opts.seq_lens`).
fn packed_lens<'a>(opts: &AttentionOptions<'a>) -> Result<&'a SeqLens> {
    opts.seq_lens
        .filter(|lens| lens.is_packed())
        .ok_or_else(packed_lens_missing)
}

/// A new f32 output tensor laid out like the view `like` of `side`: `[rows, heads, dim]` packed as
/// `like` is (by `opts.seq_lens`), or `[batch, seq, heads, dim]`; with its view.
pub(super) fn output_like(
    ctx: &Context,
    label: &'static str,
    like: &HeadsView,
    side: PackedSide,
    [heads, dim]: [usize; 2],
    opts: &AttentionOptions<'_>,
) -> Result<(GpuTensor, HeadsView)> {
    let [batch, seq, _, _] = like.shape();
    let shape = match like.packed_rows() {
        Some(rows) => vec![rows, heads, dim],
        None => vec![batch, seq, heads, dim],
    };
    let t = GpuTensor::uninit(ctx, label, &shape)?;
    let view = view_like(&t, like, side, opts)?;
    Ok((t, view))
}

/// The view of `t` (from [`output_like`]) laid out like `like`.
pub(super) fn view_like(
    t: &GpuTensor,
    like: &HeadsView,
    side: PackedSide,
    opts: &AttentionOptions<'_>,
) -> Result<HeadsView> {
    match like.packed_rows() {
        Some(_) => t.packed_heads(packed_lens(opts)?, side),
        None => t.heads(),
    }
}

/// Refuses packed views in the kernels that read padded ones only (`what` names them).
pub(crate) fn refuse_packed(views: &[(&'static str, &HeadsView)], what: &str) -> Result<()> {
    match views.iter().find(|(_, view)| view.packed_rows().is_some()) {
        Some(&(arg, _)) => Err(Error::shape(
            arg,
            format!(
                "is packed; {what} takes padded [batch, seq, heads, head_dim] views (the fused \
                 attention forward and backward take packed ones)"
            ),
        )),
        None => Ok(()),
    }
}

/// Largest head dimension (Dk or Dv) the fused kernels hold in registers.
pub const MAX_HEAD_DIM: usize = 256;

/// Largest head dim of the CPU-driver family's fused backward on GPU (non-CPU) adapters (the GPU
/// family takes every head dim). Its dK/dV kernel keeps four
/// keys' k, v, dK and dV rows per invocation (`16 * 2 * (Dk + Dv)` bytes): at 192 (12 KiB) the
/// NVIDIA Vulkan driver runs it, at 256 (16 KiB) it loses the device (measured on an H100, driver
/// 580).
pub const MAX_FUSED_BACKWARD_HEAD_DIM_GPU: usize = 192;
/// Storage buffers the fused backward kernels bind in one dispatch with a score bias or relative
/// table (dK/dV: sequence lengths, score bias, Q, K, V, dO, stats, dK, dV; dQ: the same with dQ and
/// the relative table's row shares), one more than WebGPU's default limit of 8; without either,
/// one fewer ([`FUSED_BACKWARD_STORAGE_BUFFERS_WITHOUT_BIAS`]).
pub const FUSED_BACKWARD_STORAGE_BUFFERS: u32 = 9;
/// Storage buffers the fused backward kernels bind when the call has no score bias or relative
/// table: WebGPU's default limit.
pub const FUSED_BACKWARD_STORAGE_BUFFERS_WITHOUT_BIAS: u32 = 8;

/// Refuses devices created with fewer storage buffers per stage than the backward of this call
/// binds (wgpu would raise a validation error when the pipeline is created).
pub(super) fn check_storage_buffer_limit(ctx: &Context, opts: &AttentionOptions<'_>) -> Result<()> {
    let have = ctx.limits().max_storage_buffers_per_shader_stage;
    let (needed, why) = match opts.bias.is_some() || opts.relative.is_some() {
        true => (
            FUSED_BACKWARD_STORAGE_BUFFERS,
            " with a score bias or relative-position table",
        ),
        false => (FUSED_BACKWARD_STORAGE_BUFFERS_WITHOUT_BIAS, ""),
    };
    if have < needed {
        return Err(Error::shape(
            "device limits",
            format!(
                "max_storage_buffers_per_shader_stage is {have}, but the fused attention backward{why} binds {needed} storage buffers per dispatch; request the adapter's limit (adapter.limits()) when creating the device"
            ),
        ));
    }
    Ok(())
}

/// Largest key tile of the forward kernel (`MAX_BN` in the shader).
pub(super) const MAX_BLOCK_N: u32 = 64;

/// The allocating forms make f32 outputs: point f16 callers at the `_into` forms.
pub(super) fn allocating_f16(e: Error) -> Error {
    match e {
        Error::DType { arg, found, .. } => Error::DType {
            arg,
            found,
            message: "this form allocates f32 outputs; for f16 views record \
                      attention_forward_into / attention_backward_into with GpuTensorF16 outputs"
                .into(),
        },
        other => other,
    }
}

/// Validates the bias and relative options against the problem.
fn check_bias(shape: &AttentionShape, opts: &AttentionOptions<'_>) -> Result<()> {
    if opts.bias.is_some() && opts.relative.is_some() {
        return Err(Error::shape(
            "bias/relative_buckets",
            "one additive score term per call: add the relative-position bias into the bias tensor, or pass padding through seq_lens",
        ));
    }
    if let Some(bias) = opts.bias {
        let [bb, hb, lq, lk] = bias.view.shape();
        if !(bb == 1 || bb == shape.batch)
            || !(hb == 1 || hb == shape.heads)
            || lq != shape.q_seq
            || lk != shape.kv_seq
        {
            let broadcast = |n: usize| match n {
                1 => "1".to_string(),
                n => format!("{n} or 1"),
            };
            return Err(Error::shape(
                "bias",
                format!(
                    "has shape {:?}; expected [{}, {}, {}, {}] (batch, query heads, Lq, Lk)",
                    bias.view.shape(),
                    broadcast(shape.batch),
                    broadcast(shape.heads),
                    shape.q_seq,
                    shape.kv_seq
                ),
            ));
        }
        if bias.view.end_element() > u32::MAX as usize {
            return Err(Error::Unsupported {
                arg: "bias (last element index)",
                value: bias.view.end_element() as u64,
                limit: u32::MAX as u64,
                hint: "; bind a smaller view",
            });
        }
    }
    if let Some((buckets, table)) = opts.relative {
        buckets.check()?;
        check_tensor("relative table", table, &[shape.heads, buckets.buckets])?;
        if let Some(grad) = opts.relative_grad {
            check_tensor("relative table grad", grad, &[shape.heads, buckets.buckets])?;
            if grad.overlaps(table) {
                return Err(Error::shape(
                    "relative table grad",
                    "shares a buffer with the table; write the gradient to a separate tensor",
                ));
            }
        }
    } else if opts.relative_grad.is_some() {
        return Err(Error::shape(
            "relative_grad",
            "is set without relative buckets; use relative_buckets_learned",
        ));
    }
    Ok(())
}
