//! One checked call as the kernel families record it ([`ForwardCall`], [`BackwardCall`] over
//! [`BackwardViews`]), and the outputs of a forward ([`AttentionOutput`]).

use super::options::AttentionOptions;
use crate::device::Context;
use crate::error::Result;
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, HeadsView};

/// O and lse of a forward pass: `out [B, Lq, H, Dv]`, `lse [B, H, Lq]` (`-inf` for rows that see no
/// key). Both are what [`attention_backward`](super::attention_backward) needs.
#[derive(Clone, Debug)]
pub struct AttentionOutput {
    /// `[B, Lq, H, Dv]`; `[rows, H, Dv]` packed like Q where Q is packed ([`HeadsView::packed`]).
    pub out: GpuTensor,
    /// The row log-sum-exp `[B, H, Lq]` (`-inf` for rows that see no key), what the backward needs.
    pub lse: GpuTensor,
}

impl AttentionOutput {
    /// New, uninitialised `out [B, Lq, H, Dv]` and `lse [B, H, Lq]` for `s`.
    pub(crate) fn new(ctx: &Context, s: &AttentionShape) -> Result<Self> {
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
    pub(crate) fn recorded(
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

/// One checked forward call as every family's encoder records it: the shape, the softmax scale,
/// Q, K and V (Q and K after the cosine and clipping transforms), the outputs and the options.
#[derive(Clone, Copy)]
pub(super) struct ForwardCall<'a> {
    pub s: AttentionShape,
    pub scale: f32,
    pub q: &'a HeadsView,
    pub k: &'a HeadsView,
    pub v: &'a HeadsView,
    pub out: &'a HeadsView,
    pub lse: &'a GpuTensor,
    pub opts: &'a AttentionOptions<'a>,
}

/// The tensors of one backward call: Q, K, V, O, lse and dO read, dQ, dK and dV written, and the
/// workspace of the `(lse, D)` row statistics.
#[derive(Clone, Copy)]
pub(super) struct BackwardViews<'a> {
    pub q: &'a HeadsView,
    pub k: &'a HeadsView,
    pub v: &'a HeadsView,
    pub out: &'a HeadsView,
    pub lse: &'a GpuTensor,
    pub d_out: &'a HeadsView,
    pub dq: &'a HeadsView,
    pub dk: &'a HeadsView,
    pub dv: &'a HeadsView,
    pub workspace: &'a GpuTensor,
}

/// One checked backward call as a family's gradient kernels record it: the shape, the softmax
/// scale, the tensors, the options, the dK/dV loop's length (query head of the group, query row)
/// and the element type.
pub(super) struct BackwardCall<'a> {
    pub s: AttentionShape,
    pub scale: f32,
    pub views: BackwardViews<'a>,
    pub opts: &'a AttentionOptions<'a>,
    pub group_rows: usize,
    pub dtype: DType,
}
