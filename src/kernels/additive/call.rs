//! The score parameters and gradients of one additive attention call, and its argument checks.

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_context, check_f32};
use crate::kernels::attention::shape::{check_options, check_tensor, refuse_packed};
use crate::kernels::attention::AttentionOptions;
use crate::spec::AttentionShape;
use crate::tensor::{GpuTensor, HeadsView};

use super::MAX_ADDITIVE_DIM;

/// The learned score parameters of additive attention: the score vector `w` and the bias, `[H, Da]`
/// each.
#[derive(Clone, Copy, Debug)]
pub struct AdditiveScores<'a> {
    /// The score vector `w [H, Da]`.
    pub w: &'a GpuTensor,
    /// The bias added to the query projection, `[H, Da]`.
    pub bias: &'a GpuTensor,
}

/// Gradients of [`additive_backward`](super::additive_backward): `da`, `db`, `dv` shaped like `a`, `b`, `v`; `dw`, `dbias`
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
pub(super) fn check(
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
