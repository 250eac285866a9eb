//! Scaled dot-product attention (SPEC.md): the fused FlashAttention-2 style forward and backward
//! (`shaders/attention_forward.wgsl`, `attention_backward_*.wgsl`) and the unfused baseline that
//! materialises the `Lq x Lk` scores (`matmul_strided.wgsl`, `attention_softmax*.wgsl`).
//! CPU reference: [`crate::reference::attention`].
//!
//! Forward writes O and the row log-sum-exp `lse`; backward takes both plus dO and writes dQ, dK, dV,
//! into new tensors or into strided views of a caller's buffers (a packed dQKV projection gradient).

use crate::device::{grid_2d, Context, KernelFamily, StorageBinding};
use crate::error::{Error, Result};
use crate::kernels::dispatch::loop_chunks;
use crate::kernels::matmul::{self, encode_gemm, Elements, Epilogue, Gemm, Operand};
use crate::tensor::{BiasView, DType, GpuTensor, HeadsView, SeqLens};

mod additive;
mod bias;
mod decode;
mod probs;
mod qk_norm;
mod sinks;
mod tiled;
pub use additive::{
    additive_backward, additive_backward_into, additive_backward_unfused,
    additive_backward_workspace, additive_forward, additive_forward_into, additive_forward_unfused,
    additive_probabilities, AdditiveGrads, AdditiveScores, ADDITIVE_BACKWARD_STORAGE_BUFFERS,
    MAX_ADDITIVE_DIM,
};
pub use bias::{attention_bias_backward_into, RelativeBuckets};
pub use decode::{attention_decode, attention_decode_into, DecodePlan};
pub use probs::{attention_probabilities, attention_probabilities_into};
pub use sinks::attention_sinks_backward_into;
use tiled::{encode_forward_tiled, TiledForward};

const COMMON: &str = include_str!("../../../shaders/attention_common.wgsl");
const FORWARD: &str = include_str!("../../../shaders/attention_forward.wgsl");
const BACKWARD_PREPROCESS: &str =
    include_str!("../../../shaders/attention_backward_preprocess.wgsl");
const BACKWARD_DQ: &str = include_str!("../../../shaders/attention_backward_dq.wgsl");
const BACKWARD_DKDV: &str = include_str!("../../../shaders/attention_backward_dkdv.wgsl");
const SOFTMAX: &str = include_str!("../../../shaders/attention_softmax.wgsl");
const SOFTMAX_BACKWARD: &str = include_str!("../../../shaders/attention_softmax_backward.wgsl");

/// Largest head dimension (Dk or Dv) the fused kernels hold in registers.
pub const MAX_HEAD_DIM: usize = 256;

/// Largest head dim of the CPU-driver family's fused backward on GPU (non-CPU) adapters (the GPU family
/// takes every head dim). Its dK/dV kernel keeps four
/// keys' k, v, dK and dV rows per invocation (`16 * 2 * (Dk + Dv)` bytes): at 192 (12 KiB) the NVIDIA
/// Vulkan driver runs it, at 256 (16 KiB) it loses the device (measured on an H100, driver 580).
pub const MAX_FUSED_BACKWARD_HEAD_DIM_GPU: usize = 192;
/// Storage buffers the fused backward kernels bind in one dispatch (dK/dV: sequence lengths, score
/// bias, Q, K, V, dO, stats, dK, dV; dQ: the same with dQ and the relative table's row shares), one
/// more than WebGPU's default limit of 8.
pub const FUSED_BACKWARD_STORAGE_BUFFERS: u32 = 9;

/// Refuses devices created with fewer storage buffers per stage than the backward binds (wgpu would
/// raise a validation error when the pipeline is created).
fn check_storage_buffer_limit(ctx: &Context) -> Result<()> {
    let have = ctx.limits().max_storage_buffers_per_shader_stage;
    if have < FUSED_BACKWARD_STORAGE_BUFFERS {
        return Err(Error::shape(
            "device limits",
            format!(
                "max_storage_buffers_per_shader_stage is {have}, but the fused attention backward binds {FUSED_BACKWARD_STORAGE_BUFFERS} storage buffers per dispatch; request the adapter's limit (adapter.limits()) when creating the device"
            ),
        ));
    }
    Ok(())
}

/// Largest key tile of the forward kernel (`MAX_BN` in the shader).
const MAX_BLOCK_N: u32 = 64;

/// Every attention shader with the common header prepended, by name: what the pipelines compile and
/// what the naga tests validate and translate.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    [
        ("attention_forward", FORWARD),
        ("attention_forward_merge", tiled::FORWARD_MERGE),
        ("attention_backward_dkdv_tiled", tiled::BACKWARD_DKDV),
        ("attention_backward_dq_tiled", tiled::BACKWARD_DQ),
        ("attention_backward_preprocess", BACKWARD_PREPROCESS),
        ("attention_backward_dq", BACKWARD_DQ),
        ("attention_backward_dkdv", BACKWARD_DKDV),
        ("attention_softmax", SOFTMAX),
        ("attention_softmax_backward", SOFTMAX_BACKWARD),
        ("attention_sinks", sinks::FORWARD),
        ("attention_sinks_backward", sinks::BACKWARD),
        ("attention_bias_backward", bias::BACKWARD),
        ("attention_probs", probs::SOURCE),
        ("attention_decode", decode::SOURCE),
        ("additive_param_grads", additive::PARAM_GRADS),
        ("additive_scores", additive::SCORES),
        ("additive_backward_unfused", additive::BACKWARD_UNFUSED),
    ]
    .into_iter()
    .map(|(name, body)| (name, with_common(body)))
    .chain([
        (
            "additive_forward",
            with_common(&additive::with_shared(additive::FORWARD)),
        ),
        (
            "additive_backward_da",
            with_common(&additive::with_shared(additive::BACKWARD_DA)),
        ),
        (
            "additive_backward_db",
            with_common(&additive::with_shared(additive::BACKWARD_DB)),
        ),
        ("attention_qk_norm", qk_norm::SOURCE.to_string()),
    ])
    // The tiled forward with either row-group maximum, in f32 and f16 (names with "subgroup": no
    // GLSL, wgpu's GL back end has no subgroups).
    .chain(
        [
            ("attention_forward_tiled", false, DType::F32, DType::F32),
            (
                "attention_forward_tiled_subgroup",
                true,
                DType::F32,
                DType::F32,
            ),
            ("attention_forward_tiled_f16", false, DType::F16, DType::F16),
            (
                "attention_forward_tiled_subgroup_f16",
                true,
                DType::F16,
                DType::F16,
            ),
            (
                "attention_forward_tiled_f16_split",
                false,
                DType::F16,
                DType::F32,
            ),
            (
                "attention_forward_tiled_subgroup_f16_split",
                true,
                DType::F16,
                DType::F32,
            ),
        ]
        .into_iter()
        .map(|(name, subgroups, input, output)| {
            let source = tiled::forward_source(subgroups);
            (name, with_common_typed(&source, input, output))
        }),
    )
    // Every GEMM variant (the unfused attention's, and the Linear layer's).
    .chain(matmul::shader_sources())
    // The f16 variants of the GPU family (names ending in _f16: no GLSL, GL has no f16).
    .chain(
        [
            (
                "attention_backward_dkdv_tiled_f16",
                tiled::BACKWARD_DKDV,
                DType::F16,
            ),
            (
                "attention_backward_dq_tiled_f16",
                tiled::BACKWARD_DQ,
                DType::F16,
            ),
        ]
        .into_iter()
        .map(|(name, body, output)| (name, with_common_typed(body, DType::F16, output)))
        .chain([
            (
                "attention_forward_merge_f16",
                with_common_typed(tiled::FORWARD_MERGE, DType::F32, DType::F16),
            ),
            (
                "attention_backward_preprocess_f16",
                with_common_typed(BACKWARD_PREPROCESS, DType::F16, DType::F32),
            ),
        ]),
    )
    .collect()
}

fn with_common(body: &str) -> String {
    with_common_typed(body, DType::F32, DType::F32)
}

