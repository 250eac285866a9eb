//! One checked call as the kernel families record it ([`ForwardCall`], [`BackwardCall`] over
//! [`BackwardViews`]), and the outputs of a forward ([`AttentionOutput`]).

use super::options::AttentionOptions;
use super::variant::{FusedVariant, KvWords};
use crate::device::{Context, KernelChoice};
use crate::error::Result;
use crate::kernels::kv_cache::BlockTable;
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
    /// The family, tiles and split the call runs (the context's settings over the tuned choice).
    pub choice: KernelChoice,
    /// How K and V are read beyond their views (a prefill-shaped decoding step's cache).
    pub cache: CacheRead<'a>,
}

/// How a forward reads K and V beyond their views, for a prefill-shaped decoding step: a paged
/// cache's pools through its block table, and a cache stored in int8 or f16 words dequantised as
/// they are staged. [`CacheRead::VIEWS`]: K and V are what their views hold.
#[derive(Clone, Copy)]
pub(super) struct CacheRead<'a> {
    pub table: Option<&'a BlockTable>,
    pub words: Option<KvWords>,
}

impl CacheRead<'_> {
    /// K and V read as their views' values.
    pub const VIEWS: Self = Self {
        table: None,
        words: None,
    };

    /// The key's paged and stored-words builds, for this read.
    pub fn specialise(&self, key: &mut FusedVariant) {
        key.page = self.table.map_or(0, |t| t.page() as u32);
        key.kv_words = self.words;
        if self.words.is_some() {
            key.vec4_inputs = false;
        }
    }
}

/// The tensors of one forward call ([`attention_forward_into`](super::attention_forward_into)):
/// Q, K and V read, O and lse written. Decoding takes the same with K and V the cache (or the paged
/// pool), and additive attention with Q and K its query and key projections `a` and `b`.
#[derive(Clone, Copy, Debug)]
pub struct ForwardViews<'a> {
    /// Queries `[B, Lq, H, Dk]` (`[rows, H, Dk]` packed).
    pub q: &'a HeadsView,
    /// Keys `[B, Lk, Hkv, Dk]`.
    pub k: &'a HeadsView,
    /// Values `[B, Lk, Hkv, Dv]`.
    pub v: &'a HeadsView,
    /// The output `[B, Lq, H, Dv]`, shaped like Q.
    pub out: &'a HeadsView,
    /// The row log-sum-exp `[B, H, Lq]`.
    pub lse: &'a GpuTensor,
}

/// The tensors of one backward call
/// ([`attention_backward_into`](super::attention_backward_into)): Q, K, V, the forward's O and
/// lse, and dO read; dQ, dK and dV written (views of one packed buffer allowed); the workspace of
/// the `(lse, D)` row statistics
/// ([`attention_backward_workspace`](super::attention_backward_workspace)). Additive attention's
/// backward takes the same with its projections `a`, `b` and their gradients in place of Q, K,
/// dQ and dK.
#[derive(Clone, Copy, Debug)]
pub struct BackwardViews<'a> {
    /// Queries, as the forward read them.
    pub q: &'a HeadsView,
    /// Keys.
    pub k: &'a HeadsView,
    /// Values.
    pub v: &'a HeadsView,
    /// The forward's output.
    pub out: &'a HeadsView,
    /// The forward's row log-sum-exp.
    pub lse: &'a GpuTensor,
    /// The gradient of the output, shaped like it.
    pub d_out: &'a HeadsView,
    /// The gradient of Q, written (shaped like Q).
    pub dq: &'a HeadsView,
    /// The gradient of K, written.
    pub dk: &'a HeadsView,
    /// The gradient of V, written.
    pub dv: &'a HeadsView,
    /// Scratch for the row statistics, rewritten by each call.
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
    pub choice: KernelChoice,
}
