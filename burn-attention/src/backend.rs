//! The op as a burn backend extension: its two methods, and their implementation on burn's cubecl
//! back end, which records wgpu-attention's fused kernels on burn's device and buffers.

use std::sync::Arc;

use burn::backend::wgpu::CubeBackend;
use burn::backend::wgpu::CubeTensor;
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, ExtensionType};
use burn::tensor::DType as BurnDType;
use wgpu_attention::{
    attention_backward_into, attention_backward_workspace, attention_bias_backward_into,
    attention_forward_into, attention_sinks_backward_into, AttentionOptions, AttentionShape,
    BackwardViews, BiasView, Context, ForwardViews, GpuTensor, HeadsView, SeqLens,
};

use crate::buffers::{contiguous_aligned, contiguous_rows, empty, flush, pin_optional, Pinned};
use crate::{device, error, Error, Result, ScoreSpec};

/// Which gradients of the optional score terms the backward computes (those whose tensors require
/// one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WantedGrads {
    /// The score bias's.
    pub bias: bool,
    /// The relative-position table's.
    pub relative_table: bool,
    /// The sinks'.
    pub sinks: bool,
}

/// What [`FusedAttentionBackend::fused_attention_backward`] returns: dQ, dK, dV and the gradients of
/// the bias, the relative table and the sinks (those wanted). The trait spells the tuple out (the
/// extension macro reads it); its implementations name it by this alias.
pub(crate) type AttentionGradients<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
    Option<FloatTensor<B>>,
);

/// A tensor argument that may be absent (burn's extension ops take no `Option` of a tensor).
#[derive(ExtensionType, Clone, Debug)]
pub enum OptionalTensor<B: Backend> {
    /// The tensor.
    Given(FloatTensor<B>),
    /// No tensor.
    Absent,
}

impl<B: Backend> OptionalTensor<B> {
    /// `Given` for `Some`.
    pub fn from_option(tensor: Option<FloatTensor<B>>) -> Self {
        match tensor {
            Some(tensor) => Self::Given(tensor),
            None => Self::Absent,
        }
    }

    /// `Some` for `Given`.
    pub fn into_option(self) -> Option<FloatTensor<B>> {
        match self {
            Self::Given(tensor) => Some(tensor),
            Self::Absent => None,
        }
    }
}

/// Fused attention as a burn backend op: implemented for burn's cubecl back end (wgpu devices), for
/// its fusion wrapper (feature `fusion`, eagerly), and, with its backward registered, for `Autodiff`
/// over either. Tensors are burn's `[B, H, L, D]`; K and V may have fewer heads (GQA); lse is
/// `[B, H, Lq]` f32.
#[backend_extension(Cube, Autodiff)]
pub trait FusedAttentionBackend: Backend {
    /// O `[B, H, Lq, Dv]` and the row log-sum-exp `[B, H, Lq]` the backward needs.
    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        #[extension_type] bias: OptionalTensor<Self>,
        #[extension_type] relative_table: OptionalTensor<Self>,
        #[extension_type] sinks: OptionalTensor<Self>,
        spec: ScoreSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// dQ, dK, dV and the gradients `wanted` of the bias, the relative table and the sinks, from the
    /// forward's O and lse and the output gradient.
    // burn's `#[extension]` macro takes every tensor as an argument of its own (it registers each
    // with autodiff and fusion), so they cannot be grouped into a struct.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn fused_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        #[extension_type] bias: OptionalTensor<Self>,
        #[extension_type] relative_table: OptionalTensor<Self>,
        #[extension_type] sinks: OptionalTensor<Self>,
        spec: ScoreSpec,
        wanted: WantedGrads,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
        Option<FloatTensor<Self>>,
    );
}