/// `body` with the common header, reading its inputs as `InElem` = `input` and writing its outputs as
/// `OutElem` = `output` (the typed kernels of the GPU family: f16 storage, f32 arithmetic).
fn with_common_typed(body: &str, input: DType, output: DType) -> String {
    let enable = match input == DType::F16 || output == DType::F16 {
        true => "enable f16;\n",
        false => "",
    };
    let (i, o) = (input.name(), output.name());
    format!("{enable}alias InElem = {i};\nalias OutElem = {o};\n{COMMON}\n{body}")
}

/// `body` with the common header and its per-invocation arrays sized for head dims up to `max_dim`
/// (rounded up to whole vec4s) instead of the 256 the validated source declares. Real GPUs back
/// private arrays with registers or per-thread local memory sized by the declaration: 256-entry
/// arrays cost the dK/dV kernel 16 KiB per invocation, which the NVIDIA Vulkan driver fails on
/// (device lost). The pipeline key holds DK and DV, so one key always gets one source.
fn with_common_sized(body: &str, max_dim: usize) -> String {
    const DECLARED: &str = "const MAX_D: u32 = 256u;";
    debug_assert!(body.contains(DECLARED));
    let sized = body.replace(
        DECLARED,
        &format!("const MAX_D: u32 = {}u;", max_dim.div_ceil(4) * 4),
    );
    with_common(&sized)
}

/// Options of an attention call. Built with chained setters so later mask and score features (bias,
/// sliding window, softcap) are new fields, not new functions:
/// `AttentionOptions::new().causal(true).seq_lens(&lens)`.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct AttentionOptions<'a> {
    /// Score scale; `None` is `1 / sqrt(Dk)`.
    pub scale: Option<f32>,
    /// Softmax temperature: the scale is divided by it. `None` is 1.
    pub temperature: Option<f32>,
    /// Causal mask, bottom-right aligned: key j is visible to query i iff `j <= i + (Lk - Lq)`.
    pub causal: bool,
    /// Per-batch valid query and/or key lengths (padding, variable length).
    pub seq_lens: Option<&'a SeqLens>,
    /// Score softcap `cap * tanh(s / cap)` of the scaled score `s` (Gemma 2), before ALiBi and masks.
    pub softcap: Option<f32>,
    /// ALiBi: subtract `slope(h) * |i + (Lk - Lq) - j|` from the scores, with the geometric slopes of
    /// Press et al. (`2^(-8 (h + 1) / H)` for H a power of two) unless `alibi_slopes` are given.
    pub alibi: bool,
    /// Per-query-head ALiBi slopes (at most [`MAX_ALIBI_SLOPES`] heads); implies `alibi`.
    pub alibi_slopes: Option<&'a [f32]>,
    /// Sliding window `(left, right)`: query i sees keys `p - left ..= p + right`, `p = i + Lk - Lq`
    /// its position aligned as the causal mask; composes with causal (which cuts at `p`) and padding.
    /// Key blocks outside every row's window are skipped, so time grows as L x window.
    pub window: Option<(usize, usize)>,
    /// Attention sinks `[H]`: a learnable logit per query head in every row's softmax denominator,
    /// with no value (gpt-oss). Its gradient comes from [`attention_backward`] (`d_sinks`) or
    /// [`attention_sinks_backward_into`].
    pub sinks: Option<&'a GpuTensor>,
    /// Cosine-similarity scores: q and k L2-normalised (eps 1e-6) before the scores, which are then
    /// multiplied by this scale (instead of `scale`; the temperature still divides it).
    pub cosine: Option<f32>,
    /// Cosine scores with a learned per-head scale; see [`AttentionOptions::cosine_learned`].
    pub learned_cosine: Option<LearnedScale<'a>>,
    /// Key-norm clipping: keys whose norm exceeds this are scaled to it before the scores (after
    /// the normalisation of cosine scores, if both).
    pub key_clip: Option<f32>,
    /// Additive score bias `[B or 1, H or 1, Lq, Lk]`, added after softcap and ALiBi; a `-inf` entry
    /// masks its pair. See [`AttentionOptions::bias`].
    pub bias: Option<ScoreBias<'a>>,
    /// T5 relative-position buckets and their `[H, buckets]` table of learned biases.
    pub relative: Option<(RelativeBuckets, &'a GpuTensor)>,
    /// Where the backward writes the relative table's gradient `[H, buckets]` (see
    /// [`AttentionOptions::relative_buckets_learned`]).
    pub relative_grad: Option<&'a GpuTensor>,
}

/// A learned per-head cosine-score scale `[H]` and the tensor its gradient is written to.
#[derive(Clone, Copy, Debug)]
pub struct LearnedScale<'a> {
    pub scale: &'a GpuTensor,
    pub grad: &'a GpuTensor,
}

/// An additive score bias and whether its gradient is wanted.
#[derive(Clone, Copy, Debug)]
pub struct ScoreBias<'a> {
    pub view: &'a BiasView,
    /// False for a constant mask: no `d_bias` is computed.
    pub learnable: bool,
}

impl<'a> AttentionOptions<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    pub fn temperature(mut self, temperature: f32) -> Self {
        self.temperature = Some(temperature);
        self
    }

    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    pub fn seq_lens(mut self, seq_lens: &'a SeqLens) -> Self {
        self.seq_lens = Some(seq_lens);
        self
    }

    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    pub fn alibi(mut self, alibi: bool) -> Self {
        self.alibi = alibi;
        self
    }

    /// ALiBi with the caller's slope per query head (`slopes.len() == H`) instead of the geometric
    /// default.
    pub fn alibi_slopes(mut self, slopes: &'a [f32]) -> Self {
        self.alibi = true;
        self.alibi_slopes = Some(slopes);
        self
    }

    /// Sliding window of `left` keys before and `right` after each query's aligned position
    /// (`window(w - 1, 0)` with `causal(true)`: the last `w` keys, as Mistral and Gemma 2).
    /// Cosine-similarity scores times `scale` (e.g. 10-30: unit vectors' dot products lie in [-1, 1]).
    pub fn cosine(mut self, scale: f32) -> Self {
        self.cosine = Some(scale);
        self
    }

    /// Cosine-similarity scores times a learned scale per query head, read on the GPU from `scale`
    /// (`[H]`, e.g. 10 to 30 at first; Swin V2's logit scale): `s = scale[h] * cos(q, k)`. The
    /// backward writes `dL/dscale` into `grad` (`[H]`), summed over rows in a fixed order.
    pub fn cosine_learned(mut self, scale: &'a GpuTensor, grad: &'a GpuTensor) -> Self {
        self.learned_cosine = Some(LearnedScale { scale, grad });
        self
    }

    /// Scales keys whose L2 norm exceeds `max_norm` down to it before the scores.
    pub fn key_norm_clip(mut self, max_norm: f32) -> Self {
        self.key_clip = Some(max_norm);
        self
    }

    pub fn sinks(mut self, sinks: &'a GpuTensor) -> Self {
        self.sinks = Some(sinks);
        self
    }

    pub fn window(mut self, left: usize, right: usize) -> Self {
        self.window = Some((left, right));
        self
    }

    /// A learnable additive score bias: [`attention_backward`] returns its gradient (`d_bias`,
    /// shaped like the view, summed over its broadcast dimensions in a fixed order);
    /// [`attention_bias_backward_into`] records it.
    pub fn bias(mut self, bias: &'a BiasView) -> Self {
        self.bias = Some(ScoreBias {
            view: bias,
            learnable: true,
        });
        self
    }

    /// A constant additive score bias (an arbitrary mask: `-inf` hides a pair, `0` keeps it):
    /// no gradient is computed for it.
    pub fn constant_bias(mut self, bias: &'a BiasView) -> Self {
        self.bias = Some(ScoreBias {
            view: bias,
            learnable: false,
        });
        self
    }

    /// T5 relative-position bias: `table [H, buckets]` entry of the bucket of `j - (i + Lk - Lq)`
    /// added to each score, computed in the kernels (no `Lq x Lk` tensor). [`attention_backward`]
    /// returns its gradient (`d_relative`); [`attention_backward_into`] computes none (a constant
    /// table) unless [`AttentionOptions::relative_buckets_learned`] names a destination.
    pub fn relative_buckets(mut self, buckets: RelativeBuckets, table: &'a GpuTensor) -> Self {
        self.relative = Some((buckets, table));
        self
    }

    /// [`AttentionOptions::relative_buckets`] with a learned table: the backward's dQ kernels sum
    /// each query row's `p (dP - D)` per bucket as they go, and their row shares are added per
    /// (head, bucket) in a fixed order into `grad` (`[H, buckets]`).
    pub fn relative_buckets_learned(
        mut self,
        buckets: RelativeBuckets,
        table: &'a GpuTensor,
        grad: &'a GpuTensor,
    ) -> Self {
        self.relative = Some((buckets, table));
        self.relative_grad = Some(grad);
        self
    }

    /// Whether a score modifier is set (the unfused path has none).
    fn has_score_modifier(&self) -> bool {
        self.softcap.is_some()
            || self.bias.is_some()
            || self.relative.is_some()
            || self.alibi
            || self.sinks.is_some()
            || self.cosine.is_some()
            || self.learned_cosine.is_some()
            || self.key_clip.is_some()
    }
}

