//! Fused additive (Bahdanau) attention, forward and backward (`shaders/additive_*.wgsl`): scores
//! `e_ij = scale * sum_c w[h, c] tanh(a[i, h, c] + b[j, h, c] + bias[h, c])` from query and key
//! projections `a [B, Lq, H, Da]`, `b [B, Lk, H, Da]` (strided views, like Q and K), an online
//! softmax over the visible keys and `O = P V`. The `[Lq, Lk, Da]` tensor of tanh arguments is
//! never formed: the kernels recompute each tanh where they need it (O(L) memory). The backward
//! gives `da`, `db`,
//! `dv` and the score vector's and bias's gradients `dw`, `dbias` `[H, Da]`, deterministically: a
//! query-side kernel (da, D, per-row shares of dw), a key-side kernel (db, dV), and a fixed-order
//! sum. Masks: causal, per-batch lengths and windows, as in dot-product attention (the shared
//! header's rules). CPU reference: [`crate::reference::additive`].

use super::binding::{
    base_params, bind_output_pair, bind_tensor, bind_view, empty_rw_binding, encode_chunks,
    encode_kernel, seq_lens_buffer, set_grid, Binding, Bound, Kernel, Shared, FLAG_ALIGN_LENS,
    SIMPLE_WG, VIEW_DK, VIEW_DO, VIEW_DQ, VIEW_DV, VIEW_K, VIEW_O, VIEW_Q, VIEW_V,
};
use super::call::AttentionOutput;
use super::forward::{check_forward_outputs, check_rows};
use super::header::{with_common, with_sizes};
use super::options::AttentionOptions;
use super::shape::{check_distinct, check_options, check_tensor, check_view, refuse_packed};
use super::unfused::{encode_pv, encode_softmax, encode_unfused_output_grads, scores_shape};
use crate::device::{Context, KernelFamily};
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_context, check_f32};
use crate::kernels::dispatch::loop_chunks;
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, HeadsView};

pub(super) const COMMON: &str = include_str!("../../../shaders/additive/common.wgsl");
pub(super) const FORWARD: &str = include_str!("../../../shaders/additive/forward.wgsl");
pub(super) const DECODE: &str = include_str!("../../../shaders/additive/decode.wgsl");
pub(super) const BACKWARD_DA: &str = include_str!("../../../shaders/additive/backward_da.wgsl");
pub(super) const BACKWARD_DB: &str = concat!(
    include_str!("../../../shaders/additive/backward_db.wgsl"),
    include_str!("../../../shaders/attention/output_pair.wgsl")
);
pub(super) const PARAM_GRADS: &str = include_str!("../../../shaders/additive/param_grads.wgsl");
pub(super) const SCORES: &str = include_str!("../../../shaders/additive/scores.wgsl");
pub(super) const BACKWARD_UNFUSED: &str =
    include_str!("../../../shaders/additive/backward_unfused.wgsl");
pub(super) const BACKWARD_WORKSPACE: &str =
    include_str!("../../../shaders/additive/backward_workspace.wgsl");
pub(super) const BACKWARD_PACK: &str = include_str!("../../../shaders/additive/backward_pack.wgsl");
pub(super) const BACKWARD_LANES: &str =
    include_str!("../../../shaders/additive/backward_lanes.wgsl");
const SCORE_PARAMS: &str = include_str!("../../../shaders/additive/score_params.wgsl");

/// Largest score dim `Da` and value head dim the additive kernels hold per invocation.
pub const MAX_ADDITIVE_DIM: usize = 128;
/// Storage buffers each fused backward kernel binds: the query side lengths, a, b, v, O, dO, da and
/// the workspace (which holds w, the bias and lse too), the key side dO, db and dV in place of O,
/// dO and da. WebGPU's default limit.
pub const ADDITIVE_BACKWARD_STORAGE_BUFFERS: u32 = 8;

/// Rows (queries or keys) per workgroup, one per invocation.
const WG: u32 = 64;

/// Rows of the other side per staged tile: 32, or fewer where the kernels' workgroup memory (its
/// largest user, the key-side backward: pair rows, value rows, `w`, four per-row scalars) would not
/// fit the device's limit (Da = Dv = 128 needs 33 KiB at 32 rows; Metal on Apple GPUs offers 32
/// KiB).
/// `lanes`: invocations per row (the backward's; 1 elsewhere).
fn staged_tile(ctx: &Context, s: &AttentionShape, lanes: u32) -> u32 {
    let limit = ctx.limits().max_compute_workgroup_storage_size as usize;
    tile_for_limit(limit, s.head_dim_qk, s.head_dim_v, lanes)
}

/// Invocations per row in the fused backward (`shaders/additive/backward_lanes.wgsl`): enough that
/// each holds at most two vec4s of the score dim and eight value dims (then 64 floats of a row's
/// state and tanh, which fits the 128 registers of a wave64 invocation on RDNA3), on GPUs. On CPU
/// drivers, one: their invocations are SIMD lanes with no register file to fit, and a barrier per
/// step only costs (the lanes ran the backward 2.2x slower on lavapipe: BENCHMARKS.md).
fn backward_lanes(ctx: &Context, s: &AttentionShape) -> u32 {
    if ctx.kernel_family() == KernelFamily::CpuDriver {
        return 1;
    }
    lanes_for(s.head_dim_qk, s.head_dim_v)
}

