//! The op on burn's fusion back end (`Fusion<CubeBackend>`, what burn's default features give a wgpu
//! device): run eagerly. The inputs are resolved to the cubecl tensors under them (which runs the
//! work fusion queued for them), the cubecl implementation records the kernels on the caller's
//! thread (so its refusals stay typed errors), and the finished outputs are handed to fusion through
//! a custom operation whose execution only publishes their handles.

use burn::backend::wgpu::{CubeBackend, CubeTensor};
use burn::backend::TensorMetadata;
use burn_cubecl::fusion::{CubeFusionHandle, FusionCubeRuntime};
use burn_fusion::stream::{Operation, StreamId};
use burn_fusion::{client::GlobalFusionClient as Client, Fusion, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorId, TensorIr, TensorStatus};

use crate::backend::{AttentionGradients, FusedAttentionBackend, OptionalTensor, WantedGrads};
use crate::ScoreSpec;

type Tensor = FusionTensor<FusionCubeRuntime>;

/// Publishes finished cubecl tensors under the ids of a custom operation's outputs.
#[derive(Debug)]
struct Publish {
    outputs: Vec<(TensorId, CubeFusionHandle)>,
}

impl Operation<FusionCubeRuntime> for Publish {
    fn execute(
        &self,
        handles: &mut HandleContainer<CubeFusionHandle>,
    ) -> Result<(), burn_fusion::ExecutionError> {
        for (id, handle) in &self.outputs {
            handles.register_handle(*id, handle.clone());
        }
        Ok(())
    }
}

/// Fusion tensors for `tensors`, in order (none for `None`).
fn publish(
    client: &Client<FusionCubeRuntime>,
    tensors: Vec<Option<CubeTensor>>,
) -> Vec<Option<Tensor>> {
    let present: Vec<CubeTensor> = tensors.iter().flatten().cloned().collect();
    let irs: Vec<TensorIr> = present
        .iter()
        .map(|t| TensorIr {
            id: client.create_empty_handle(),
            shape: t.shape(),
            status: TensorStatus::NotInit,
            dtype: t.dtype,
        })
        .collect();
    let outputs = (irs.iter().map(|ir| ir.id))
        .zip(present.into_iter().map(CubeFusionHandle::from))
        .collect();
    let repr = OperationIr::Custom(CustomOpIr::new("burn_attention_outputs", &[], &irs));
    let mut published = client
        .register(StreamId::current(), repr, Publish { outputs })
        .into_iter();
    tensors
        .into_iter()
        .map(|t| t.map(|_| published.next().expect("one output per tensor")))
        .collect()
}

fn resolve(t: Tensor) -> CubeTensor {
    let client = t.client.clone();
    client.resolve_tensor_float::<CubeBackend>(t)
}

fn resolve_optional(t: OptionalTensor<Fusion<CubeBackend>>) -> OptionalTensor<CubeBackend> {
    OptionalTensor::from_option(t.into_option().map(resolve))
}

impl FusedAttentionBackend for Fusion<CubeBackend> {
    fn fused_attention_forward(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: OptionalTensor<Self>,
        relative_table: OptionalTensor<Self>,
        sinks: OptionalTensor<Self>,
        spec: ScoreSpec,
    ) -> (Tensor, Tensor) {
        let client = q.client.clone();
        let (out, lse) = CubeBackend::fused_attention_forward(
            resolve(q),
            resolve(k),
            resolve(v),
            resolve_optional(bias),
            resolve_optional(relative_table),
            resolve_optional(sinks),
            spec,
        );
        let mut published = publish(&client, vec![Some(out), Some(lse)])
            .into_iter()
            .flatten();
        let out = published.next().expect("published");
        (out, published.next().expect("published"))
    }

    fn fused_attention_backward(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        d_out: Tensor,
        bias: OptionalTensor<Self>,
        relative_table: OptionalTensor<Self>,
        sinks: OptionalTensor<Self>,
        spec: ScoreSpec,
        wanted: WantedGrads,
    ) -> AttentionGradients<Self> {
        let client = q.client.clone();
        let (dq, dk, dv, d_bias, d_relative, d_sinks) = CubeBackend::fused_attention_backward(
            resolve(q),
            resolve(k),
            resolve(v),
            resolve(out),
            resolve(lse),
            resolve(d_out),
            resolve_optional(bias),
            resolve_optional(relative_table),
            resolve_optional(sinks),
            spec,
            wanted,
        );
        let grads = vec![Some(dq), Some(dk), Some(dv), d_bias, d_relative, d_sinks];
        let mut published = publish(&client, grads).into_iter();
        let mut next = || published.next().expect("one per gradient");
        let (dq, dk, dv) = (next(), next(), next());
        (
            dq.expect("dq"),
            dk.expect("dk"),
            dv.expect("dv"),
            next(),
            next(),
            next(),
        )
    }
}
