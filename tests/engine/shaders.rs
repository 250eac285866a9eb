//! Every WGSL shader parses and validates with naga, and translates to SPIR-V, MSL (2.4), HLSL (SM 6.2)
//! and GLSL (4.30 core and ES 3.10), so Metal, DX12 and GL compile errors are caught on any machine
//! (the f16 and subgroup variants of the GPU attention family to all but GLSL: wgpu's GL has neither). No GPU needed.

use naga::back::{glsl, hlsl, msl, spv, PipelineConstants};
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// Specialisations to translate: head dims of the grid, including non-multiples of 4.
const HEAD_DIMS: [(f64, f64); 3] = [(64.0, 64.0), (40.0, 24.0), (256.0, 8.0)];

fn constants_for(source: &str, dk: f64, dv: f64) -> PipelineConstants {
    let mut c = PipelineConstants::default();
    if source.contains("override DK:") {
        c.insert("DK".to_string(), dk);
        c.insert("DV".to_string(), dv);
    }
    // The fused additive kernels: score dim DA (packed in vec4s) and value dim DV; the forward's
    // rows in workgroup memory at the head dims where the host puts them there.
    if source.contains("override DA:") {
        c.insert("DA".to_string(), dk.min(128.0));
        c.insert("DV".to_string(), dv);
    }
    // Decode attention over an int8 cache under a tree mask at one of the grid's head dims (the
    // f32 cache at the others).
    if source.contains("override INT8:") && dk == 40.0 {
        c.insert("INT8".to_string(), 1.0);
        c.insert("TREE".to_string(), 1.0);
    }
    // Paged K and V (decode, and the forward builds named `_paged`): blocks of 16 rows at the
    // first head dims, 5 at the second; contiguous at the third.
    if source.contains("override PAGE:") && dk <= 64.0 {
        c.insert("PAGE".to_string(), if dk == 64.0 { 16.0 } else { 5.0 });
    }
    // The forward over a cache's words: int8 at one of the grid's head dims (f16 at the others;
    // the host builds int8 where KV_INT8 = 1).
    if source.contains("override KV_INT8:") && dk == 40.0 {
        c.insert("KV_INT8".to_string(), 1.0);
    }
    // The fused additive backward with its rows over lanes, as on GPUs.
    if source.contains("fn row_sum(") && dk <= 64.0 {
        c.insert("LANES".to_string(), if dk == 64.0 { 8.0 } else { 4.0 });
    }
    if source.contains("override OWN_IN_WORKGROUP:") && dk <= 64.0 {
        c.insert("OWN_IN_WORKGROUP".to_string(), 1.0);
    }
    c
}

