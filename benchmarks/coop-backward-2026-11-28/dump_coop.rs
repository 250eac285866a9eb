//! Writes the tensor-core family's cooperative builds (f16 inputs) with the constants a 48 KiB,
//! 32-wide-subgroup GPU picks, as gpu-compile-report dumps.
fn main() {
    let out = std::path::PathBuf::from(std::env::args().nth(1).expect("out dir"));
    std::fs::create_dir_all(&out).unwrap();
    // (name prefix, K_TILES, constants)
    let wanted: &[(&str, u32, &[(&str, u32)])] = &[
        ("attention_backward_dkdv_coop_f16", 4, &[("SG", 32), ("NSG", 2), ("BM", 32), ("DK", 64), ("DV", 64)]),
        ("attention_backward_dq_coop_f16", 4, &[("SG", 32), ("NSG", 2), ("BN", 32), ("DK", 64), ("DV", 64)]),
        ("attention_backward_dkdv_coop_f16", 8, &[("SG", 32), ("NSG", 2), ("BM", 16), ("DK", 128), ("DV", 128)]),
        ("attention_backward_dq_coop_f16", 8, &[("SG", 32), ("NSG", 2), ("BN", 16), ("DK", 128), ("DV", 128)]),
        ("attention_forward_coop_f16", 4, &[("SG", 32), ("NSG", 4), ("BN", 64), ("DK", 64), ("DV", 64)]),
        ("attention_forward_coop_f16", 8, &[("SG", 32), ("NSG", 4), ("BN", 32), ("DK", 128), ("DV", 128)]),
    ];
    let all = wgpu_attention::kernels::shaders::all();
    // The tensor-core GEMM (64 x 64 and 128 x 128 tiles, f32 and f16 storage), without and with
    // row sums.
    for name in ["matmul_coop", "matmul_coop_f16", "matmul_coop128", "matmul_coop128_f16"] {
        let (_, source) = all.iter().find(|(n, _)| n == name).expect(name);
        for sums in [0, 1] {
            let label = format!("{name}-ROW_SUMS{sums}");
            std::fs::write(out.join(format!("{label}.wgsl")), source).unwrap();
            std::fs::write(
                out.join(format!("{label}.json")),
                format!("{{\"label\": \"{label}\", \"entry_point\": \"main\", \"constants\": {{\"SG\": 32, \"ROW_SUMS\": {sums}}}, \"runtime_checks\": \"noloop\"}}"),
            )
            .unwrap();
            println!("{label}");
        }
    }
    for (prefix, tiles, constants) in wanted {
        let marker = if prefix.contains("forward") { format!("const Q_TILES: u32 = {tiles}u;") } else { format!("const K_TILES: u32 = {tiles}u;") };
        let (name, source) = all
            .iter()
            .find(|(n, s)| n.starts_with(prefix) && !n.contains("split") && s.contains(&marker) && !s.contains("alias InElem = f32"))
            .unwrap_or_else(|| panic!("{prefix} {tiles}"));
        let label = format!("{name}-D{}", constants.iter().find(|c| c.0 == "DK").unwrap().1);
        let source = source.clone();
        std::fs::write(out.join(format!("{label}.wgsl")), &source).unwrap();
        let c: Vec<String> = constants.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
        std::fs::write(
            out.join(format!("{label}.json")),
            format!("{{\"label\": \"{label}\", \"entry_point\": \"main\", \"constants\": {{{}}}, \"runtime_checks\": \"noloop\"}}", c.join(", ")),
        )
        .unwrap();
        println!("{label}");
    }
}