/// The fused backward's pipeline names (query side, key side): the CPU-driver family's one-lane
/// builds say so.
fn backward_names(ctx: &Context) -> [&'static str; 2] {
    match ctx.kernel_family() {
        KernelFamily::CpuDriver => ["additive_backward_da_cpu", "additive_backward_db_cpu"],
        _ => ["additive_backward_da", "additive_backward_db"],
    }
}

fn lanes_for(da: usize, dv: usize) -> u32 {
    let lanes = da
        .div_ceil(4)
        .div_ceil(2)
        .max(dv.div_ceil(8))
        .next_power_of_two();
    lanes.min(WG as usize) as u32
}

/// The forward's staged tile and whether its rows of `a + bias` fit in workgroup memory beside it
/// (`OWN_IN_WORKGROUP`: 64 registers fewer per invocation at Da = 64, which RDNA3 needs to run the
/// kernel without spilling): the largest tile of 32 or 16 rows that leaves room for them, else the
/// shared tile with the rows in registers.
fn forward_tile(ctx: &Context, s: &AttentionShape) -> (u32, bool) {
    let limit = ctx.limits().max_compute_workgroup_storage_size as usize;
    let own = 16 * WG as usize * (s.head_dim_qk.div_ceil(4) | 1);
    match largest_tile(limit, [s.head_dim_qk, s.head_dim_v], 1, |_| own) {
        Some(tile) => (tile, true),
        None => (staged_tile(ctx, s, 1), false),
    }
}

/// The staged tile of the backward's kernels with `lanes` invocations per row (and of the forward
/// where its own rows do not fit beside one).
fn tile_for_limit(limit: usize, da: usize, dv: usize, lanes: u32) -> u32 {
    // The key side's four per-row scalars and the lanes' partial sums.
    let sums = if lanes > 1 { 32 * WG as usize } else { 0 };
    largest_tile(limit, [da, dv], lanes, |tile| 16 * tile + sums).unwrap_or(8)
}

/// The largest staged tile of 32 or 16 rows whose workgroup memory (the staged pair rows, value
/// rows and `w` of `additive/common.wgsl`, padded for `lanes` invocations per row, plus a kernel's
/// `extra` bytes) fits `limit` bytes.
fn largest_tile(
    limit: usize,
    [da, dv]: [usize; 2],
    lanes: u32,
    extra: impl Fn(usize) -> usize,
) -> Option<u32> {
    let lanes = lanes as usize;
    let da4 = da.div_ceil(4).next_multiple_of(lanes);
    let dv = dv.next_multiple_of(lanes);
    let bytes = |tile: usize| 16 * (tile * da4 + tile / 4 * dv + da4) + extra(tile);
    [32, 16]
        .into_iter()
        .find(|&t| bytes(t) <= limit)
        .map(|t| t as u32)
}

/// The fused kernels' loop iterations per invocation (llvmpipe caps their total: `loop_chunks`),
/// counted from the shaders' loops, the 4-wide loops of the header's helpers included.
#[derive(Clone, Copy)]
enum AdditiveKernel {
    Forward,
    Decode,
    BackwardQuerySide,
    BackwardKeySide,
}

impl AdditiveKernel {
    /// (iterations per row of the other side, fixed iterations) for score dim `da`, value dim `dv`,
    /// staged tiles of `tile` rows and `lanes` invocations per row (the backward's; 1 elsewhere).
    fn loop_cost(self, da: usize, dv: usize, tile: u32, lanes: u32) -> (usize, usize) {
        let (wg, tile, lanes) = (WG as usize, tile as usize, lanes as usize);
        let da4 = da.div_ceil(4).next_multiple_of(lanes);
        let dv = dv.next_multiple_of(lanes);
        // Staging the other side's rows (a helper's 4-wide loop per vec4) and the value (or dO) rows.
        let staging = (tile * da4).div_ceil(wg) * 5 + (tile * dv).div_ceil(wg) + 1;
        let fixed = 16 * da4 + 4 * dv + 32;
        // Per step of the backward, a lane's loops over its score vec4s (twice) and value dims
        // (twice on the key side), and the sum over the row's lanes.
        let (lane_da4, lane_dv) = (da4 / lanes, dv / lanes);
        let backward_step = 1 + 2 * lane_da4 + 2 * lane_dv + lanes;
        // (iterations per step of the key or query loop, rows that step covers, fixed iterations)
        let (per_step, rows, fixed) = match self {
            // Per four keys: the scores, a rescale (at worst every time), P V.
            Self::Forward => (staging + tile / 4 * (2 + da4 + 2 * dv), tile, fixed),
            // One key per invocation and tile of WG: the score, the tile's max and sum, P V for
            // the owned value dims.
            Self::Decode => {
                let own = dv.div_ceil(wg);
                (
                    5 * da4 + 2 * wg + own * (wg + 1) + 1,
                    wg,
                    16 * da4 + 4 * own + 32,
                )
            }
            // Scores, dO . v, the derivatives; the key side also stages lse, D and the ranges.
            Self::BackwardQuerySide => (staging + tile / 4 * backward_step, tile, fixed),
            Self::BackwardKeySide => (
                staging + tile.div_ceil(wg) + tile / 4 * backward_step,
                tile,
                fixed,
            ),
        };
        (per_step.div_ceil(rows) + 1, fixed)
    }
}

/// The learned score parameters of additive attention: the score vector `w` and the bias, `[H, Da]`
/// each.
#[derive(Clone, Copy, Debug)]
pub struct AdditiveScores<'a> {
    /// The score vector `w [H, Da]`.
    pub w: &'a GpuTensor,
    /// The bias added to the query projection, `[H, Da]`.
    pub bias: &'a GpuTensor,
}

