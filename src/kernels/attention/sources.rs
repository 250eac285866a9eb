//! Every attention shader's source, by name, as its pipelines compile it: what the naga tests
//! validate and translate (with every other kernel's: [`crate::kernels::shaders`]).

use super::backward::BACKWARD_PREPROCESS;
use super::header::{with_common, with_common_typed};
use super::shape::MAX_HEAD_DIM;
use super::unfused::{SOFTMAX, SOFTMAX_BACKWARD};
use super::variant::{
    cpu_family_arrays, FamilyBuild, FusedKernel, FusedVariant, KvWords, QuadReads,
};
use super::{bias, coop, decode, gpu, probs, qk_norm, sinks};
use crate::tensor::DType;

/// Every attention shader with the common header prepended, by name: what the pipelines compile and
/// what the naga tests validate and translate (with every other kernel's: [`crate::kernels::shaders`]).
/// The fused kernels by their key's name (`_vec4` added for the builds reading four elements per
/// access), with the largest array sizes their tests compile.
pub fn shader_sources() -> Vec<(String, String)> {
    [
        ("attention_forward_merge", gpu::FORWARD_MERGE),
        ("attention_backward_dq_store", gpu::DQ_STORE),
        ("attention_backward_preprocess", BACKWARD_PREPROCESS),
        ("attention_softmax", SOFTMAX),
        ("attention_softmax_backward", SOFTMAX_BACKWARD),
        ("attention_sinks", sinks::FORWARD),
        ("attention_sinks_backward", sinks::BACKWARD),
        ("attention_bias_backward", bias::BACKWARD),
        ("attention_probs", probs::SOURCE),
    ]
    .into_iter()
    .map(|(name, body)| (name, with_common(body, true)))
    .chain([
        ("attention_qk_norm", qk_norm::SOURCE.to_string()),
        (
            "attention_forward_merge_f16",
            with_common_typed(gpu::FORWARD_MERGE, DType::F32, DType::F16, true),
        ),
        (
            "attention_backward_dq_store_f16",
            with_common_typed(gpu::DQ_STORE, DType::F32, DType::F16, true),
        ),
        (
            "attention_backward_preprocess_f16",
            with_common_typed(BACKWARD_PREPROCESS, DType::F16, DType::F32, true),
        ),
    ])
    .chain(decode::shader_sources())
    .map(|(name, source)| (name.to_string(), source))
    .chain(fused_variants().into_iter().map(|key| {
        let vec4 = match key.vec4_inputs {
            true => "_vec4",
            false => "",
        };
        (format!("{}{vec4}", key.name()), key.source())
    }))
    .collect()
}

/// The fused kernels' builds the naga tests translate: each family's kernels in every build, dtype
/// and input read the host picks.
fn fused_variants() -> Vec<FusedVariant> {
    use DType::{F16, F32};
    use FusedKernel::{BackwardDkDv, BackwardDq, Forward};
    let mut keys = Vec::new();
    for quads in [QuadReads::Workgroup, QuadReads::Subgroup] {
        for kernel in [Forward, BackwardDq, BackwardDkDv] {
            for vec4_inputs in [false, true] {
                let mut key = FusedVariant::new(kernel, FamilyBuild::Cpu(quads));
                key.arrays = cpu_family_arrays(MAX_HEAD_DIM, (kernel == BackwardDq).then_some(132));
                key.vec4_inputs = vec4_inputs;
                keys.push(key);
            }
        }
    }
    let gpu = |kernel, subgroup_row_max, input, written, vec4_inputs| {
        let mut key = FusedVariant::new(kernel, FamilyBuild::Gpu { subgroup_row_max });
        (key.input, key.written, key.vec4_inputs) = (input, written, vec4_inputs);
        key.arrays = match kernel {
            BackwardDkDv => vec![("MAX_SQ", 4), ("MAX_OCK", 16), ("MAX_OCV", 16)],
            Forward | BackwardDq => vec![("MAX_SK", 4), ("MAX_OC", 16)],
        };
        key
    };
    for subgroups in [false, true] {
        for (input, written) in [(F32, F32), (F16, F16), (F16, F32)] {
            keys.push(gpu(Forward, subgroups, input, written, false));
        }
    }
    keys.push(gpu(Forward, false, F32, F32, true));
    keys.push(gpu(Forward, true, F16, F16, true));
    for (dtype, vec4) in [(F32, false), (F32, true), (F16, false), (F16, true)] {
        keys.push(gpu(BackwardDkDv, false, dtype, dtype, vec4));
        if !(dtype == F16 && vec4) {
            keys.push(gpu(BackwardDq, false, dtype, dtype, vec4));
        }
    }
    // dK/dV adding dQ with f32 atomics (Vulkan and Metal: SHADER_FLOAT32_ATOMIC).
    for dtype in [F32, F16] {
        let mut key = gpu(BackwardDkDv, false, dtype, dtype, true);
        key.dq_sums = true;
        keys.push(key);
    }
    // The forward of prefill-shaped decoding steps: a paged cache's f32 pools read through its
    // block table (both CPU-driver quad reads, the GPU family by element and by vec4), and
    // int8 and f16 caches' words, contiguous and paged.
    for quads in [QuadReads::Workgroup, QuadReads::Subgroup] {
        let mut key = FusedVariant::new(Forward, FamilyBuild::Cpu(quads));
        key.arrays = cpu_family_arrays(MAX_HEAD_DIM, None);
        key.vec4_inputs = quads == QuadReads::Subgroup;
        key.page = 16;
        keys.push(key);
    }
    for vec4 in [false, true] {
        let mut key = gpu(Forward, vec4, F32, F32, vec4);
        key.page = 16;
        keys.push(key);
    }
    for (words, page) in [(KvWords::Int8, 0), (KvWords::F16, 16)] {
        let mut key = FusedVariant::new(Forward, FamilyBuild::Cpu(QuadReads::Workgroup));
        key.arrays = cpu_family_arrays(MAX_HEAD_DIM, None);
        (key.kv_words, key.page) = (Some(words), page);
        keys.push(key);
        let mut key = gpu(Forward, true, F32, F32, false);
        (key.kv_words, key.page) = (Some(words), 16 - page);
        keys.push(key);
    }
    keys.extend(coop::shader_variants());
    keys
}