impl FusedAttentionBackend for CubeBackend {
    fn fused_attention_forward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        bias: OptionalTensor<Self>,
        relative_table: OptionalTensor<Self>,
        sinks: OptionalTensor<Self>,
        spec: ScoreSpec,
    ) -> (CubeTensor, CubeTensor) {
        let placeholder = (q.clone(), q.clone());
        Inputs::new(q, k, v, bias, relative_table, sinks)
            .and_then(|inputs| forward(inputs, &spec))
            .unwrap_or_else(|e| {
                error::record(e);
                placeholder
            })
    }

    fn fused_attention_backward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        out: CubeTensor,
        lse: CubeTensor,
        d_out: CubeTensor,
        bias: OptionalTensor<Self>,
        relative_table: OptionalTensor<Self>,
        sinks: OptionalTensor<Self>,
        spec: ScoreSpec,
        wanted: WantedGrads,
    ) -> AttentionGradients<Self> {
        Inputs::new(q, k, v, bias, relative_table, sinks)
            .and_then(|inputs| backward(inputs, out, lse, d_out, &spec, wanted))
            .unwrap_or_else(|e| {
                // Reached from burn's `backward()`, which has no way to return an error; the forward
                // checked every argument, so what is left is the device failing.
                panic!("burn-attention: fused attention backward failed: {e}")
            })
    }
}

/// Q, K, V and the optional score tensors of one call, laid out for the kernels.
struct Inputs {
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    bias: Option<CubeTensor>,
    relative_table: Option<CubeTensor>,
    sinks: Option<CubeTensor>,
}

impl Inputs {
    fn new(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        bias: OptionalTensor<CubeBackend>,
        relative_table: OptionalTensor<CubeBackend>,
        sinks: OptionalTensor<CubeBackend>,
    ) -> Result<Self> {
        let aligned = |arg, t: OptionalTensor<CubeBackend>| {
            t.into_option()
                .map(|t| contiguous_aligned(arg, t))
                .transpose()
        };
        Ok(Self {
            q: contiguous_rows(q),
            k: contiguous_rows(k),
            v: contiguous_rows(v),
            bias: bias.into_option(),
            relative_table: aligned("relative_table", relative_table)?,
            sinks: aligned("sinks", sinks)?,
        })
    }

    /// The context of the device Q is on, after checking every input is there too.
    fn context(&self) -> Result<Arc<Context>> {
        let others = [
            ("k", Some(&self.k)),
            ("v", Some(&self.v)),
            ("bias", self.bias.as_ref()),
            ("relative_table", self.relative_table.as_ref()),
            ("sinks", self.sinks.as_ref()),
        ];
        for (arg, tensor) in others {
            if let Some(tensor) = tensor {
                if tensor.device != self.q.device {
                    return Err(Error::Device {
                        arg,
                        found: format!("{:?}", tensor.device),
                        message: format!("q is on {:?}", self.q.device),
                    });
                }
            }
        }
        device::cube_context("q", &self.q.device)
    }

    /// The inputs' buffers, pinned, in the order `q, k, v, bias, relative_table, sinks`.
    fn pin(&self) -> Result<PinnedInputs> {
        flush(&self.q)?;
        Ok(PinnedInputs {
            q: Pinned::new("q", &self.q)?,
            k: Pinned::new("k", &self.k)?,
            v: Pinned::new("v", &self.v)?,
            bias: pin_optional("bias", self.bias.as_ref())?,
            relative_table: pin_optional("relative_table", self.relative_table.as_ref())?,
            sinks: pin_optional("sinks", self.sinks.as_ref())?,
        })
    }
}

struct PinnedInputs {
    q: Pinned,
    k: Pinned,
    v: Pinned,
    bias: Option<Pinned>,
    relative_table: Option<Pinned>,
    sinks: Option<Pinned>,
}

impl PinnedInputs {
    /// Q, K, V as the kernels' views, and the problem they make.
    fn views(&self) -> Result<(HeadsView, HeadsView, HeadsView, AttentionShape)> {
        let (q, k, v) = (self.q.heads("q")?, self.k.heads("k")?, self.v.heads("v")?);
        let shape = AttentionShape::of(&q, &k, &v)?;
        Ok((q, k, v, shape))
    }
}

/// The kernels' views of the score terms, owned, for [`AttentionOptions`] to borrow.
struct ScoreTerms {
    seq_lens: Option<SeqLens>,
    bias: Option<BiasView>,
    relative_table: Option<GpuTensor>,
    sinks: Option<GpuTensor>,
}