/// Gradients of [`additive_backward`]: `da`, `db`, `dv` shaped like `a`, `b`, `v`; `dw`, `dbias`
/// `[H, Da]`.
#[derive(Clone, Debug)]
pub struct AdditiveGrads {
    /// Gradient of the query projection `a`.
    pub da: GpuTensor,
    /// Gradient of the key projection `b`.
    pub db: GpuTensor,
    /// Gradient of the values.
    pub dv: GpuTensor,
    /// Gradient of the score vector `w`.
    pub dw: GpuTensor,
    /// Gradient of the bias.
    pub dbias: GpuTensor,
}

/// Checks the views, the score parameters and the options; returns the shape and the scale
/// (`opts.scale`, default 1, divided by the temperature).
fn check(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<(AttentionShape, f32)> {
    let (da, db) = (a.shape()[3], b.shape()[3]);
    if da != db {
        return Err(Error::shape(
            "b score dim",
            format!("a has score dim {da} but b has {db}; the query and key projections share it"),
        ));
    }
    let s = AttentionShape::of(a, b, v)?;
    check_f32(&[("a", a), ("b", b), ("v", v)])?;
    refuse_packed(&[("a", a), ("b", b), ("v", v)], "additive attention")?;
    check_context(
        ctx,
        &[
            ("a", a.region()),
            ("b", b.region()),
            ("v", v.region()),
            ("w", scores.w.region()),
            ("bias", scores.bias.region()),
        ],
    )?;
    if s.kv_heads != s.heads {
        return Err(Error::shape(
            "b heads",
            format!(
                "a has {} heads and b {}: additive attention projects keys per query head",
                s.heads, s.kv_heads
            ),
        ));
    }
    for (arg, value) in [
        ("a/b score dim", s.head_dim_qk),
        ("v head_dim", s.head_dim_v),
    ] {
        if value > MAX_ADDITIVE_DIM {
            return Err(Error::Unsupported {
                arg,
                value: value as u64,
                limit: MAX_ADDITIVE_DIM as u64,
                hint: "",
            });
        }
    }
    check_tensor("w", scores.w, &[s.heads, s.head_dim_qk])?;
    check_tensor("bias", scores.bias, &[s.heads, s.head_dim_qk])?;
    for (arg, set) in [
        ("softcap", opts.softcap.is_some()),
        ("alibi", opts.alibi || opts.alibi_slopes.is_some()),
        ("sinks", opts.sinks.is_some()),
        ("bias tensor", opts.bias.is_some()),
        ("relative buckets", opts.relative.is_some()),
        (
            "cosine/key_norm_clip",
            opts.cosine.is_some() || opts.learned_cosine.is_some() || opts.key_clip.is_some(),
        ),
    ] {
        if set {
            return Err(Error::shape(
                arg,
                "is a dot-product score modifier; additive attention takes masks (causal, seq_lens, window), scale and temperature",
            ));
        }
    }
    // The dot-product default scale 1/sqrt(Dk) does not apply: the score vector is learned.
    let unscaled = AttentionOptions {
        scale: Some(opts.scale.unwrap_or(1.0)),
        ..*opts
    };
    let scale = check_options(ctx, &s, &unscaled)?;
    Ok((s, scale))
}

/// A fused forward kernel after the additive header and the bindings of w and the bias (the
/// attention header still to prepend).
fn with_shared(body: &str) -> String {
    format!("{COMMON}\n{SCORE_PARAMS}\n{body}")
}

/// A fused backward kernel (`BACKWARD_DA` or `BACKWARD_DB`) after the additive header, the
/// workspace (which holds copies of w and the bias) and the lanes header (the attention header
/// still to prepend).
fn backward_source(body: &str) -> String {
    format!("{COMMON}\n{BACKWARD_WORKSPACE}\n{BACKWARD_LANES}\n{body}")
}

/// A fused kernel `text` with both shared headers and its per-invocation arrays sized exactly for
/// `s`, and the kernel's own `sizes`.
fn sized(text: &str, s: &AttentionShape, sizes: &[(&str, u32)], score_bias: bool) -> String {
    let mut all = vec![
        ("MAX_DA", s.head_dim_qk as u32),
        ("MAX_DV", s.head_dim_v as u32),
    ];
    all.extend_from_slice(sizes);
    with_common(&with_sizes(&all, text), score_bias)
}

/// A fused backward kernel with every header, sized for `lanes` invocations per row.
fn sized_backward(body: &str, s: &AttentionShape, lanes: u32, score_bias: bool) -> String {
    let lanes = lanes as usize;
    let lane_da4 = s.head_dim_qk.div_ceil(4).div_ceil(lanes) as u32;
    let lane_dv = s.head_dim_v.div_ceil(lanes) as u32;
    let sizes = [("MAX_LANE_DA4", lane_da4), ("MAX_LANE_DV", lane_dv)];
    sized(&backward_source(body), s, &sizes, score_bias)
}

/// The fused kernels' sources for the translation tests, at head dims 128 and one lane per row.
pub(super) fn shader_sources() -> Vec<(&'static str, String)> {
    let s = AttentionShape {
        batch: 1,
        q_seq: 1,
        kv_seq: 1,
        heads: 1,
        kv_heads: 1,
        head_dim_qk: MAX_ADDITIVE_DIM,
        head_dim_v: MAX_ADDITIVE_DIM,
    };
    let own = [("MAX_OWN", MAX_ADDITIVE_DIM.div_ceil(WG as usize) as u32)];
    vec![
        (
            "additive_forward",
            sized(&with_shared(FORWARD), &s, &[], true),
        ),
        (
            "additive_decode",
            sized(&with_shared(DECODE), &s, &own, true),
        ),
        (
            "additive_backward_da",
            sized_backward(BACKWARD_DA, &s, 1, true),
        ),
        (
            "additive_backward_db",
            sized_backward(BACKWARD_DB, &s, 1, true),
        ),
    ]
}

fn constants(s: &AttentionShape, tile: u32) -> [(&'static str, u32); 4] {
    [
        ("WG", WG),
        ("TILE", tile),
        ("DA", s.head_dim_qk as u32),
        ("DV", s.head_dim_v as u32),
    ]
}

/// The fused backward's constants: [`constants`] and its invocations per row.
fn backward_constants(s: &AttentionShape, tile: u32, lanes: u32) -> Vec<(&'static str, u32)> {
    let mut constants = constants(s, tile).to_vec();
    constants.push(("LANES", lanes));
    constants
}

/// Additive attention forward into new tensors, submitted: `out [B, Lq, H, Dv]`, `lse [B, H, Lq]`.
pub fn additive_forward(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionOutput> {
    let (s, _) = check(ctx, a, b, v, scores, opts)?;
    AttentionOutput::recorded(ctx, &s, |encoder, out, lse| {
        additive_forward_into(ctx, encoder, a, b, v, scores, out, lse, opts)
    })
}

/// Records the additive attention forward, writing `out` (a `[B, Lq, H, Dv]` view) and `lse`.
/// Nothing is recorded if the input is rejected.
#[allow(clippy::too_many_arguments)]
pub fn additive_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    out: &HeadsView,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    encode_forward(ctx, encoder, [a, b, v], scores, out, lse, opts, false)
}

/// Additive attention for incremental decoding: new query rows `a [B, L, H, Da]` (`q_lens` per
/// sequence) against caches `b [B, capacity, H, Da]` and `v [B, capacity, H, Dv]` holding `kv_lens`
/// keys each, the new ones last. Masks align on each sequence's own lengths, as in
/// [`super::attention_decode_into`]: query `i` of sequence `s` sits at position
/// `kv_lens[s] - q_lens[s] + i`. Up to 16 rows per sequence, one workgroup per row, its
/// invocations splitting the cached keys (`shaders/additive/decode.wgsl`); more (a prefill chunk),
/// the forward kernel. Results match [`additive_forward_into`] on the whole sequence.
#[allow(clippy::too_many_arguments)]
pub fn additive_decode_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    a: &HeadsView,
    b_cache: &HeadsView,
    v_cache: &HeadsView,
    scores: AdditiveScores<'_>,
    out: &HeadsView,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let [batch, rows, _, _] = a.shape();
    let capacity = b_cache.shape()[1];
    super::decode::check_decode_lens("additive decoding", [batch, rows, capacity], opts)?;
    encode_forward(
        ctx,
        encoder,
        [a, b_cache, v_cache],
        scores,
        out,
        lse,
        opts,
        true,
    )
}

/// Records the fused forward; `aligned`: masks align on each sequence's lengths (decoding).
#[allow(clippy::too_many_arguments)]
fn encode_forward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    [a, b, v]: [&HeadsView; 3],
    scores: AdditiveScores<'_>,
    out: &HeadsView,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
    aligned: bool,
) -> Result<()> {
    let (s, scale) = check(ctx, a, b, v, scores, opts)?;
    check_f32(&[("out", out)])?;
    let inputs = [
        ("a", a.region()),
        ("b", b.region()),
        ("v", v.region()),
        ("w", scores.w.region()),
        ("bias", scores.bias.region()),
    ];
    refuse_packed(&[("out", out)], "additive attention")?;
    check_forward_outputs(ctx, &s, out, lse, &inputs, opts)?;
    let mut params = base_params(&s, scale, opts);
    if aligned {
        params.flags |= FLAG_ALIGN_LENS;
    }
    let bindings = [
        bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
        bind_view(ctx, "b", b, VIEW_K, &mut params)?,
        bind_view(ctx, "v", v, VIEW_V, &mut params)?,
        bind_tensor(ctx, "w", scores.w)?,
        bind_tensor(ctx, "bias", scores.bias)?,
        bind_view(ctx, "out", out, VIEW_O, &mut params)?,
        bind_tensor(ctx, "lse", lse)?,
    ];
    // Decoding a few rows per sequence (at most a quarter of a workgroup: a step's new tokens, not
    // a prefill chunk): one workgroup per query row, its invocations splitting the keys, where the
    // forward's 64-row workgroups would sit mostly idle; otherwise WG rows per workgroup.
    let decoding = aligned && s.q_seq * 4 <= WG as usize;
    let (tile, own_in_workgroup) = match decoding {
        true => (staged_tile(ctx, &s, 1), false),
        false => forward_tile(ctx, &s),
    };
    let (kernel, name, source, blocks, align) = match decoding {
        true => (
            AdditiveKernel::Decode,
            "additive_decode",
            DECODE,
            s.q_seq,
            WG,
        ),
        false => {
            let blocks = s.q_seq.div_ceil(WG as usize);
            let kernel = AdditiveKernel::Forward;
            (kernel, "additive_forward", FORWARD, blocks, tile)
        }
    };
    let mut constants = constants(&s, tile).to_vec();
    if !decoding {
        constants.push(("OWN_IN_WORKGROUP", own_in_workgroup as u32));
    }
    let grid = set_grid(&mut params, blocks, s.batch * s.heads)?;
    let (per_key, fixed) = kernel.loop_cost(s.head_dim_qk, s.head_dim_v, tile, 1);
    let chunks = loop_chunks(ctx, s.kv_seq, per_key, fixed, align as usize);
    let mut pass = ctx.begin_pass(encoder, name);
    encode_chunks(
        ctx,
        &mut pass,
        Kernel {
            name,
            source: |score_bias| {
                let own = [("MAX_OWN", s.head_dim_v.div_ceil(WG as usize) as u32)];
                let sizes: &[(&str, u32)] = match decoding {
                    true => &own,
                    false => &[],
                };
                sized(&with_shared(source), &s, sizes, score_bias)
            },
            constants: &constants,
        },
        &mut params,
        Bound {
            shared: Shared::lens(seq_lens_buffer(ctx, opts)),
            bindings: &bindings,
            grid,
        },
        &chunks,
    );
    Ok(())
}

