//! wgpu-attention's fused attention in [burn](https://burn.dev) 0.22: forward and backward as one
//! burn op with autodiff, run on burn's own wgpu device and burn's own buffers.
//!
//! ```no_run
//! use burn::tensor::{Device, Distribution, Tensor};
//! use burn_attention::{fused_attention, FusedAttentionOptions};
//! use wgpu_attention::ContextOptions;
//!
//! # fn main() -> burn_attention::Result<()> {
//! // burn's runtime and the attention kernels on one wgpu device.
//! let device = burn_attention::init(Device::wgpu_options(), &ContextOptions::new())?.autodiff();
//! let t = || Tensor::<4>::random([2, 4, 128, 64], Distribution::Normal(0.0, 1.0), &device);
//! let (q, k, v) = (t().require_grad(), t().require_grad(), t().require_grad());
//! let out = fused_attention(q.clone(), k, v, &FusedAttentionOptions::new().causal(true))?;
//! let grads = out.sum().backward(); // the fused backward kernels
//! let dq = q.grad(&grads).unwrap();
//! # Ok(()) }
//! ```
//!
//! Tensors are burn's `[batch, heads, seq, head_dim]`, read where they are (any strides with a
//! contiguous head_dim; anything else is made contiguous by burn first). K and V may have fewer
//! heads than Q (GQA, MQA) and V another head_dim. The device must be registered with [`init`] or
//! [`register_setup`], on burn's cubecl back end, with burn's fusion (the default feature `fusion`:
//! the op runs eagerly in fusion's stream) or without it (`default-features = false`); on any other
//! device [`fused_attention`] returns [`Error::Device`].

#![warn(missing_docs)]

/// The crate README's code, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

mod autodiff;
mod backend;
mod buffers;
mod device;
mod error;
#[cfg(feature = "fusion")]
mod fusion;
mod options;

pub use backend::{FusedAttentionBackend, OptionalTensor, WantedGrads};
pub use device::{context, init, register_setup};
pub use error::{Error, Result};
pub use options::{FusedAttentionOptions, ScoreSpec};
pub use wgpu_attention::{ContextOptions, RelativeBuckets};

use burn::backend::Dispatch;
use burn::tensor::{ops::AttentionModuleOptions, Bool, Tensor};

/// Fused scaled dot-product attention `softmax(Q K^T * scale + terms) V` of burn tensors, `[B, H,
/// Lq, Dk]`, `[B, Hkv, Lk, Dk]`, `[B, Hkv, Lk, Dv]` to `[B, H, Lq, Dv]`. Under autodiff its
/// backward is the fused backward kernels (dQ, dK, dV and the gradients of a bias, relative table
/// or sinks that require one), from the O and row log-sum-exp this forward keeps.
///
/// Every argument is checked before anything runs: a tensor on another device, back end or an
/// unregistered one, a dtype other than f32 / f16, shapes that do not agree or options the kernels
/// refuse give a typed [`Error`] and no work.
pub fn fused_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: &FusedAttentionOptions,
) -> Result<Tensor<4>> {
    fused_attention_lse(q, k, v, options).map(|(out, _)| out)
}

/// [`fused_attention`] that also returns the row log-sum-exp `[B, H, Lq]` (f32, `-inf` for rows
/// that see no key; not differentiable).
pub fn fused_attention_lse(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    options: &FusedAttentionOptions,
) -> Result<(Tensor<4>, Tensor<3>)> {
    check_arguments(&q, &k, &v, options)?;
    let bias = score_bias(options)?;
    let optional = OptionalTensor::<Dispatch>::from_option;
    // A refusal left by an earlier call that returned early must not be taken for this one's.
    let _ = error::take();
    let (out, lse) = Dispatch::fused_attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        optional(bias.map(Tensor::into_dispatch)),
        optional(options.relative_table.clone().map(Tensor::into_dispatch)),
        optional(options.sinks.clone().map(Tensor::into_dispatch)),
        options.spec.clone(),
    );
    match error::take() {
        Some(error) => Err(error),
        None => Ok((Tensor::from_dispatch(out), Tensor::from_dispatch(lse))),
    }
}

/// burn's `attention` with its own arguments: a drop-in for `burn::tensor::module::attention`
/// that runs the fused kernels (and, under autodiff, the fused backward). `mask` is `[B, H, Lq,
/// Lk]` with `true` masking the pair, `attn_bias` an additive bias (learnable when it requires a
/// gradient); `options` carries burn's scale, softcap and causal flag.
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Option<Tensor<4, Bool>>,
    attn_bias: Option<Tensor<4>>,
    options: AttentionModuleOptions,
) -> Result<Tensor<4>> {
    let mut fused = FusedAttentionOptions::new().causal(options.is_causal);
    fused.spec.scale = options.scale.map(|s| s as f32);
    fused.spec.softcap = options.softcap.map(|c| c as f32);
    fused.bias = attn_bias;
    fused.mask = mask;
    fused_attention(q, k, v, &fused)
}

/// The bias the kernels read: the options' bias, plus `-inf` where the mask is set.
fn score_bias(options: &FusedAttentionOptions) -> Result<Option<Tensor<4>>> {
    let Some(mask) = &options.mask else {
        return Ok(options.bias.clone());
    };
    let dims = mask.dims();
    let masked =
        Tensor::<4>::zeros(dims, &mask.device()).mask_fill(mask.clone(), f32::NEG_INFINITY);
    match &options.bias {
        None => Ok(Some(masked)),
        Some(bias) => {
            let [b, h, lq, lk] = bias.dims();
            let [mb, mh, mq, mk] = dims;
            if (lq, lk) != (mq, mk)
                || !(b == mb || b == 1 || mb == 1)
                || !(h == mh || h == 1 || mh == 1)
            {
                return Err(Error::Shape {
                    arg: "mask",
                    found: dims.to_vec(),
                    message: format!("does not broadcast with the bias's {:?}", bias.dims()),
                });
            }
            Ok(Some(bias.clone() + masked))
        }
    }
}

/// The checks burn's dispatch cannot report: every tensor on Q's device, that device a registered
/// wgpu one, float tensors of a dtype the kernels take.
fn check_arguments(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    options: &FusedAttentionOptions,
) -> Result<()> {
    let device = q.device();
    device::context_of("q", &device)?;
    let others = [
        ("k", Some((k.device(), k.dtype()))),
        ("v", Some((v.device(), v.dtype()))),
        (
            "bias",
            options.bias.as_ref().map(|t| (t.device(), t.dtype())),
        ),
        (
            "relative_table",
            (options.relative_table.as_ref()).map(|t| (t.device(), t.dtype())),
        ),
        (
            "sinks",
            options.sinks.as_ref().map(|t| (t.device(), t.dtype())),
        ),
        (
            "mask",
            (options.mask.as_ref()).map(|t| (t.device(), burn::tensor::DType::F32)),
        ),
    ];
    buffers::kernel_dtype("q", q.dtype())?;
    for (arg, found) in others {
        let Some((found, dtype)) = found else {
            continue;
        };
        if found != device {
            return Err(Error::Device {
                arg,
                found: format!("{found:?}"),
                message: format!("q is on {device:?}; all tensors of a call share its device"),
            });
        }
        buffers::kernel_dtype(arg, dtype)?;
    }
    Ok(())
}
