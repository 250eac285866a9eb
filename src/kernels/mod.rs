//! GPU kernels: each has a WGSL source in `shaders/`, a host wrapper here and a CPU reference in
//! `reference/` of the same name.

pub mod additive;
pub(crate) mod arguments;
pub mod attention;
pub mod cross_entropy;
pub(crate) mod dispatch;
pub mod elementwise;
pub mod embedding;
pub mod kv_cache;
pub mod layer_norm;
pub mod linear;
pub mod loss_scale;
pub mod matmul;
pub mod matrix;
pub mod optimizer;
pub mod rope;
pub mod sampling;
pub mod shaders;
#[cfg(test)]
pub(crate) mod uniforms;

/// The readable, unique label of kernel `name` specialised with `constants`: the name, then each
/// override constant as `-NAMEvalue` (`sampling-WG256`). What the pipeline is called in wgpu's
/// messages and captures, and the file name of its dump. The fused attention kernels' names say
/// their family and build (`attention::variant`).
pub(crate) fn constants_label(mut name: String, constants: &[(&str, u32)]) -> String {
    for (constant, value) in constants {
        name.push_str(&format!("-{constant}{value}"));
    }
    name
}

/// wgpu's shader runtime checks that kernel `name` goes without when the context trusts its
/// kernels ([`crate::Context::set_trusted_shaders`]), or `None` for all of them. A kernel is listed
/// only where it measured faster without the checks (lavapipe, benchmarks/HISTORY.md "Shader
/// runtime checks"; an NVIDIA H200, BENCHMARKS.md) and its tests run it without them on every shape
/// class they cover; checks that measured no gain stay on. The fused attention kernels state theirs
/// with their key (`attention::variant`).
pub(crate) fn relaxed_runtime_checks(name: &str) -> Option<wgpu::ShaderRuntimeChecks> {
    // The fused additive backward: the clamps on its private arrays (indexed by loop counters
    // bounded by the overrides that size them; the host sizes them from the same Da and Dv and
    // refuses larger ones) cost it 30% on lavapipe. Storage reads and writes index views the host
    // checked against their buffers before recording.
    if name.starts_with("additive_backward_da") || name.starts_with("additive_backward_db") {
        return Some(wgpu::ShaderRuntimeChecks::unchecked());
    }
    // Decode attention without the loop counters (its loops end at bounds from overrides and at
    // the key range of its split, whatever the lengths it reads): on an NVIDIA H200 they cost the
    // in-place kernel 1.6-1.8x and the staged one up to 2.4x (benchmarks/decode-2026-11-28). Index
    // clamps stay: it reads lengths and block ids a caller may rewrite after the host checked them.
    if name == "attention_decode" {
        let mut checks = wgpu::ShaderRuntimeChecks::checked();
        checks.force_loop_bounding = false;
        return Some(checks);
    }
    None
}