/// The unfused baseline of [`additive_forward`], for the benchmark: the scores materialised as
/// `[B, H, Lq, Lk]` (`shaders/additive/scores.wgsl`), the masked softmax and `P V` of the unfused
/// dot-product path. Submitted; O(L^2) memory.
pub fn additive_forward_unfused(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionOutput> {
    let (s, scale) = check(ctx, a, b, v, scores, opts)?;
    let probs = GpuTensor::uninit(ctx, "additive scores", &scores_shape(ctx, &s)?)?;
    let AttentionOutput { out, lse } = AttentionOutput::new(ctx, &s)?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "additive_forward_unfused");
        encode_unfused_probs(
            ctx,
            &mut pass,
            &s,
            scale,
            [a, b],
            scores,
            opts,
            [&probs, &lse],
        )?;
        encode_pv(ctx, &mut pass, &s, &probs, v, &out.heads()?)?;
    }
    ctx.submit(encoder)?;
    Ok(AttentionOutput { out, lse })
}

/// Attention maps of additive attention: the probabilities `P[b, h, i, j]` of query rows `rows`,
/// recomputed from a, b and the forward's lse with the same masks, as a new `[B, H, rows, Lk]`
/// tensor (0 where masked). See [`attention_probabilities`](super::attention_probabilities) for
/// what maps do and do not show.
pub fn additive_probabilities(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    lse: &GpuTensor,
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
    rows: std::ops::Range<usize>,
) -> Result<GpuTensor> {
    // V plays no part; b stands in for it in the shape check.
    let (s, scale) = check(ctx, a, b, b, scores, opts)?;
    check_tensor("lse", lse, &[s.batch, s.heads, s.q_seq])?;
    check_rows(&rows, s.q_seq)?;
    let out = GpuTensor::uninit(
        ctx,
        "additive probabilities",
        &[s.batch, s.heads, rows.len(), s.kv_seq],
    )?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "additive_probabilities");
        encode_scores(
            ctx,
            &mut pass,
            &s,
            scale,
            [a, b],
            scores,
            opts,
            Some(lse),
            rows,
            &out,
        )?;
    }
    ctx.submit(encoder)?;
    Ok(out)
}