/// The sizes of one attention problem, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub batch: usize,
    pub q_seq: usize,
    pub kv_seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim_qk: usize,
    pub head_dim_v: usize,
}

impl AttentionShape {
    /// Checks that `q [B, Lq, H, Dk]`, `k [B, Lk, Hkv, Dk]` and `v [B, Lk, Hkv, Dv]` agree.
    pub fn of(q: &HeadsView, k: &HeadsView, v: &HeadsView) -> Result<Self> {
        let [b, lq, h, dk] = q.shape();
        let [kb, lk, hkv, kdk] = k.shape();
        let [vb, vlk, vhkv, dv] = v.shape();
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

    /// Multiply-adds counted as 2 FLOPs: `4 * B * H * Lq * Lk * D` for the forward (two products);
    /// halved under the causal mask when `Lq == Lk`, as is customary.
    pub fn forward_flops(&self, causal: bool) -> f64 {
        let d = (self.head_dim_qk + self.head_dim_v) as f64 / 2.0;
        let full =
            4.0 * (self.batch * self.heads) as f64 * self.q_seq as f64 * self.kv_seq as f64 * d;
        if causal {
            full / 2.0
        } else {
            full
        }
    }

    /// Backward FLOPs: five products (S recompute, dV, dP, dQ, dK), 2.5x the forward.
    pub fn backward_flops(&self, causal: bool) -> f64 {
        2.5 * self.forward_flops(causal)
    }
}

fn check_options(shape: &AttentionShape, opts: &AttentionOptions<'_>) -> Result<f32> {
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
        if learned.grad.buffer() == learned.scale.buffer() {
            return Err(Error::shape(
                "cosine scale grad",
                "shares a buffer with the scale; write the gradient to a separate tensor",
            ));
        }
    }
    bias::check(shape, opts)?;
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

/// Checks an f32 view's shape: every attention op but the fused forward and backward takes f32.
fn check_view(arg: &'static str, view: &HeadsView, expected: [usize; 4]) -> Result<()> {
    check_f32(&[(arg, view)])?;
    check_view_typed(arg, view, expected)
}

/// Checks a view's shape, whatever its element type.
fn check_view_typed(arg: &'static str, view: &HeadsView, expected: [usize; 4]) -> Result<()> {
    if view.shape() != expected {
        return Err(Error::shape(
            arg,
            format!("has shape {:?}, expected {:?}", view.shape(), expected),
        ));
    }
    Ok(())
}

fn check_tensor(arg: &'static str, t: &GpuTensor, expected: &[usize]) -> Result<()> {
    if t.shape() != expected {
        return Err(Error::shape(
            arg,
            format!("has shape {:?}, expected {:?}", t.shape(), expected),
        ));
    }
    Ok(())
}

/// Refuses f16 views in the ops that take only f32.
pub(crate) fn check_f32(views: &[(&'static str, &HeadsView)]) -> Result<()> {
    for &(arg, view) in views {
        if view.dtype() != DType::F32 {
            return Err(Error::DType {
                arg,
                found: view.dtype().name(),
                message: "this operation takes f32 views; f16 runs in the fused \
                          attention_forward_into and attention_backward_into"
                    .into(),
            });
        }
    }
    Ok(())
}

/// The element type every view of a fused forward or backward shares. f16 needs `SHADER_F16` and
/// excludes the options whose kernels read or write Q, K, V or O in f32 (sinks, cosine scores, key
/// clipping).
fn common_dtype(
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
        if !ctx.device().features().contains(wgpu::Features::SHADER_F16) {
            return Err(Error::MissingFeature {
                what: "f16 attention",
                feature: "SHADER_F16",
                adapter: ctx.report().name.clone(),
                hint: "; the GL back end has none: use f32 tensors (GpuTensor) there",
            });
        }
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

/// Outputs may not share a buffer with any input of the same dispatch (a buffer cannot be read-only
/// and writable in one dispatch).
fn check_distinct(
    outputs: &[(&'static str, &wgpu::Buffer)],
    inputs: &[&wgpu::Buffer],
) -> Result<()> {
    for (arg, out) in outputs {
        if inputs.contains(out) {
            return Err(Error::shape(
                arg,
                "shares a buffer with an input of the same call; write outputs to a separate buffer",
            ));
        }
    }
    Ok(())
}

/// A buffer range bound for one dispatch and the element offset of the view inside it.
#[derive(Clone, Copy)]
struct Binding<'a> {
    buffer: &'a wgpu::Buffer,
    offset_bytes: u64,
    size_bytes: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct ViewParams {
    offset: u32,
    stride_b: u32,
    stride_s: u32,
    stride_h: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    batch: u32,
    heads: u32,
    kv_heads: u32,
    q_seq: u32,
    kv_seq: u32,
    dk: u32,
    dv: u32,
    flags: u32,
    scale: f32,
    blocks: u32,
    grid_x: u32,
    total_groups: u32,
    chunk_begin: u32,
    chunk_end: u32,
    accumulate: u32,
    splits: u32,
    softcap: f32,
    window_left: u32,
    window_right: u32,
    bias_offset: u32,
    bias_strides: [u32; 4],
    bias_batch: u32,
    bias_heads: u32,
    rel_buckets: u32,
    rel_exact: u32,
    rel_threshold_vec4s: u32,
    rel_table_stride: u32,
    split_keys: u32,
    pad: u32,
    rel_thresholds: [[u32; 4]; MAX_REL_THRESHOLDS / 4],
    alibi_slopes: [[f32; 4]; MAX_ALIBI_SLOPES / 4],
    views: [ViewParams; 8],
}

const VIEW_Q: usize = 0;
const VIEW_K: usize = 1;
const VIEW_V: usize = 2;
const VIEW_O: usize = 3;
const VIEW_DO: usize = 4;
const VIEW_DQ: usize = 5;
const VIEW_DK: usize = 6;
const VIEW_DV: usize = 7;

const FLAG_CAUSAL: u32 = 1;
const FLAG_Q_LENS: u32 = 2;
const FLAG_KV_LENS: u32 = 4;
const FLAG_SOFTCAP: u32 = 8;
const FLAG_ALIBI: u32 = 16;
const FLAG_WINDOW: u32 = 32;
const FLAG_BIAS: u32 = 64;
const FLAG_RELATIVE: u32 = 128;
const FLAG_REL_BIDIRECTIONAL: u32 = 256;
const FLAG_ALIBI_SLOPES: u32 = 512;
const FLAG_ALIGN_LENS: u32 = 1024;
/// Query heads whose ALiBi slopes the parameter block can hold ([`AttentionOptions::alibi_slopes`]).
pub const MAX_ALIBI_SLOPES: usize = 64;

/// Binding of the score bias or relative table in every kernel that calls `modify_scores`.
const SCORE_BIAS_BINDING: u32 = 15;
/// Thresholds of log-spaced relative-position buckets the parameter block holds.
const MAX_REL_THRESHOLDS: usize = 32;

/// Binds the smallest aligned range of `view`'s buffer that covers it and records its strides.
/// The shader's addressing of `view` in a binding that starts at element `binding_start` of its
/// buffer: offset and strides in elements, each within u32.
fn view_params(arg: &'static str, view: &HeadsView, binding_start: usize) -> Result<ViewParams> {
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

fn bind_view<'a>(
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
    Ok(Binding {
        buffer: view.buffer(),
        offset_bytes,
        size_bytes,
    })
}

fn bind_tensor<'a>(ctx: &Context, arg: &'static str, t: &'a GpuTensor) -> Result<Binding<'a>> {
    let size_bytes = t.size_bytes().max(4);
    check_binding(ctx, arg, size_bytes)?;
    Ok(Binding {
        buffer: t.buffer(),
        offset_bytes: 0,
        size_bytes,
    })
}

/// The inputs every backward kernel of both families binds, from binding 2 on: Q, K, V, dO and the
/// (lse, D) stats; the kernel's outputs follow.
fn bind_backward_inputs<'a>(
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

pub(crate) fn check_binding(ctx: &Context, arg: &'static str, bytes: u64) -> Result<()> {
    let limit = ctx.limits().max_storage_buffer_binding_size;
    if bytes > limit {
        return Err(Error::BindingTooLarge { arg, bytes, limit });
    }
    Ok(())
}

/// Rows of Q (forward, dQ) or keys (dK/dV) one invocation owns: one per vec4 lane.
const ROWS: u32 = 4;

/// Invocations per workgroup of the one-row-per-invocation kernels (preprocess, unfused softmax).
const SIMPLE_WG: u32 = 64;

/// Invocations per workgroup of the fused kernels, so a workgroup owns `ROWS * WG` rows (queries in
/// the forward and dQ, keys in dK/dV). Wide workgroups amortise each staged tile over more rows;
/// narrow ones put more workgroups in flight. Measured on an H100 (Vulkan, B1 H8 D64, L 512..4096,
/// BENCHMARKS.md): the forward is fastest at 64 (L=4096: 17.4 ms vs 35.0 at 32 and 78.5 at 16), the
/// backward at 32 (L=2048: 26.8 ms vs 37.4 at 64 and 57.6 at 16). CPU drivers run a workgroup as SIMD
/// loops and prefer 64 everywhere. [`Context::set_attention_workgroup`] (or `WGPU_ATTENTION_WORKGROUP`,
/// read when the context is created) overrides both, for tuning on other adapters.
fn workgroup_size(ctx: &Context, backward: bool) -> u32 {
    match ctx.attention_workgroup() {
        Some(wg) => wg,
        None if backward && !ctx.is_cpu() => 32,
        None => 64,
    }
}

/// Rows of a staged tile that fit the adapter's workgroup storage.
fn tile_rows(ctx: &Context, shape: &AttentionShape, extra_bytes_per_row: u32, max: u32) -> u32 {
    let dk4 = shape.head_dim_qk.div_ceil(4) as u32;
    let dv4 = shape.head_dim_v.div_ceil(4) as u32;
    let per_row = (dk4 + dv4) * 16 + extra_bytes_per_row;
    (ctx.limits().max_compute_workgroup_storage_size / per_row).clamp(1, max)
}

fn base_params(shape: &AttentionShape, scale: f32, opts: &AttentionOptions<'_>) -> Params {
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
    bias::fill_params(&mut params, opts);
    params
}

/// Sets the 2-D grid for `blocks` workgroups per (batch, head) group of `groups`.
fn set_grid(params: &mut Params, blocks: usize, groups: usize) -> Result<(u32, u32)> {
    let total = blocks as u64 * groups as u64;
    let max = 65535u64 * 65535u64;
    if total > max {
        return Err(Error::Unsupported {
            arg: "workgroups (batch * heads * sequence blocks)",
            value: total,
            limit: max,
            hint: "; split the batch",
        });
    }
    params.blocks = blocks as u32;
    params.total_groups = total as u32;
    let (gx, gy) = grid_2d(total as u32);
    params.grid_x = gx;
    Ok((gx, gy))
}

/// The buffer bound as `seq_lens`: the caller's, or the context's empty one (bindings cannot be absent).
fn seq_lens_buffer<'a>(ctx: &'a Context, opts: &AttentionOptions<'a>) -> &'a wgpu::Buffer {
    opts.seq_lens.map_or(ctx.empty_storage(), SeqLens::buffer)
}

/// The storage a kernel binds besides its own tensors: the sequence lengths at binding 1 (kernels
/// that read them) and the score bias at [`SCORE_BIAS_BINDING`] (kernels that call `modify_scores`).
#[derive(Clone, Copy, Default)]
struct Shared<'a> {
    seq_lens: Option<&'a wgpu::Buffer>,
    score_bias: Option<Binding<'a>>,
}

impl<'a> Shared<'a> {
    const NONE: Shared<'static> = Shared {
        seq_lens: None,
        score_bias: None,
    };

    fn lens(seq_lens: &'a wgpu::Buffer) -> Self {
        Shared {
            seq_lens: Some(seq_lens),
            score_bias: None,
        }
    }

    /// What a score kernel binds: the sequence lengths and the bias tensor, the relative table or a
    /// dummy.
    fn scores(ctx: &'a Context, opts: &AttentionOptions<'a>) -> Result<Self> {
        Ok(Shared {
            seq_lens: Some(seq_lens_buffer(ctx, opts)),
            score_bias: Some(bias::score_bias_binding(ctx, opts)?),
        })
    }
}

/// Records one attention-family kernel: its cached pipeline, the parameter block at binding 0, the
/// sequence lengths at binding 1 (for kernels that read them) and `bindings` from binding 2 on.
#[allow(clippy::too_many_arguments)]
fn encode_kernel(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    name: &'static str,
    source: impl FnOnce() -> String,
    constants: &[(&'static str, u32)],
    params: &Params,
    shared: Shared<'_>,
    bindings: &[Binding<'_>],
    grid: (u32, u32),
) {
    let pipeline = ctx.pipeline(name, source, constants);
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
    let bind_group = ctx.bind_group(&pipeline, name, bytemuck::bytes_of(params), &storage);
    pass.set_pipeline(&pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(grid.0, grid.1, 1);
}

/// Records one dispatch of a kernel per loop chunk (`[begin, end)` ranges from [`loop_chunks`]);
/// every chunk after the first adds to what the earlier ones wrote.
#[allow(clippy::too_many_arguments)]
fn encode_chunks(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    name: &'static str,
    source: impl Fn() -> String,
    constants: &[(&'static str, u32)],
    params: &mut Params,
    shared: Shared<'_>,
    bindings: &[Binding<'_>],
    grid: (u32, u32),
    chunks: &[(u32, u32)],
) {
    for (index, &(begin, end)) in chunks.iter().enumerate() {
        params.chunk_begin = begin;
        params.chunk_end = end;
        params.accumulate = (index > 0) as u32;
        encode_kernel(
            ctx, pass, name, &source, constants, params, shared, bindings, grid,
        );
    }
}

/// O and lse of a forward pass: `out [B, Lq, H, Dv]`, `lse [B, H, Lq]` (`-inf` for rows that see no
/// key). Both are what [`attention_backward`] needs.
#[derive(Clone, Debug)]
pub struct AttentionOutput {
    pub out: GpuTensor,
    pub lse: GpuTensor,
}

impl AttentionOutput {
    /// New, uninitialised `out [B, Lq, H, Dv]` and `lse [B, H, Lq]` for `s`.
    fn new(ctx: &Context, s: &AttentionShape) -> Result<Self> {
        Ok(Self {
            out: GpuTensor::uninit(
                ctx,
                "attention out",
                &[s.batch, s.q_seq, s.heads, s.head_dim_v],
            )?,
            lse: GpuTensor::uninit(ctx, "attention lse", &[s.batch, s.heads, s.q_seq])?,
        })
    }

    /// The one-shot form of a forward-like `_into` call: new outputs for `s`, filled by `record`
    /// and submitted.
    fn recorded(
        ctx: &Context,
        s: &AttentionShape,
        record: impl FnOnce(&mut wgpu::CommandEncoder, &HeadsView, &GpuTensor) -> Result<()>,
    ) -> Result<Self> {
        let output = Self::new(ctx, s)?;
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        record(&mut encoder, &output.out.heads()?, &output.lse)?;
        ctx.submit(encoder)?;
        Ok(output)
    }
}

/// Checks a forward's outputs: `out [B, Lq, H, Dv]`, `lse [B, H, Lq]`, neither sharing a buffer with
/// an input of the call (`inputs`) nor with the other.
fn check_forward_outputs(
    s: &AttentionShape,
    out: &HeadsView,
    lse: &GpuTensor,
    inputs: &[&wgpu::Buffer],
) -> Result<()> {
    check_view_typed("out", out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    check_tensor("lse", lse, &[s.batch, s.heads, s.q_seq])?;
    check_distinct(&[("out", out.buffer()), ("lse", lse.buffer())], inputs)?;
    if out.buffer() == lse.buffer() {
        return Err(Error::shape("lse", "shares a buffer with out"));
    }
    Ok(())
}

/// Checks `rows` is a non-empty range of the `q_seq` query rows (attention maps).
fn check_rows(rows: &std::ops::Range<usize>, q_seq: usize) -> Result<()> {
    if rows.start >= rows.end || rows.end > q_seq {
        return Err(Error::shape(
            "rows",
            format!("{rows:?} is not a non-empty range of the {q_seq} query rows"),
        ));
    }
    Ok(())
}

/// dQ, dK, dV of a backward pass, shaped like Q, K, V; `d_sinks [H]` when the options have sinks;
/// `d_bias` (shaped like the bias view) for a learnable bias; `d_relative [H, buckets]` with
/// relative buckets whose options name no destination (`relative_buckets_learned` writes there).
#[derive(Clone, Debug)]
pub struct AttentionGrads {
    pub dq: GpuTensor,
    pub dk: GpuTensor,
    pub dv: GpuTensor,
    pub d_sinks: Option<GpuTensor>,
    pub d_bias: Option<GpuTensor>,
    pub d_relative: Option<GpuTensor>,
}

/// The allocating forms make f32 outputs: point f16 callers at the `_into` forms.
fn allocating_f16(e: Error) -> Error {
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
    AttentionOutput::recorded(ctx, &s, |encoder, out, lse| {
        attention_forward_into(ctx, encoder, q, k, v, out, lse, opts)
    })
}

/// Records the fused attention forward into `encoder`, writing `out` (a `[B, Lq, H, Dv]` view) and
/// `lse` (`[B, H, Lq]`). Nothing is recorded if the input is rejected.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    out: &HeadsView,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(&s, opts)?;
    let views = [("q", q), ("k", k), ("v", v), ("out", out)];
    let dtype = common_dtype(ctx, &views, opts)?;
    check_forward_outputs(&s, out, lse, &[q.buffer(), k.buffer(), v.buffer()])?;
    if let Some(sinks) = opts.sinks {
        check_distinct(
            &[("out", out.buffer()), ("lse", lse.buffer())],
            &[sinks.buffer()],
        )?;
    }
    // Cosine scores and key clipping: the kernels read transformed copies of Q and K.
    let (q, k) = qk_norm::encode_inputs(ctx, encoder, q, k, opts)?;
    // f16 runs the GPU family on every adapter (the CPU-driver kernels are f32 only).
    if ctx.kernel_family() == KernelFamily::Gpu || dtype == DType::F16 {
        encode_forward_tiled(ctx, encoder, &s, scale, &q, &k, v, out, lse, opts)?;
    } else {
        encode_forward_cpu_family(ctx, encoder, &s, scale, &q, &k, v, out, lse, opts)?;
    }
    match opts.sinks {
        Some(sinks) => sinks::encode_forward(ctx, encoder, &s, scale, out, lse, sinks, opts),
        None => Ok(()),
    }
}

/// The CPU-driver family's forward: one dispatch per key chunk, each merging into O and lse.
#[allow(clippy::too_many_arguments)]
fn encode_forward_cpu_family(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    s: &AttentionShape,
    scale: f32,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    out: &HeadsView,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let block_n = tile_rows(ctx, s, 0, MAX_BLOCK_N);
    let mut params = base_params(s, scale, opts);
    let bindings = [
        bind_view(ctx, "q", q, VIEW_Q, &mut params)?,
        bind_view(ctx, "k", k, VIEW_K, &mut params)?,
        bind_view(ctx, "v", v, VIEW_V, &mut params)?,
        bind_view(ctx, "out", out, VIEW_O, &mut params)?,
        bind_tensor(ctx, "lse", lse)?,
    ];
    let wg = workgroup_size(ctx, false);
    let blocks = s.q_seq.div_ceil((wg * ROWS) as usize);
    let grid = set_grid(&mut params, blocks, s.batch * s.heads)?;
    let chunks = forward_chunks(ctx, s, block_n);
    let mut pass = ctx.begin_pass(encoder, "attention_forward");
    let shared = Shared::scores(ctx, opts)?;
    encode_chunks(
        ctx,
        &mut pass,
        "attention_forward",
        || with_common_sized(FORWARD, s.head_dim_qk.max(s.head_dim_v)),
        &[
            ("WG", wg),
            ("BLOCK_N", block_n),
            ("DK", s.head_dim_qk as u32),
            ("DV", s.head_dim_v as u32),
        ],
        &mut params,
        shared,
        &bindings,
        grid,
        &chunks,
    );
    Ok(())
}

/// How the fused forward runs a problem on a context: what [`attention_forward_into`] records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardPlan {
    pub family: KernelFamily,
    /// Invocations per workgroup.
    pub workgroup: u32,
    /// Query rows per workgroup.
    pub block_m: u32,
    /// Keys per staged K/V tile.
    pub block_n: u32,
    /// Pieces of each row's key range: split-KV workgroups merged by a second kernel (GPU family),
    /// or chunk dispatches under a driver's loop cap (CPU-driver family). 1 is one pass over the keys.
    pub splits: u32,
    /// Row maxima combined by subgroup shuffles rather than through workgroup memory (GPU family,
    /// where [`Context::subgroup_size`] allows).
    pub subgroups: bool,
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
        if self.splits > 1 {
            write!(f, " split {}", self.splits)?;
        }
        Ok(())
    }
}

/// The kernel family, tile shape and key split the fused forward uses for `shape` on `ctx`.
pub fn attention_forward_plan(ctx: &Context, shape: &AttentionShape) -> Result<ForwardPlan> {
    let s = shape;
    if ctx.kernel_family() == KernelFamily::Gpu {
        let config = TiledForward::choose(ctx, s)?;
        return Ok(ForwardPlan {
            family: KernelFamily::Gpu,
            workgroup: config.wg,
            block_m: config.block_m,
            block_n: config.block_n,
            splits: config.splits(ctx, s) as u32,
            subgroups: config.subgroups(ctx, s),
        });
    }
    let block_n = tile_rows(ctx, s, 0, MAX_BLOCK_N);
    let wg = workgroup_size(ctx, false);
    Ok(ForwardPlan {
        family: KernelFamily::CpuDriver,
        workgroup: wg,
        block_m: wg * ROWS,
        block_n,
        splits: forward_chunks(ctx, s, block_n).len() as u32,
        subgroups: false,
    })
}

/// Key chunks of the CPU-driver forward under the loop budget (one chunk elsewhere).
fn forward_chunks(ctx: &Context, s: &AttentionShape, block_n: u32) -> Vec<(u32, u32)> {
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

/// Fused attention backward into new tensors, submitted to the queue. `out` and `lse` are the
/// forward's outputs for the same inputs and options.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    ctx: &Context,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    forward: &AttentionOutput,
    d_out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionGrads> {
    let s = AttentionShape::of(q, k, v)?;
    check_f32(&[("q", q), ("k", k), ("v", v), ("d_out", d_out)]).map_err(allocating_f16)?;
    let dq = GpuTensor::uninit(ctx, "dq", &[s.batch, s.q_seq, s.heads, s.head_dim_qk])?;
    let dk = GpuTensor::uninit(ctx, "dk", &[s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk])?;
    let dv = GpuTensor::uninit(ctx, "dv", &[s.batch, s.kv_seq, s.kv_heads, s.head_dim_v])?;
    let workspace = attention_backward_workspace(ctx, &s)?;
    // The relative table's gradient, unless the caller named a destination.
    let d_relative = match (opts.relative, opts.relative_grad) {
        (Some((buckets, _)), None) => Some(GpuTensor::uninit(
            ctx,
            "d_relative",
            &[s.heads, buckets.buckets],
        )?),
        _ => None,
    };
    let mut with_grad = *opts;
    if let Some(grad) = &d_relative {
        with_grad.relative_grad = Some(grad);
    }
    let opts = &with_grad;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    attention_backward_into(
        ctx,
        &mut encoder,
        q,
        k,
        v,
        &forward.out.heads()?,
        &forward.lse,
        d_out,
        &dq.heads()?,
        &dk.heads()?,
        &dv.heads()?,
        &workspace,
        opts,
    )?;
    let d_sinks = match opts.sinks {
        Some(sinks) => {
            let d_sinks = GpuTensor::uninit(ctx, "d_sinks", &[s.heads])?;
            attention_sinks_backward_into(
                ctx,
                &mut encoder,
                &s,
                sinks,
                &workspace,
                &d_sinks,
                opts,
            )?;
            Some(d_sinks)
        }
        None => None,
    };
    let d_bias = match opts.bias {
        Some(bias) if bias.learnable => {
            let grad = GpuTensor::uninit(ctx, "d_bias", &bias.view.shape())?;
            attention_bias_backward_into(
                ctx,
                &mut encoder,
                q,
                k,
                v,
                d_out,
                &workspace,
                &grad,
                opts,
            )?;
            Some(grad)
        }
        _ => None,
    };
    ctx.submit(encoder)?;
    Ok(AttentionGrads {
        dq,
        dk,
        dv,
        d_sinks,
        d_bias,
        d_relative,
    })
}

/// The scratch tensor [`attention_backward_into`] needs: `(lse, D)` per query row, `[B, H, Lq, 2]`.
pub fn attention_backward_workspace(ctx: &Context, shape: &AttentionShape) -> Result<GpuTensor> {
    GpuTensor::uninit(
        ctx,
        "attention backward stats",
        &[shape.batch, shape.heads, shape.q_seq, 2],
    )
}

/// Records the fused attention backward into `encoder`: the `D = rowsum(dO * O)` pass, the dK/dV
/// kernel (parallel over key blocks) and the dQ kernel (parallel over query blocks). No atomics, so
/// results are bitwise reproducible. `dq`, `dk`, `dv` may be views into one packed gradient buffer.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    out: &HeadsView,
    lse: &GpuTensor,
    d_out: &HeadsView,
    dq: &HeadsView,
    dk: &HeadsView,
    dv: &HeadsView,
    workspace: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    if !qk_norm::active(opts) {
        return encode_backward_core(
            ctx, encoder, q, k, v, out, lse, d_out, dq, dk, dv, workspace, opts,
        );
    }
    // Cosine scores and key clipping: the backward of the transformed Q and K, then dQ and dK
    // through the transforms, in place (which reads Q and K: they may not share the gradients'
    // buffers).
    let s = AttentionShape::of(q, k, v)?;
    check_options(&s, opts)?;
    check_distinct(
        &[("dq", dq.buffer()), ("dk", dk.buffer())],
        &[q.buffer().as_ref(), k.buffer()],
    )?;
    let (q_used, k_used) = qk_norm::encode_inputs(ctx, encoder, q, k, opts)?;
    encode_backward_core(
        ctx, encoder, &q_used, &k_used, v, out, lse, d_out, dq, dk, dv, workspace, opts,
    )?;
    qk_norm::encode_backward(ctx, encoder, [q, k], [dq, dk], opts)
}

/// [`attention_backward_into`] of the Q and K the scores are made of.
#[allow(clippy::too_many_arguments)]
fn encode_backward_core(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    out: &HeadsView,
    lse: &GpuTensor,
    d_out: &HeadsView,
    dq: &HeadsView,
    dk: &HeadsView,
    dv: &HeadsView,
    workspace: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(&s, opts)?;
    check_storage_buffer_limit(ctx)?;
    let views = [
        ("q", q),
        ("k", k),
        ("v", v),
        ("out", out),
        ("d_out", d_out),
        ("dq", dq),
        ("dk", dk),
        ("dv", dv),
    ];
    let dtype = common_dtype(ctx, &views, opts)?;
    check_view_typed("out", out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    check_view_typed("d_out", d_out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    check_tensor("lse", lse, &[s.batch, s.heads, s.q_seq])?;
    check_tensor("workspace", workspace, &[s.batch, s.heads, s.q_seq, 2])?;
    check_view_typed("dq", dq, [s.batch, s.q_seq, s.heads, s.head_dim_qk])?;
    check_view_typed("dk", dk, [s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk])?;
    check_view_typed("dv", dv, [s.batch, s.kv_seq, s.kv_heads, s.head_dim_v])?;
    let widest = s.head_dim_qk.max(s.head_dim_v);
    // f16 runs the GPU family on every adapter (the CPU-driver kernels are f32 only).
    let family = match dtype {
        DType::F16 => KernelFamily::Gpu,
        DType::F32 => ctx.kernel_family(),
    };
    if family == KernelFamily::CpuDriver
        && !ctx.is_cpu()
        && widest > MAX_FUSED_BACKWARD_HEAD_DIM_GPU
    {
        return Err(Error::Unsupported {
            arg: "head_dim (fused backward on a GPU adapter)",
            value: widest as u64,
            limit: MAX_FUSED_BACKWARD_HEAD_DIM_GPU as u64,
            hint: "; use the GPU kernel family (Context::set_kernel_family), attention_backward_unfused, or split the head dimension",
        });
    }
    let inputs = [
        q.buffer().as_ref(),
        k.buffer(),
        v.buffer(),
        out.buffer(),
        lse.buffer(),
        d_out.buffer(),
    ];
    check_distinct(
        &[
            ("dq", dq.buffer()),
            ("dk", dk.buffer()),
            ("dv", dv.buffer()),
            ("workspace", workspace.buffer()),
        ],
        &inputs,
    )?;
    if workspace.buffer() == dq.buffer()
        || workspace.buffer() == dk.buffer()
        || workspace.buffer() == dv.buffer()
    {
        return Err(Error::shape(
            "workspace",
            "shares a buffer with a gradient output",
        ));
    }

    // The dK/dV loop runs over (query head of the group, query row), flattened.
    let group_rows = (s.heads / s.kv_heads)
        .checked_mul(s.q_seq)
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or(Error::Unsupported {
            arg: "q seq * (heads / kv_heads)",
            value: ((s.heads / s.kv_heads) as u64).saturating_mul(s.q_seq as u64),
            limit: u32::MAX as u64,
            hint: "; split the sequence",
        })?;
    let lens = seq_lens_buffer(ctx, opts);
    let shared = Shared::scores(ctx, opts)?;
    let wg = workgroup_size(ctx, true);
    let dims = [("DK", s.head_dim_qk as u32), ("DV", s.head_dim_v as u32)];
    let (dk4, dv4) = (s.head_dim_qk.div_ceil(4), s.head_dim_v.div_ceil(4));
    // One pass per kernel, so a profile tells the three apart.
    // 1. stats = (lse, D).
    {
        let mut pass = ctx.begin_pass(encoder, "attention_backward_preprocess");
        let mut params = base_params(&s, scale, opts);
        let bindings = [
            bind_view(ctx, "out", out, VIEW_O, &mut params)?,
            bind_view(ctx, "d_out", d_out, VIEW_DO, &mut params)?,
            bind_tensor(ctx, "lse", lse)?,
            bind_tensor(ctx, "workspace", workspace)?,
        ];
        let rows_total = s.batch * s.heads * s.q_seq;
        let grid = set_grid(&mut params, rows_total.div_ceil(SIMPLE_WG as usize), 1)?;
        encode_kernel(
            ctx,
            &mut pass,
            match dtype {
                DType::F32 => "attention_backward_preprocess",
                DType::F16 => "attention_backward_preprocess_f16",
            },
            || with_common_typed(BACKWARD_PREPROCESS, dtype, DType::F32),
            &[("WG", SIMPLE_WG)],
            &params,
            Shared::lens(lens),
            &bindings,
            grid,
        );
    }
    if family == KernelFamily::Gpu {
        return tiled::encode_backward_tiled(
            ctx,
            encoder,
            &s,
            scale,
            [q, k, v, d_out],
            workspace,
            [dq, dk, dv],
            opts,
            group_rows,
            dtype,
        );
    }
    // 2. dK, dV: one workgroup per key block of one (batch, kv head).
    {
        let mut pass = ctx.begin_pass(encoder, "attention_backward_dkdv");
        let mut params = base_params(&s, scale, opts);
        let mut bindings = bind_backward_inputs(ctx, &mut params, [q, k, v, d_out], workspace)?;
        bindings.push(bind_view(ctx, "dk", dk, VIEW_DK, &mut params)?);
        bindings.push(bind_view(ctx, "dv", dv, VIEW_DV, &mut params)?);
        // Even: the kernel steps two query rows at a time.
        let block_m = (tile_rows(ctx, &s, 8, 64) & !1).max(2);
        let blocks = s.kv_seq.div_ceil((wg * ROWS) as usize);
        let grid = set_grid(&mut params, blocks, s.batch * s.kv_heads)?;
        // Per query row: three loops over the head dimension plus the row loop itself.
        let chunks = loop_chunks(
            ctx,
            group_rows,
            2 * dk4 + dv4 + 8,
            4 * (s.head_dim_qk + s.head_dim_v) + 8 * (dk4 + dv4),
            block_m as usize,
        );
        encode_chunks(
            ctx,
            &mut pass,
            "attention_backward_dkdv",
            || with_common_sized(BACKWARD_DKDV, s.head_dim_qk.max(s.head_dim_v)),
            &[("WG", wg), ("BLOCK_M", block_m), dims[0], dims[1]],
            &mut params,
            shared,
            &bindings,
            grid,
            &chunks,
        );
    }
    // 3. dQ: one workgroup per query block of one (batch, head).
    let rel = bias::RelativeRows::new(ctx, &s, opts)?;
    {
        let mut pass = ctx.begin_pass(encoder, "attention_backward_dq");
        let mut params = base_params(&s, scale, opts);
        let mut bindings = bind_backward_inputs(ctx, &mut params, [q, k, v, d_out], workspace)?;
        bindings.push(bind_view(ctx, "dq", dq, VIEW_DQ, &mut params)?);
        bindings.push(rel.binding());
        // Even: the kernel steps two keys at a time.
        let block_n = (tile_rows(ctx, &s, 0, 64) & !1).max(2);
        let blocks = s.q_seq.div_ceil((wg * ROWS) as usize);
        let grid = set_grid(&mut params, blocks, s.batch * s.heads)?;
        // Per key: three loops over the head dimension plus the key loop itself.
        let chunks = loop_chunks(
            ctx,
            s.kv_seq,
            2 * dk4 + dv4 + 8,
            4 * (2 * s.head_dim_qk + s.head_dim_v) + 8 * (dk4 + dv4),
            block_n as usize,
        );
        encode_chunks(
            ctx,
            &mut pass,
            "attention_backward_dq",
            || {
                rel.sized(&with_common_sized(
                    BACKWARD_DQ,
                    s.head_dim_qk.max(s.head_dim_v),
                ))
            },
            &[
                ("WG", wg),
                ("BLOCK_N", block_n),
                dims[0],
                dims[1],
                rel.constant(),
            ],
            &mut params,
            shared,
            &bindings,
            grid,
            &chunks,
        );
    }
    rel.encode_sums(ctx, encoder, &s, opts);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Unfused baseline: scores materialised as [B, H, Lq, Lk].

/// The unfused backward's steps from P (shared with additive attention's): `dP = dO V^T` into
/// `dprobs`, `dS = P (dP - rowsum(P dP))` in place (the gradient at the scaled scores), and
/// `dV = sum_g P^T dO` over the query heads of each kv head.
#[allow(clippy::too_many_arguments)]
fn encode_unfused_output_grads(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    probs: &GpuTensor,
    dprobs: &GpuTensor,
    v: &HeadsView,
    d_out: &HeadsView,
    dv: &HeadsView,
) -> Result<()> {
    let group = s.heads / s.kv_heads;
    let (b, h, hkv, lq, lk) = (
        s.batch as u32,
        s.heads as u32,
        s.kv_heads as u32,
        s.q_seq,
        s.kv_seq,
    );
    let (p_rows, p_t_grouped) = probs_operands(s);
    encode_gemm(
        ctx,
        pass,
        &Gemm {
            m: lq as u32,
            n: lk as u32,
            k: s.head_dim_v as u32,
            groups: 1,
            batch: b,
            heads: h,
            alpha: 1.0,
            a: (d_out.buffer(), view_operand(d_out, true, 1)),
            b: (v.buffer(), view_operand(v, false, group)),
            c: (dprobs.buffer(), p_rows),
            epilogue: Epilogue::NONE,
            elements: Elements::F32,
        },
    )?;
    let mut params = base_params(s, 1.0, opts);
    let grid = set_grid(&mut params, s.batch * s.heads * lq, 1)?;
    let bindings = [
        bind_tensor(ctx, "probs", probs)?,
        bind_tensor(ctx, "dprobs", dprobs)?,
    ];
    encode_kernel(
        ctx,
        pass,
        "attention_softmax_backward",
        || with_common(SOFTMAX_BACKWARD),
        &[("WG", SIMPLE_WG)],
        &params,
        Shared::NONE,
        &bindings,
        grid,
    );
    encode_gemm(
        ctx,
        pass,
        &Gemm {
            m: lk as u32,
            n: s.head_dim_v as u32,
            k: lq as u32,
            groups: group as u32,
            batch: b,
            heads: hkv,
            alpha: 1.0,
            a: (probs.buffer(), p_t_grouped),
            b: (d_out.buffer(), grouped_operand(d_out, group)),
            c: (dv.buffer(), view_operand(dv, true, 1)),
            epilogue: Epilogue::NONE,
            elements: Elements::F32,
        },
    )
}

/// A BSHD view as the B operand summed over the `group` query heads of each kv head.
fn grouped_operand(view: &HeadsView, group: usize) -> Operand {
    let mut op = view_operand(view, true, 1);
    op.stride_g = op.stride_h;
    op.stride_h *= group as u32;
    op
}

/// Operands over the `[B, H, Lq, Lk]` probabilities: P rows (queries) by columns (keys) per query
/// head, and P^T per kv head summed over the group's query heads.
fn probs_operands(s: &AttentionShape) -> (Operand, Operand) {
    let (h, lq, lk) = (s.heads as u32, s.q_seq as u32, s.kv_seq as u32);
    let group = s.heads / s.kv_heads;
    let plane = lq * lk;
    let p_rows = Operand {
        stride_b: h * plane,
        stride_h: plane,
        head_div: 1,
        stride_row: lk,
        stride_col: 1,
        ..Default::default()
    };
    let p_t_grouped = Operand {
        stride_b: h * plane,
        stride_h: group as u32 * plane,
        head_div: 1,
        stride_g: plane,
        stride_row: 1,
        stride_col: lk,
        ..Default::default()
    };
    (p_rows, p_t_grouped)
}

fn scores_shape(ctx: &Context, s: &AttentionShape) -> Result<[usize; 4]> {
    let shape = [s.batch, s.heads, s.q_seq, s.kv_seq];
    let bytes = shape.iter().map(|&d| d as u64).product::<u64>() * 4;
    check_binding(ctx, "scores (unfused B x H x Lq x Lk)", bytes)?;
    Ok(shape)
}

fn view_operand(view: &HeadsView, rows_are_seq: bool, head_div: usize) -> Operand {
    let [sb, ss, sh] = view.strides();
    let (stride_row, stride_col) = if rows_are_seq { (ss, 1) } else { (1, ss) };
    Operand {
        offset: view.offset() as u32,
        stride_b: sb as u32,
        stride_h: sh as u32,
        head_div: head_div as u32,
        stride_g: 0,
        stride_row: stride_row as u32,
        stride_col: stride_col as u32,
        _pad: 0,
    }
}

fn check_whole_binding(ctx: &Context, arg: &'static str, buffer: &wgpu::Buffer) -> Result<()> {
    check_binding(ctx, arg, buffer.size())
}

/// Records `P = softmax(scale Q K^T + masks)` into `probs [B, H, Lq, Lk]` and the row lse.
#[allow(clippy::too_many_arguments)]
fn encode_probs(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    scale: f32,
    q: &HeadsView,
    k: &HeadsView,
    probs: &GpuTensor,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
    lens: &wgpu::Buffer,
) -> Result<()> {
    let group = s.heads / s.kv_heads;
    let (lq, lk) = (s.q_seq, s.kv_seq);
    let scores_op = Operand {
        stride_b: (s.heads * lq * lk) as u32,
        stride_h: (lq * lk) as u32,
        head_div: 1,
        stride_row: lk as u32,
        stride_col: 1,
        ..Default::default()
    };
    encode_gemm(
        ctx,
        pass,
        &Gemm {
            m: lq as u32,
            n: lk as u32,
            k: s.head_dim_qk as u32,
            groups: 1,
            batch: s.batch as u32,
            heads: s.heads as u32,
            alpha: scale,
            a: (q.buffer(), view_operand(q, true, 1)),
            b: (k.buffer(), view_operand(k, false, group)),
            c: (probs.buffer(), scores_op),
            epilogue: Epilogue::NONE,
            elements: Elements::F32,
        },
    )?;
    encode_softmax(ctx, pass, s, scale, probs, lse, opts, lens)
}

/// Records the masked row softmax of materialised scores `[B, H, Lq, Lk]` in place (P), with lse.
#[allow(clippy::too_many_arguments)]
fn encode_softmax(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    scale: f32,
    probs: &GpuTensor,
    lse: &GpuTensor,
    opts: &AttentionOptions<'_>,
    lens: &wgpu::Buffer,
) -> Result<()> {
    let mut params = base_params(s, scale, opts);
    let rows = s.batch * s.heads * s.q_seq;
    let grid = set_grid(&mut params, rows, 1)?;
    let bindings = [
        bind_tensor(ctx, "scores", probs)?,
        bind_tensor(ctx, "lse", lse)?,
    ];
    encode_kernel(
        ctx,
        pass,
        "attention_softmax",
        || with_common(SOFTMAX),
        &[("WG", SIMPLE_WG)],
        &params,
        Shared::lens(lens),
        &bindings,
        grid,
    );
    Ok(())
}

/// Records `out = P V` for materialised probabilities `[B, H, Lq, Lk]`.
fn encode_pv(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    s: &AttentionShape,
    probs: &GpuTensor,
    v: &HeadsView,
    out: &HeadsView,
) -> Result<()> {
    let group = s.heads / s.kv_heads;
    let (lq, lk) = (s.q_seq, s.kv_seq);
    encode_gemm(
        ctx,
        pass,
        &Gemm {
            m: lq as u32,
            n: s.head_dim_v as u32,
            k: lk as u32,
            groups: 1,
            batch: s.batch as u32,
            heads: s.heads as u32,
            alpha: 1.0,
            a: (
                probs.buffer(),
                Operand {
                    stride_b: (s.heads * lq * lk) as u32,
                    stride_h: (lq * lk) as u32,
                    head_div: 1,
                    stride_row: lk as u32,
                    stride_col: 1,
                    ..Default::default()
                },
            ),
            b: (v.buffer(), view_operand(v, true, group)),
            c: (out.buffer(), view_operand(out, true, 1)),
            epilogue: Epilogue::NONE,
            elements: Elements::F32,
        },
    )
}

fn unfused_checks(ctx: &Context, views: &[(&'static str, &HeadsView)]) -> Result<()> {
    check_f32(views)?;
    for (arg, v) in views {
        check_whole_binding(ctx, arg, v.buffer())?;
        if v.end_element() > u32::MAX as usize {
            return Err(Error::Unsupported {
                arg,
                value: v.end_element() as u64,
                limit: u32::MAX as u64,
                hint: " elements",
            });
        }
    }
    Ok(())
}

/// Unfused attention forward (benchmark baseline and second check): materialises the scores
/// `[B, H, Lq, Lk]`, applies a masked softmax, then multiplies by V. Same semantics and outputs as
/// [`attention_forward`].
pub fn attention_forward_unfused(
    ctx: &Context,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionOutput> {
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(&s, opts)?;
    unfused_modifier_check(opts)?;
    unfused_checks(ctx, &[("q", q), ("k", k), ("v", v)])?;
    let probs = GpuTensor::uninit(ctx, "probs", &scores_shape(ctx, &s)?)?;
    let AttentionOutput { out, lse } = AttentionOutput::new(ctx, &s)?;
    check_whole_binding(ctx, "out", out.buffer())?;
    let lens = seq_lens_buffer(ctx, opts);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "attention_forward_unfused");
        encode_probs(ctx, &mut pass, &s, scale, q, k, &probs, &lse, opts, lens)?;
        encode_pv(ctx, &mut pass, &s, &probs, v, &out.heads()?)?;
    }
    ctx.submit(encoder)?;
    Ok(AttentionOutput { out, lse })
}

/// The unfused baseline has masks but no score modifiers.
fn unfused_modifier_check(opts: &AttentionOptions<'_>) -> Result<()> {
    if opts.has_score_modifier() {
        return Err(Error::shape(
            "softcap/alibi/sinks/cosine/key_norm_clip/bias/relative_buckets",
            "the unfused path has no score modifiers; use attention_forward / attention_backward",
        ));
    }
    Ok(())
}

/// Unfused attention backward (benchmark baseline): recomputes and materialises P `[B, H, Lq, Lk]`,
/// then dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO,
/// with dK and dV summed over the query heads of each kv head.
pub fn attention_backward_unfused(
    ctx: &Context,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    d_out: &HeadsView,
    opts: &AttentionOptions<'_>,
) -> Result<AttentionGrads> {
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(&s, opts)?;
    unfused_modifier_check(opts)?;
    check_view("d_out", d_out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    unfused_checks(ctx, &[("q", q), ("k", k), ("v", v), ("d_out", d_out)])?;
    let shape = scores_shape(ctx, &s)?;
    let probs = GpuTensor::uninit(ctx, "probs", &shape)?;
    let dprobs = GpuTensor::uninit(ctx, "dprobs", &shape)?;
    let lse = GpuTensor::uninit(ctx, "lse", &[s.batch, s.heads, s.q_seq])?;
    let dq = GpuTensor::uninit(ctx, "dq", &[s.batch, s.q_seq, s.heads, s.head_dim_qk])?;
    let dk = GpuTensor::uninit(ctx, "dk", &[s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk])?;
    let dv = GpuTensor::uninit(ctx, "dv", &[s.batch, s.kv_seq, s.kv_heads, s.head_dim_v])?;
    for (arg, t) in [("dq", &dq), ("dk", &dk), ("dv", &dv)] {
        check_whole_binding(ctx, arg, t.buffer())?;
    }
    let lens = seq_lens_buffer(ctx, opts);
    let group = s.heads / s.kv_heads;
    let (b, h, hkv, lq, lk) = (
        s.batch as u32,
        s.heads as u32,
        s.kv_heads as u32,
        s.q_seq,
        s.kv_seq,
    );
    let dk_dim = s.head_dim_qk as u32;
    // P rows (queries) by columns (keys) per query head; P^T per kv head over its query heads.
    let (p_rows, p_t_grouped) = probs_operands(&s);
    let (dq_v, dk_v, dv_v) = (dq.heads()?, dk.heads()?, dv.heads()?);

    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    {
        let mut pass = ctx.begin_pass(&mut encoder, "attention_backward_unfused");
        encode_probs(ctx, &mut pass, &s, scale, q, k, &probs, &lse, opts, lens)?;
        // dP, dS in place, dV.
        encode_unfused_output_grads(ctx, &mut pass, &s, opts, &probs, &dprobs, v, d_out, &dv_v)?;
        // dQ = scale dS K
        encode_gemm(
            ctx,
            &mut pass,
            &Gemm {
                m: lq as u32,
                n: dk_dim,
                k: lk as u32,
                groups: 1,
                batch: b,
                heads: h,
                alpha: scale,
                a: (dprobs.buffer(), p_rows),
                b: (k.buffer(), view_operand(k, true, group)),
                c: (dq.buffer(), view_operand(&dq_v, true, 1)),
                epilogue: Epilogue::NONE,
                elements: Elements::F32,
            },
        )?;
        // dK = scale sum_g dS^T Q
        encode_gemm(
            ctx,
            &mut pass,
            &Gemm {
                m: lk as u32,
                n: dk_dim,
                k: lq as u32,
                groups: group as u32,
                batch: b,
                heads: hkv,
                alpha: scale,
                a: (dprobs.buffer(), p_t_grouped),
                b: (q.buffer(), grouped_operand(q, group)),
                c: (dk.buffer(), view_operand(&dk_v, true, 1)),
                epilogue: Epilogue::NONE,
                elements: Elements::F32,
            },
        )?;
    }
    ctx.submit(encoder)?;
    Ok(AttentionGrads {
        dq,
        dk,
        dv,
        d_sinks: None,
        d_bias: None,
        d_relative: None,
    })
}