impl ScoreTerms {
    fn new(ctx: &Context, spec: &ScoreSpec, pinned: &PinnedInputs) -> Result<Self> {
        let seq_lens = match (&spec.q_lens, &spec.kv_lens) {
            (None, None) => None,
            (q, kv) => Some(SeqLens::new(ctx, q.as_deref(), kv.as_deref())?),
        };
        let relative_table = (pinned.relative_table.as_ref())
            .map(|t| t.dense("relative_table"))
            .transpose()?;
        if spec.relative.is_some() != relative_table.is_some() {
            return Err(Error::Shape {
                arg: "relative_table",
                found: vec![],
                message: "relative buckets and their table go together".into(),
            });
        }
        Ok(Self {
            seq_lens,
            bias: pinned.bias.as_ref().map(Pinned::bias).transpose()?,
            relative_table,
            sinks: (pinned.sinks.as_ref())
                .map(|t| t.dense("sinks"))
                .transpose()?,
        })
    }

    /// The library's options: `spec`'s settings and these terms (a learnable bias when its
    /// gradient is `wanted`).
    fn options<'a>(&'a self, spec: &'a ScoreSpec, learnable_bias: bool) -> AttentionOptions<'a> {
        let mut opts = AttentionOptions::new().causal(spec.causal);
        if let Some(scale) = spec.scale {
            opts = opts.scale(scale);
        }
        if let Some(temperature) = spec.temperature {
            opts = opts.temperature(temperature);
        }
        if let Some(lens) = &self.seq_lens {
            opts = opts.seq_lens(lens);
        }
        if let Some(cap) = spec.softcap {
            opts = opts.softcap(cap);
        }
        if let Some((left, right)) = spec.window {
            opts = opts.window(left, right);
        }
        match &spec.alibi {
            Some(Some(slopes)) => opts = opts.alibi_slopes(slopes),
            Some(None) => opts = opts.alibi(true),
            None => {}
        }
        if let Some(scale) = spec.cosine {
            opts = opts.cosine(scale);
        }
        if let Some(max_norm) = spec.key_clip {
            opts = opts.key_norm_clip(max_norm);
        }
        if let Some(bias) = &self.bias {
            opts = match learnable_bias {
                true => opts.bias(bias),
                false => opts.constant_bias(bias),
            };
        }
        if let (Some(buckets), Some(table)) = (spec.relative, &self.relative_table) {
            opts = opts.relative_buckets(buckets, table);
        }
        if let Some(sinks) = &self.sinks {
            opts = opts.sinks(sinks);
        }
        opts
    }
}

fn forward(inputs: Inputs, spec: &ScoreSpec) -> Result<(CubeTensor, CubeTensor)> {
    let ctx = inputs.context()?;
    let pinned = inputs.pin()?;
    let (q, k, v, s) = pinned.views()?;
    let out = empty(
        &inputs.q,
        &[s.batch, s.heads, s.q_seq, s.head_dim_v],
        inputs.q.dtype,
    );
    let lse = empty(&inputs.q, &[s.batch, s.heads, s.q_seq], BurnDType::F32);
    let (out_pinned, lse_pinned) = (Pinned::new("out", &out)?, Pinned::new("lse", &lse)?);
    let terms = ScoreTerms::new(&ctx, spec, &pinned)?;
    let opts = terms.options(spec, false);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    attention_forward_into(
        &ctx,
        &mut encoder,
        &ForwardViews {
            q: &q,
            k: &k,
            v: &v,
            out: &out_pinned.heads("out")?,
            lse: &lse_pinned.dense("lse")?,
        },
        &opts,
    )?;
    submit(&ctx, encoder)?;
    Ok((out, lse))
}