/// Records `shaders/additive/scores.wgsl` over query rows `rows`: the scaled scores, or with `lse`
/// the masked probabilities.
#[allow(clippy::too_many_arguments)]
fn encode_scores(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    scale: f32,
    [a, b]: [&HeadsView; 2],
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
    lse: Option<&GpuTensor>,
    rows: std::ops::Range<usize>,
    out: &GpuTensor,
) -> Result<()> {
    let elements = out.len();
    if elements > u32::MAX as usize {
        return Err(Error::Unsupported {
            arg: "additive scores (B * H * rows * Lk)",
            value: elements as u64,
            limit: u32::MAX as u64,
            hint: "; use the fused kernels, or fewer rows at a time",
        });
    }
    let mut params = base_params(s, scale, opts);
    params.chunk_begin = rows.start as u32;
    params.chunk_end = rows.end as u32;
    let dummy = Binding {
        buffer: ctx.empty_storage(),
        offset_bytes: 0,
        size_bytes: 4,
    };
    let bindings = [
        bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
        bind_view(ctx, "b", b, VIEW_K, &mut params)?,
        bind_tensor(ctx, "w", scores.w)?,
        bind_tensor(ctx, "bias", scores.bias)?,
        bind_tensor(ctx, "scores", out)?,
        match lse {
            Some(lse) => bind_tensor(ctx, "lse", lse)?,
            None => dummy,
        },
    ];
    let grid = set_grid(&mut params, elements.div_ceil(SIMPLE_WG as usize), 1)?;
    encode_kernel(
        ctx,
        pass,
        Kernel {
            name: "additive_scores",
            source: |score_bias| with_common(SCORES, score_bias),
            constants: &[("WG", SIMPLE_WG), ("PROBS", lse.is_some() as u32)],
        },
        &params,
        Bound {
            shared: Shared::lens(seq_lens_buffer(ctx, opts)),
            bindings: &bindings,
            grid,
        },
    );
    Ok(())
}