#[test]
fn every_shader_validates_and_translates_to_all_back_ends() {
    let sources = wgpu_attention::kernels::shaders::all();
    assert!(sources.len() >= 8);
    let mut translated_coop = 0;
    for (name, source) in &sources {
        let module = naga::front::wgsl::parse_str(source)
            .unwrap_or_else(|e| panic!("{name}: WGSL parse error:\n{}", e.emit_to_string(source)));
        for (caps_name, caps) in [
            ("all", Capabilities::all()),
            ("metal", msl::supported_capabilities()),
        ] {
            let info = Validator::new(ValidationFlags::all(), caps)
                .validate(&module)
                .unwrap_or_else(|e| {
                    panic!(
                        "{name}: validation ({caps_name}) failed:\n{}",
                        e.emit_to_string(source)
                    )
                });
            if caps_name != "all" {
                continue;
            }
            for (dk, dv) in HEAD_DIMS {
                let constants = constants_for(source, dk, dv);
                let (module, info) = naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    Some((naga::ShaderStage::Compute, "main")),
                    &constants,
                )
                .unwrap_or_else(|e| panic!("{name}: overrides: {e:?}"));
                let tag = format!("{name} (DK {dk}, DV {dv})");

                let words = spv::write_vec(&module, &info, &spv::Options::default(), None)
                    .unwrap_or_else(|e| panic!("{tag}: SPIR-V: {e}"));
                assert!(words.len() > 5);

                // f32 atomics (the dK/dV build that adds dQ) need MSL 3.0; wgpu offers them on
                // Vulkan and Metal only (SHADER_FLOAT32_ATOMIC), so no HLSL or GLSL below.
                let float_atomics = name.contains("_dqsums");
                let msl_options = msl::Options {
                    lang_version: if float_atomics { (3, 0) } else { (2, 4) },
                    ..Default::default()
                };
                let msl_pipeline = msl::PipelineOptions {
                    entry_point: Some((naga::ShaderStage::Compute, "main".into())),
                    ..Default::default()
                };
                let (msl_src, _) = msl::write_string(&module, &info, &msl_options, &msl_pipeline)
                    .unwrap_or_else(|e| panic!("{tag}: MSL: {e}"));
                assert!(msl_src.contains("kernel"));

                // naga writes cooperative matrices to SPIR-V and MSL only (Vulkan and Metal are
                // where tensor cores are reachable through wgpu).
                if name.contains("_coop") && !name.contains("portable") {
                    // OpCapability CooperativeMatrixKHR (6022), and Metal's simdgroup matrices.
                    let capability = words.windows(2).any(|w| w == [(2 << 16) | 17, 6022]);
                    assert!(capability, "{tag}: no cooperative matrices in the SPIR-V");
                    assert!(
                        msl_src.contains("simdgroup"),
                        "{tag}: no simdgroup matrices in MSL"
                    );
                    translated_coop += 1;
                    continue;
                }
                if float_atomics {
                    assert!(
                        msl_src.contains("atomic_fetch_add"),
                        "{tag}: no atomics in MSL"
                    );
                    continue;
                }
                let hlsl_options = hlsl::Options {
                    shader_model: hlsl::ShaderModel::V6_2,
                    ..Default::default()
                };
                let hlsl_pipeline = hlsl::PipelineOptions {
                    entry_point: Some((naga::ShaderStage::Compute, "main".into())),
                };
                let mut hlsl_src = String::new();
                hlsl::Writer::new(&mut hlsl_src, &hlsl_options, &hlsl_pipeline)
                    .write(&module, &info, None)
                    .unwrap_or_else(|e| panic!("{tag}: HLSL: {e}"));
                assert!(hlsl_src.contains("numthreads"));

                // GL has no f16 and wgpu's GL back end no subgroups: those variants (mixed
                // precision's included) never run there.
                let gl_less = name.contains("_f16")
                    || name.contains("_mixed")
                    || name.starts_with("cast_f16")
                    || name.contains("subgroup");
                let glsl_versions = match gl_less {
                    true => vec![],
                    false => vec![glsl::Version::Desktop(430), glsl::Version::new_gles(310)],
                };
                for version in glsl_versions {
                    let glsl_options = glsl::Options {
                        version,
                        ..Default::default()
                    };
                    let glsl_pipeline = glsl::PipelineOptions {
                        shader_stage: naga::ShaderStage::Compute,
                        entry_point: "main".into(),
                        multiview: None,
                    };
                    let mut glsl_src = String::new();
                    glsl::Writer::new(
                        &mut glsl_src,
                        &module,
                        &info,
                        &glsl_options,
                        &glsl_pipeline,
                        naga::proc::BoundsCheckPolicies::default(),
                    )
                    .and_then(|mut w| w.write())
                    .unwrap_or_else(|e| panic!("{tag}: GLSL {version:?}: {e}"));
                    assert!(glsl_src.contains("local_size_x"));
                }
            }
        }
    }
    // The tensor-core builds at every head dim: the forward's six (f32, f16, f16 split, f16 read
    // four elements per access, f32 reading a paged cache, and an int8 cache's words), each
    // backward kernel's three (f32, f16, f16 with vec4 reads) and dK/dV's with the dQ sums, and
    // the GEMM's six (64 x 64 and 128 x 128 tiles; f32, f16 and mixed precision's f16 B storage).
    assert_eq!(translated_coop, (6 + 2 * 3 + 1 + 6) * HEAD_DIMS.len());
}