fn backward(
    inputs: Inputs,
    out: CubeTensor,
    lse: CubeTensor,
    d_out: CubeTensor,
    spec: &ScoreSpec,
    wanted: WantedGrads,
) -> Result<AttentionGradients<CubeBackend>> {
    let ctx = inputs.context()?;
    let (out, d_out) = (contiguous_rows(out), contiguous_rows(d_out));
    let lse = contiguous_aligned("lse", lse)?;
    let pinned = inputs.pin()?;
    let (q, k, v, s) = pinned.views()?;
    let dtype = inputs.q.dtype;
    let dq = empty(
        &inputs.q,
        &[s.batch, s.heads, s.q_seq, s.head_dim_qk],
        dtype,
    );
    let dk = empty(
        &inputs.q,
        &[s.batch, s.kv_heads, s.kv_seq, s.head_dim_qk],
        dtype,
    );
    let dv = empty(
        &inputs.q,
        &[s.batch, s.kv_heads, s.kv_seq, s.head_dim_v],
        dtype,
    );
    let terms = ScoreTerms::new(&ctx, spec, &pinned)?;
    // A gradient like its (f32) term, where the term exists and its gradient is wanted.
    let gradient = |wanted: bool, term: &Option<CubeTensor>| {
        let term = term.as_ref().filter(|_| wanted)?;
        Some(empty(
            &inputs.q,
            &term.meta.shape().to_vec(),
            BurnDType::F32,
        ))
    };
    let d_bias = gradient(wanted.bias, &inputs.bias);
    let d_relative = gradient(wanted.relative_table, &inputs.relative_table);
    let d_sinks = gradient(wanted.sinks, &inputs.sinks);
    let pin = |arg, t: &CubeTensor| Pinned::new(arg, t);
    let (out_p, lse_p, d_out_p) = (pin("out", &out)?, pin("lse", &lse)?, pin("d_out", &d_out)?);
    let (dq_p, dk_p, dv_p) = (pin("dq", &dq)?, pin("dk", &dk)?, pin("dv", &dv)?);
    let d_bias_p = pin_optional("d_bias", d_bias.as_ref())?;
    let d_relative_p = pin_optional("d_relative_table", d_relative.as_ref())?;
    let d_sinks_p = pin_optional("d_sinks", d_sinks.as_ref())?;
    let d_relative_dense = (d_relative_p.as_ref())
        .map(|t| t.dense("d_relative_table"))
        .transpose()?;
    let mut opts = terms.options(spec, d_bias.is_some());
    // Without a destination the relative table's gradient is not computed (a constant table).
    if let Some(grad) = &d_relative_dense {
        opts.relative_grad = Some(grad);
    }
    let workspace = attention_backward_workspace(&ctx, &s)?;
    let (out_view, lse_view) = (out_p.heads("out")?, lse_p.dense("lse")?);
    let d_out_view = d_out_p.heads("d_out")?;
    let (dq_view, dk_view, dv_view) = (dq_p.heads("dq")?, dk_p.heads("dk")?, dv_p.heads("dv")?);
    let views = BackwardViews {
        q: &q,
        k: &k,
        v: &v,
        out: &out_view,
        lse: &lse_view,
        d_out: &d_out_view,
        dq: &dq_view,
        dk: &dk_view,
        dv: &dv_view,
        workspace: &workspace,
    };
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    attention_backward_into(&ctx, &mut encoder, &views, &opts)?;
    if let (Some(sinks), Some(grad)) = (&terms.sinks, &d_sinks_p) {
        attention_sinks_backward_into(
            &ctx,
            &mut encoder,
            &s,
            sinks,
            &workspace,
            &grad.dense("d_sinks")?,
            &opts,
        )?;
    }
    if let Some(grad) = &d_bias_p {
        attention_bias_backward_into(&ctx, &mut encoder, &views, &grad.dense("d_bias")?, &opts)?;
    }
    submit(&ctx, encoder)?;
    Ok((dq, dk, dv, d_bias, d_relative, d_sinks))
}

/// Submits `encoder` on the queue burn shares, unless the device was lost.
fn submit(ctx: &Context, encoder: wgpu::CommandEncoder) -> Result<()> {
    ctx.check_lost()?;
    ctx.queue().submit([encoder.finish()]);
    Ok(())
}