/// Additive attention backward into new tensors, submitted, for the gradient `d_out` at the
/// forward's
/// `out` (with its `lse`).
#[allow(clippy::too_many_arguments)]
pub fn additive_backward(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    out: &HeadsView,
    lse: &GpuTensor,
    d_out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AdditiveGrads> {
    let (s, _) = check(ctx, a, b, v, scores, opts)?;
    let (bb, lq, lk, h) = (s.batch, s.q_seq, s.kv_seq, s.heads);
    let grads = AdditiveGrads {
        da: GpuTensor::uninit(ctx, "additive da", &[bb, lq, h, s.head_dim_qk])?,
        db: GpuTensor::uninit(ctx, "additive db", &[bb, lk, h, s.head_dim_qk])?,
        dv: GpuTensor::uninit(ctx, "additive dv", &[bb, lk, h, s.head_dim_v])?,
        dw: GpuTensor::uninit(ctx, "additive dw", &[h, s.head_dim_qk])?,
        dbias: GpuTensor::uninit(ctx, "additive dbias", &[h, s.head_dim_qk])?,
    };
    let workspace = additive_backward_workspace(ctx, &s)?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    additive_backward_into(
        ctx,
        &mut encoder,
        [a, b, v],
        scores,
        out,
        lse,
        d_out,
        [&grads.da.heads()?, &grads.db.heads()?, &grads.dv.heads()?],
        [&grads.dw, &grads.dbias],
        &workspace,
        opts,
    )?;
    ctx.submit(encoder)?;
    Ok(grads)
}

/// The backward's workspace for `s` (`shaders/additive/backward_workspace.wgsl`): each row's
/// `D = dO . O` (`[B, H, Lq]`, padded to a multiple of 64 values so the shares start at a 256-byte
/// boundary, WebGPU's largest storage offset alignment), each row's share of `dw`
/// (`[H, B, Lq, Da]`), and copies of `w`, the bias and `lse`.
pub fn additive_backward_workspace(ctx: &Context, s: &AttentionShape) -> Result<GpuTensor> {
    GpuTensor::zeros(ctx, &[workspace_len(s)])
}

fn workspace_len(s: &AttentionShape) -> usize {
    let rows = s.batch * s.heads * s.q_seq;
    rows.div_ceil(64) * 64 + rows * s.head_dim_qk + 2 * s.heads * s.head_dim_qk + rows
}

/// Records the additive attention backward: `[da, db, dv]` views shaped like `[a, b, v]`, and
/// `[dw, dbias]` `[H, Da]`. Nothing is recorded if the input is rejected.
#[allow(clippy::too_many_arguments)]
pub fn additive_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    [a, b, v]: [&HeadsView; 3],
    scores: AdditiveScores<'_>,
    out: &HeadsView,
    lse: &GpuTensor,
    d_out: &HeadsView,
    [da, db, dv]: [&HeadsView; 3],
    [dw, dbias]: [&GpuTensor; 2],
    workspace: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let (s, scale) = check(ctx, a, b, v, scores, opts)?;
    let have = ctx.limits().max_storage_buffers_per_shader_stage;
    if have < ADDITIVE_BACKWARD_STORAGE_BUFFERS {
        return Err(Error::shape(
            "device limits",
            format!(
                "max_storage_buffers_per_shader_stage is {have}, but the additive attention backward binds {ADDITIVE_BACKWARD_STORAGE_BUFFERS}; request the adapter's limit (adapter.limits()) when creating the device"
            ),
        ));
    }
    let (bb, lq, lk, h, dda, ddv) = (
        s.batch,
        s.q_seq,
        s.kv_seq,
        s.heads,
        s.head_dim_qk,
        s.head_dim_v,
    );
    check_view("out", out, [bb, lq, h, ddv])?;
    check_view("d_out", d_out, [bb, lq, h, ddv])?;
    check_tensor("lse", lse, &[bb, h, lq])?;
    check_view("da", da, [bb, lq, h, dda])?;
    check_view("db", db, [bb, lk, h, dda])?;
    check_view("dv", dv, [bb, lk, h, ddv])?;
    check_tensor("dw", dw, &[h, dda])?;
    check_tensor("dbias", dbias, &[h, dda])?;
    let rows = bb * h * lq;
    check_tensor("workspace", workspace, &[workspace_len(&s)])?;
    let mut inputs = vec![
        ("a", a.region()),
        ("b", b.region()),
        ("v", v.region()),
        ("out", out.region()),
        ("d_out", d_out.region()),
        ("lse", lse.region()),
        ("w", scores.w.region()),
        ("bias", scores.bias.region()),
    ];
    // The first kernel writes the workspace, which the gradient kernels then read.
    check_distinct(ctx, opts, &[("workspace", workspace.region())], &inputs)?;
    inputs.push(("workspace", workspace.region()));
    let outputs = [
        ("da", da.region()),
        ("db", db.region()),
        ("dv", dv.region()),
        ("dw", dw.region()),
        ("dbias", dbias.region()),
    ];
    check_distinct(ctx, opts, &outputs, &inputs)?;
    let dw_offset = rows.div_ceil(64) as u64 * 256;
    let dw_rows = Binding {
        buffer: workspace.buffer(),
        offset_bytes: dw_offset,
        size_bytes: (rows * dda) as u64 * 4,
    };
    let shared = Shared::lens(seq_lens_buffer(ctx, opts));
    let mut pass = ctx.begin_pass(encoder, "additive_backward");

    // w, the bias and lse into the workspace, where the gradient kernels read them.
    let mut params = base_params(&s, scale, opts);
    let bindings = [
        bind_tensor(ctx, "w", scores.w)?,
        bind_tensor(ctx, "bias", scores.bias)?,
        bind_tensor(ctx, "lse", lse)?,
        bind_tensor(ctx, "workspace", workspace)?,
    ];
    let elements = rows.max(h * dda);
    let grid = set_grid(&mut params, elements.div_ceil(SIMPLE_WG as usize), 1)?;
    encode_kernel(
        ctx,
        &mut pass,
        Kernel {
            name: "additive_backward_pack",
            source: |score_bias| {
                with_common(
                    &format!("{BACKWARD_WORKSPACE}\n{BACKWARD_PACK}"),
                    score_bias,
                )
            },
            constants: &[("WG", SIMPLE_WG)],
        },
        &params,
        Bound {
            shared: Shared::NONE,
            bindings: &bindings,
            grid,
        },
    );

    // Query side: da, D and the dw shares.
    let mut params = base_params(&s, scale, opts);
    let bindings = [
        bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
        bind_view(ctx, "b", b, VIEW_K, &mut params)?,
        bind_view(ctx, "v", v, VIEW_V, &mut params)?,
        bind_tensor(ctx, "workspace", workspace)?,
        bind_view(ctx, "out", out, VIEW_O, &mut params)?,
        bind_view(ctx, "d_out", d_out, VIEW_DO, &mut params)?,
        bind_view(ctx, "da", da, VIEW_DQ, &mut params)?,
    ];
    let lanes = backward_lanes(ctx, &s);
    let rows_per_group = (WG / lanes) as usize;
    let tile = staged_tile(ctx, &s, lanes);
    let constants = backward_constants(&s, tile, lanes);
    let grid = set_grid(&mut params, lq.div_ceil(rows_per_group), bb * h)?;
    let (per_key, fixed) = AdditiveKernel::BackwardQuerySide.loop_cost(dda, ddv, tile, lanes);
    let chunks = loop_chunks(ctx, lk, per_key, fixed, tile as usize);
    encode_chunks(
        ctx,
        &mut pass,
        Kernel {
            name: backward_names(ctx)[0],
            source: |score_bias| sized_backward(BACKWARD_DA, &s, lanes, score_bias),
            constants: &constants,
        },
        &mut params,
        Bound {
            shared,
            bindings: &bindings,
            grid,
        },
        &chunks,
    );

    // Key side: db and dV.
    let mut params = base_params(&s, scale, opts);
    let bindings = [
        bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
        bind_view(ctx, "b", b, VIEW_K, &mut params)?,
        bind_view(ctx, "v", v, VIEW_V, &mut params)?,
        bind_tensor(ctx, "workspace", workspace)?,
        bind_view(ctx, "d_out", d_out, VIEW_DO, &mut params)?,
    ];
    let outputs = bind_output_pair(ctx, [("db", db, VIEW_DK), ("dv", dv, VIEW_DV)], &mut params)?;
    let bindings: Vec<_> = bindings.into_iter().chain(outputs).collect();
    let grid = set_grid(&mut params, lk.div_ceil(rows_per_group), bb * h)?;
    let (per_query, fixed) = AdditiveKernel::BackwardKeySide.loop_cost(dda, ddv, tile, lanes);
    let chunks = loop_chunks(ctx, lq, per_query, fixed, tile as usize);
    encode_chunks(
        ctx,
        &mut pass,
        Kernel {
            name: backward_names(ctx)[1],
            source: |score_bias| sized_backward(BACKWARD_DB, &s, lanes, score_bias),
            constants: &constants,
        },
        &mut params,
        Bound {
            shared,
            bindings: &bindings,
            grid,
        },
        &chunks,
    );

    encode_param_grads(ctx, &mut pass, &s, opts, dw_rows, da, [dw, dbias])
}

