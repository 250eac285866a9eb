//! GPU kernels: each has a WGSL source in `shaders/`, a host wrapper here and a CPU reference in
//! `reference/` of the same name.

pub(crate) mod arguments;
pub mod attention;
pub mod cross_entropy;
pub(crate) mod dispatch;
pub mod elementwise;
pub mod embedding;
pub mod kv_cache;
pub mod layer_norm;
pub mod linear;
pub mod matmul;
pub mod optimizer;
pub mod rope;
pub mod sampling;
pub mod shaders;

/// The CPU-driver family's fused attention kernels (the GPU family's are the `_tiled` ones).
const CPU_FAMILY_KERNELS: [&str; 3] = [
    "attention_forward",
    "attention_backward_dq",
    "attention_backward_dkdv",
];

/// The readable, unique label of kernel `name` specialised with `constants`: the op's name first,
/// `_cpu` after the CPU-driver family's kernels (and only theirs), then each override constant as
/// `-NAMEvalue` (`attention_forward_tiled_f16-WG128-BM64-BN64-DK64-DV64`). What the pipeline is
/// called in wgpu's messages and captures, and the file name of its dump.
pub(crate) fn pipeline_label(name: &str, constants: &[(&str, u32)]) -> String {
    let mut label = name.to_string();
    if CPU_FAMILY_KERNELS.contains(&name) {
        label.push_str("_cpu");
    }
    for (constant, value) in constants {
        label.push_str(&format!("-{constant}{value}"));
    }
    label
}

/// wgpu's shader runtime checks that kernel `name`, specialised with `constants`, goes without
/// when the context trusts its kernels ([`crate::Context::set_trusted_shaders`]), or `None` for all
/// of them. A kernel is listed
/// only where it measured faster without the checks (lavapipe, benchmarks/HISTORY.md "Shader runtime
/// checks"; an NVIDIA H200, BENCHMARKS.md) and its tests run it without them on every shape class
/// they cover; checks that measured no gain stay on.
pub(crate) fn relaxed_runtime_checks(
    name: &str,
    constants: &[(&str, u32)],
) -> Option<wgpu::ShaderRuntimeChecks> {
    // The fused forwards (both families, f32 and f16): every loop runs to a bound computed from
    // uniforms, overrides and the workgroup id, so none is infinite; the counters wgpu adds to every
    // loop cost them 12-24% on lavapipe. Index clamps stay: dropping them gained nothing more.
    // The fused backward's dQ and dK/dV kernels (both families, f32 and f16) likewise: their key and
    // query loops end at bounds from uniforms (lengths the host checked below 2^31, chunk ranges),
    // and every other loop at an override. On an NVIDIA H200 every kernel without checks ran the
    // GPU-family backward 2.7x faster (B1 H8 D64 L4096: 45.3 -> 16.7 ms, causal 24.4 -> 9.1;
    // benchmarks/h200-2026-11-26/sweep-trusted-*.json), where the forwards had gained 2.8x from the
    // loop counters alone and 4% more from the clamps; on lavapipe neither check cost them anything.
    // Except the GPU family's dQ on 16-key tiles at head dims up to 64 (what 32 KiB of workgroup
    // storage picks there): without counters ACO unrolls its loops to 132-152 VGPRs and spills on
    // gfx1100, where the checked build needs 80-84 (BENCHMARKS.md, RADV); 32-key tiles (48 KiB and
    // more) and head dim 128 need fewer registers without them.
    let constant = |wanted: &str| {
        constants
            .iter()
            .find(|(c, _)| *c == wanted)
            .map(|&(_, v)| v)
    };
    let dq_short_tiles = name.starts_with("attention_backward_dq_tiled")
        && constant("BN").is_some_and(|keys| keys < 32)
        && constant("DK").is_some_and(|dim| dim <= 64);
    // The tensor-core forward (both builds) has the tiled forward's loops: the same holds.
    if (name == "attention_forward"
        || name.starts_with("attention_forward_tiled")
        || name.starts_with("attention_forward_coop")
        || name.starts_with("attention_backward_dq")
        || name.starts_with("attention_backward_dkdv"))
        && !dq_short_tiles
    {
        let mut checks = wgpu::ShaderRuntimeChecks::checked();
        checks.force_loop_bounding = false;
        return Some(checks);
    }
    // The fused additive backward: the clamps on its private arrays (indexed by loop counters
    // bounded by the overrides that size them; the host sizes them from the same Da and Dv and
    // refuses larger ones) cost it 30% on lavapipe. Storage reads and writes index views the host
    // checked against their buffers before recording.
    if name == "additive_backward_da" || name == "additive_backward_db" {
        return Some(wgpu::ShaderRuntimeChecks::unchecked());
    }
    None
}
