//! The op under burn's autodiff: the forward keeps Q, K, V, O and lse (lse is never recomputed) and
//! registers one backward step that runs the fused backward kernels and hands each tracked input
//! its gradient.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::tensor::FloatTensor;

use crate::backend::{AttentionGradients, FusedAttentionBackend, OptionalTensor, WantedGrads};
use crate::ScoreSpec;

/// The backward step's marker; its state is [`Saved`].
#[derive(Debug)]
struct FusedAttentionBackward;

/// What the backward reads: the inputs, the forward's O and lse, the settings, and which of the
/// six parent slots (q, k, v, bias, relative table, sinks) hold a real input (absent ones repeat
/// Q's node and get no gradient).
#[derive(Clone, Debug)]
struct Saved<B: burn::backend::Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    relative_table: Option<FloatTensor<B>>,
    sinks: Option<FloatTensor<B>>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    spec: ScoreSpec,
}

impl<B: FusedAttentionBackend> Backward<B, 6> for FusedAttentionBackward {
    type State = Saved<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 6>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v, node_bias, node_relative, node_sinks] = ops.parents;
        let d_out = grads.consume::<B>(&ops.node);
        let saved = ops.state;
        // A parent slot is tracked (Some) only for an input that requires a gradient; the slots of
        // absent inputs repeat Q's node, so they are read only where the input exists.
        let node_bias = node_bias.filter(|_| saved.bias.is_some());
        let node_relative = node_relative.filter(|_| saved.relative_table.is_some());
        let node_sinks = node_sinks.filter(|_| saved.sinks.is_some());
        let wanted = WantedGrads {
            bias: node_bias.is_some(),
            relative_table: node_relative.is_some(),
            sinks: node_sinks.is_some(),
        };
        let optional = OptionalTensor::<B>::from_option;
        let (dq, dk, dv, d_bias, d_relative, d_sinks) = B::fused_attention_backward(
            saved.q,
            saved.k,
            saved.v,
            saved.out,
            saved.lse,
            d_out,
            optional(saved.bias),
            optional(saved.relative_table),
            optional(saved.sinks),
            saved.spec,
            wanted,
        );
        let pairs = [
            (node_q, Some(dq)),
            (node_k, Some(dk)),
            (node_v, Some(dv)),
            (node_bias, d_bias),
            (node_relative, d_relative),
            (node_sinks, d_sinks),
        ];
        for (node, grad) in pairs {
            if let (Some(node), Some(grad)) = (node, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The autodiff tensor of `primitive`, tracked by no node (lse, and gradients handed out as
/// constants).
fn constant<B: FusedAttentionBackend, C: CheckpointStrategy>(
    primitive: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    <FloatTensor<Autodiff<B, C>>>::new(primitive)
}

impl<B: FusedAttentionBackend, C: CheckpointStrategy> FusedAttentionBackend for Autodiff<B, C> {
    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: OptionalTensor<Self>,
        relative_table: OptionalTensor<Self>,
        sinks: OptionalTensor<Self>,
        spec: ScoreSpec,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (bias, relative_table, sinks) = (
            bias.into_option(),
            relative_table.into_option(),
            sinks.into_option(),
        );
        let node_or_q = |t: &Option<FloatTensor<Self>>| t.as_ref().unwrap_or(&q).node();
        let nodes = [
            q.node(),
            k.node(),
            v.node(),
            node_or_q(&bias),
            node_or_q(&relative_table),
            node_or_q(&sinks),
        ];
        let primitive = |t: &FloatTensor<Self>| t.primitive().clone();
        let bias = bias.as_ref().map(primitive);
        let relative_table = relative_table.as_ref().map(primitive);
        let sinks = sinks.as_ref().map(primitive);
        let (q, k, v) = (primitive(&q), primitive(&k), primitive(&v));
        let optional = OptionalTensor::<B>::from_option;
        // Attention is compute bound: its state is kept, not recomputed, under checkpointing.
        match FusedAttentionBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (out, lse) = B::fused_attention_forward(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    optional(bias.clone()),
                    optional(relative_table.clone()),
                    optional(sinks.clone()),
                    spec.clone(),
                );
                let saved = Saved {
                    q,
                    k,
                    v,
                    bias,
                    relative_table,
                    sinks,
                    out: out.clone(),
                    lse: lse.clone(),
                    spec,
                };
                (prep.finish(saved, out), constant::<B, C>(lse))
            }
            OpsKind::UnTracked(prep) => {
                let (out, lse) = B::fused_attention_forward(
                    q,
                    k,
                    v,
                    optional(bias),
                    optional(relative_table),
                    optional(sinks),
                    spec,
                );
                (prep.finish(out), constant::<B, C>(lse))
            }
        }
    }

    fn fused_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        bias: OptionalTensor<Self>,
        relative_table: OptionalTensor<Self>,
        sinks: OptionalTensor<Self>,
        spec: ScoreSpec,
        wanted: WantedGrads,
    ) -> AttentionGradients<Self> {
        // Called directly (not from the step the forward registers): the gradients as constants;
        // the backward is not itself differentiated (no second order).
        let inner = |t: FloatTensor<Self>| t.into_primitive();
        let optional =
            |t: OptionalTensor<Self>| OptionalTensor::<B>::from_option(t.into_option().map(inner));
        let (dq, dk, dv, d_bias, d_relative, d_sinks) = B::fused_attention_backward(
            inner(q),
            inner(k),
            inner(v),
            inner(out),
            inner(lse),
            inner(d_out),
            optional(bias),
            optional(relative_table),
            optional(sinks),
            spec,
            wanted,
        );
        let constant = constant::<B, C>;
        (
            constant(dq),
            constant(dk),
            constant(dv),
            d_bias.map(constant),
            d_relative.map(constant),
            d_sinks.map(constant),
        )
    }
}
