//! Every kernel's WGSL source, by name, as its pipelines compile it (headers prepended, before
//! override constants): what `tests/engine/shaders.rs` validates and translates to SPIR-V, MSL, HLSL and
//! GLSL, so a Metal or DX12 error is caught on any machine.

/// Named WGSL sources, as each kernel module lists them.
type Sources = Vec<(&'static str, String)>;

/// The sources of every kernel family, the benchmark's FMA and copy kernels included.
pub fn all() -> Vec<(String, String)> {
    let families: [fn() -> Sources; 13] = [
        super::additive::shader_sources,
        super::matmul::shader_sources,
        super::linear::shader_sources,
        super::layer_norm::shader_sources,
        super::elementwise::shader_sources,
        super::cross_entropy::shader_sources,
        super::optimizer::shader_sources,
        super::embedding::shader_sources,
        super::rope::shader_sources,
        super::kv_cache::shader_sources,
        super::sampling::shader_sources,
        crate::bench::fma::shader_sources,
        crate::bench::copy::shader_sources,
    ];
    let others = families.into_iter().flat_map(|sources| sources());
    super::attention::shader_sources()
        .into_iter()
        .chain(others.map(|(name, source)| (name.to_string(), source)))
        .collect()
}