/// dw and dbias `[H, Da]`: fixed-order sums of the per-row shares `dw_rows` and of `da` over every
/// (batch, query row).
fn encode_param_grads(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    dw_rows: Binding<'_>,
    da: &HeadsView,
    [dw, dbias]: [&GpuTensor; 2],
) -> Result<()> {
    let mut params = base_params(s, 1.0, opts);
    let bindings = [
        dw_rows,
        bind_view(ctx, "da", da, VIEW_DQ, &mut params)?,
        bind_tensor(ctx, "dw", dw)?,
        bind_tensor(ctx, "dbias", dbias)?,
    ];
    let grid = set_grid(
        &mut params,
        (s.heads * s.head_dim_qk).div_ceil(SIMPLE_WG as usize),
        1,
    )?;
    let chunks = loop_chunks(ctx, s.batch * s.q_seq, 1, 16, 1);
    encode_chunks(
        ctx,
        pass,
        Kernel {
            name: "additive_param_grads",
            source: |score_bias| with_common(PARAM_GRADS, score_bias),
            constants: &[("WG", SIMPLE_WG)],
        },
        &mut params,
        Bound {
            shared: Shared::lens(seq_lens_buffer(ctx, opts)),
            bindings: &bindings,
            grid,
        },
        &chunks,
    );
    Ok(())
}

/// The unfused paths' probabilities: every score materialised into `probs` `[B, H, Lq, Lk]`, then
/// the masked softmax in place, writing `lse`.
#[allow(clippy::too_many_arguments)]
fn encode_unfused_probs(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    scale: f32,
    [a, b]: [&HeadsView; 2],
    scores: AdditiveScores<'_>,
    opts: &AttentionOptions<'_>,
    [probs, lse]: [&GpuTensor; 2],
) -> Result<()> {
    encode_scores(
        ctx,
        pass,
        s,
        scale,
        [a, b],
        scores,
        opts,
        None,
        0..s.q_seq,
        probs,
    )?;
    // The scores are already scaled.
    let lens = seq_lens_buffer(ctx, opts);
    encode_softmax(ctx, pass, s, 1.0, probs, lse, opts, lens)
}

