//! Ahead-of-time compilation: the pipelines an attention problem (dot-product or additive) needs,
//! built before its first call (which otherwise pays for them). With
//! [`crate::ContextOptions::dump_pipelines`] this writes a problem's whole kernel set for offline
//! compilers without running it.

use super::backward::{attention_backward_into, attention_backward_workspace};
use super::call::{BackwardViews, ForwardViews};
use super::forward::attention_forward_into;
use super::options::AttentionOptions;
use super::{bias, sinks};
use crate::device::Context;
use crate::error::Result;
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, HeadsView};

/// Which passes of an attention problem [`attention_precompile`] builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttentionPasses {
    /// [`attention_forward_into`] only (inference).
    Forward,
    /// The forward and [`attention_backward_into`] (training).
    ForwardBackward,
}

/// Compiles every pipeline that [`attention_forward_into`] (and, for
/// [`AttentionPasses::ForwardBackward`], [`attention_backward_into`]) would use for `shape`,
/// `dtype` and `opts` on `ctx` (with the backward, also the gradient kernels of a learnable bias
/// ([`attention_bias_backward_into`](super::attention_bias_backward_into)) and of sinks
/// ([`attention_sinks_backward_into`](super::attention_sinks_backward_into)) where `opts` has
/// them), without running any: the calls are recorded on scratch tensors of the problem's shape
/// into a command buffer that is never submitted (so it allocates, for the duration of the call,
/// what one such call allocates). Returns how many pipelines were newly compiled (0 if all were
/// cached). `opts` is checked as the calls check it, so an error here is the error the real call
/// would return.
pub fn attention_precompile(
    ctx: &Context,
    shape: &AttentionShape,
    dtype: DType,
    opts: &AttentionOptions<'_>,
    passes: AttentionPasses,
) -> Result<usize> {
    let s = shape;
    let before = ctx.cached_pipelines();
    let tensor = |shape: &[usize]| -> Result<Box<dyn HeadsSource>> {
        Ok(match dtype {
            DType::F32 => Box::new(GpuTensor::zeros(ctx, shape)?),
            DType::F16 => Box::new(crate::tensor::GpuTensorF16::zeros(ctx, shape)?),
        })
    };
    let q_shape = [s.batch, s.q_seq, s.heads, s.head_dim_qk];
    let k_shape = [s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk];
    let v_shape = [s.batch, s.kv_seq, s.kv_heads, s.head_dim_v];
    let o_shape = [s.batch, s.q_seq, s.heads, s.head_dim_v];
    let (q, k, v, out) = (
        tensor(&q_shape)?,
        tensor(&k_shape)?,
        tensor(&v_shape)?,
        tensor(&o_shape)?,
    );
    let lse = GpuTensor::zeros(ctx, &[s.batch, s.heads, s.q_seq])?;
    let (q, k, v, out) = (q.heads()?, k.heads()?, v.heads()?, out.heads()?);
    let mut encoder = ctx
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("attention precompile (never submitted)"),
        });
    attention_forward_into(
        ctx,
        &mut encoder,
        &ForwardViews {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &lse,
        },
        opts,
    )?;
    if passes == AttentionPasses::ForwardBackward {
        let (d_out, dq, dk, dv) = (
            tensor(&o_shape)?,
            tensor(&q_shape)?,
            tensor(&k_shape)?,
            tensor(&v_shape)?,
        );
        let (d_out, dq, dk, dv) = (d_out.heads()?, dq.heads()?, dk.heads()?, dv.heads()?);
        let workspace = attention_backward_workspace(ctx, s)?;
        // A learned relative table needs somewhere to put its gradient, as the allocating call
        // provides one.
        let d_relative = match (opts.relative, opts.relative_grad) {
            (Some((buckets, _)), None) => Some(GpuTensor::zeros(ctx, &[s.heads, buckets.buckets])?),
            _ => None,
        };
        let mut with_grad = *opts;
        if let Some(grad) = &d_relative {
            with_grad.relative_grad = Some(grad);
        }
        attention_backward_into(
            ctx,
            &mut encoder,
            &BackwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &lse,
                d_out: &d_out,
                dq: &dq,
                dk: &dk,
                dv: &dv,
                workspace: &workspace,
            },
            &with_grad,
        )?;
        // Their pipelines do not depend on the problem, and a bias gradient is Lq x Lk.
        if opts.bias.is_some_and(|b| b.learnable) {
            bias::precompile_backward(ctx);
        }
        if opts.sinks.is_some() {
            sinks::precompile_backward(ctx);
        }
    }
    // Dropped unsubmitted: nothing runs, the pipelines stay in the context's cache.
    drop(encoder);
    Ok(ctx.cached_pipelines() - before)
}

/// A tensor of either element type, seen as `[B, L, H, D]` heads.
trait HeadsSource {
    fn heads(&self) -> Result<HeadsView>;
}

impl HeadsSource for GpuTensor {
    fn heads(&self) -> Result<HeadsView> {
        GpuTensor::heads(self)
    }
}

impl HeadsSource for crate::tensor::GpuTensorF16 {
    fn heads(&self) -> Result<HeadsView> {
        crate::tensor::GpuTensorF16::heads(self)
    }
}
