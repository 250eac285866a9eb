//! Writes the GEMM, optimizer and loss-gradient pipelines that mixed precision touched, with the
//! constants their f32 builds use, as gpu-compile-report dumps (for a before/after comparison).
fn main() {
    let out = std::path::PathBuf::from(std::env::args().nth(1).expect("out dir"));
    std::fs::create_dir_all(&out).unwrap();
    let wanted: &[(&str, &[(&str, u32)])] = &[
        ("matmul_strided", &[("ROW_SUMS", 0), ("SKINNY", 0)]),
        ("matmul_strided", &[("ROW_SUMS", 1), ("SKINNY", 0)]),
        ("matmul_strided", &[("ROW_SUMS", 0), ("SKINNY", 1), ("SKINNY_SPLIT", 1), ("K_LANES", 32), ("K_FAST", 1)]),
        ("matmul_strided_f16", &[("ROW_SUMS", 0), ("SKINNY", 0)]),
        ("matmul_wide", &[("ROW_SUMS", 0)]),
        ("matmul_wide", &[("ROW_SUMS", 1)]),
        ("matmul_coop", &[("SG", 32), ("ROW_SUMS", 0)]),
        ("matmul_coop", &[("SG", 32), ("ROW_SUMS", 1)]),
        ("matmul_coop128", &[("SG", 32), ("ROW_SUMS", 1)]),
        ("matmul_coop_f16", &[("SG", 32), ("ROW_SUMS", 0)]),
        ("matmul_coop128_f16", &[("SG", 32), ("ROW_SUMS", 0)]),
        ("adamw", &[("RUN", 4)]),
        ("grad_norm_finalize", &[]),
        ("cross_entropy_backward", &[]),
    ];
    let all = wgpu_attention::kernels::shaders::all();
    for (name, constants) in wanted {
        let (_, source) = all.iter().find(|(n, _)| n == name).expect(name);
        let mut c: Vec<String> = constants.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
        if !name.starts_with("matmul") {
            c.push("\"WG\": 64".to_string());
        }
        let label = format!(
            "{name}{}",
            constants.iter().map(|(k, v)| format!("-{k}{v}")).collect::<String>()
        );
        std::fs::write(out.join(format!("{label}.wgsl")), source).unwrap();
        std::fs::write(
            out.join(format!("{label}.json")),
            format!("{{\"label\": \"{label}\", \"entry_point\": \"main\", \"constants\": {{{}}}}}", c.join(", ")),
        )
        .unwrap();
    }
}