/// The unfused baseline of [`additive_backward`], for the benchmark: P recomputed and materialised
/// as `[B, H, Lq, Lk]` (the unfused forward's kernels), `dP = dO V^T` and `dV = P^T dO` as GEMMs,
/// `dS = P (dP - rowsum(P dP))` by the softmax backward, then da, db and the dw shares from dS with
/// each tanh recomputed per pair (`shaders/additive/backward_unfused.wgsl`), dw and dbias summed as
/// in the fused path. Two `[B, H, Lq, Lk]` tensors: O(L^2) memory.
pub fn additive_backward_unfused(
    ctx: &Context,
    a: &HeadsView,
    b: &HeadsView,
    v: &HeadsView,
    scores: AdditiveScores<'_>,
    d_out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AdditiveGrads> {
    let (s, scale) = check(ctx, a, b, v, scores, opts)?;
    let (bb, lq, lk, h, dda, ddv) = (
        s.batch,
        s.q_seq,
        s.kv_seq,
        s.heads,
        s.head_dim_qk,
        s.head_dim_v,
    );
    check_view("d_out", d_out, [bb, lq, h, ddv])?;
    let shape = scores_shape(ctx, &s)?;
    let probs = GpuTensor::uninit(ctx, "additive probs", &shape)?;
    let dprobs = GpuTensor::uninit(ctx, "additive dprobs", &shape)?;
    let lse = GpuTensor::uninit(ctx, "additive lse", &[bb, h, lq])?;
    let dw_rows = GpuTensor::uninit(ctx, "additive dw shares", &[h, bb, lq, dda])?;
    let grads = AdditiveGrads {
        da: GpuTensor::uninit(ctx, "additive da", &[bb, lq, h, dda])?,
        db: GpuTensor::uninit(ctx, "additive db", &[bb, lk, h, dda])?,
        dv: GpuTensor::uninit(ctx, "additive dv", &[bb, lk, h, ddv])?,
        dw: GpuTensor::uninit(ctx, "additive dw", &[h, dda])?,
        dbias: GpuTensor::uninit(ctx, "additive dbias", &[h, dda])?,
    };
    let (da, db, dv) = (grads.da.heads()?, grads.db.heads()?, grads.dv.heads()?);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "additive_backward_unfused");
        encode_unfused_probs(
            ctx,
            &mut pass,
            &s,
            scale,
            [a, b],
            scores,
            opts,
            [&probs, &lse],
        )?;
        encode_unfused_output_grads(ctx, &mut pass, &s, opts, &probs, &dprobs, v, d_out, &dv)?;
        for query_side in [true, false] {
            let mut params = base_params(&s, scale, opts);
            let bindings = [
                bind_view(ctx, "a", a, VIEW_Q, &mut params)?,
                bind_view(ctx, "b", b, VIEW_K, &mut params)?,
                bind_tensor(ctx, "w", scores.w)?,
                bind_tensor(ctx, "bias", scores.bias)?,
                bind_tensor(ctx, "dS", &dprobs)?,
                match query_side {
                    true => bind_view(ctx, "da", &da, VIEW_DQ, &mut params)?,
                    false => bind_view(ctx, "db", &db, VIEW_DK, &mut params)?,
                },
                match query_side {
                    true => bind_tensor(ctx, "dw shares", &dw_rows)?,
                    false => empty_rw_binding(ctx),
                },
            ];
            let (rows, other) = if query_side { (lq, lk) } else { (lk, lq) };
            let grid = set_grid(
                &mut params,
                (bb * rows * h * dda).div_ceil(SIMPLE_WG as usize),
                1,
            )?;
            let chunks = loop_chunks(ctx, other, 1, 16, 1);
            encode_chunks(
                ctx,
                &mut pass,
                Kernel {
                    name: "additive_backward_unfused",
                    source: |score_bias| with_common(BACKWARD_UNFUSED, score_bias),
                    constants: &[("WG", SIMPLE_WG), ("QUERY_SIDE", query_side as u32)],
                },
                &mut params,
                Bound {
                    shared: Shared::lens(seq_lens_buffer(ctx, opts)),
                    bindings: &bindings,
                    grid,
                },
                &chunks,
            );
        }
        let dw_binding = bind_tensor(ctx, "dw shares", &dw_rows)?;
        let param_grads = [&grads.dw, &grads.dbias];
        encode_param_grads(ctx, &mut pass, &s, opts, dw_binding, &da, param_grads)?;
    }
    ctx.submit(encoder)?;
    Ok(grads)
}

#[cfg(test)]
mod tests {
    use super::tile_for_limit;

    #[test]
    fn staged_tiles_fit_the_workgroup_memory_limit() {
        // WebGPU's default 16 KiB, lavapipe's and Apple's 32 KiB, NVIDIA's 48 KiB.
        assert_eq!(tile_for_limit(49152, 128, 128, 1), 32);
        assert_eq!(tile_for_limit(32768, 64, 64, 1), 32);
        assert_eq!(tile_for_limit(32768, 128, 128, 1), 16);
        assert_eq!(tile_for_limit(16384, 64, 64, 1), 16);
        assert_eq!(tile_for_limit(16384, 128, 128, 1), 8);
        // The GPU family's lanes: their partial sums take 2 KiB.
        assert_eq!(tile_for_limit(32768, 64, 64, 8), 32);
        assert_eq!(tile_for_limit(16384, 64, 64, 8), 16);
        assert_eq!(tile_for_limit(32768, 128, 128, 16), 16);
    }
}
