//! Ahead-of-time compilation and pipeline dumps: `attention_precompile` and `additive_precompile`
//! build every pipeline the real calls then use (those compile nothing),
//! change no state, and a context with `dump_pipelines` writes each compiled pipeline as a
//! self-contained `<label>.wgsl` + `<label>.json` pair that naga validates and specialises.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use wgpu_attention::kernels::attention::{
    qualify_backward_build, qualify_matrix_build, MatrixBuild,
};
use wgpu_attention::{
    additive_backward, additive_forward, additive_precompile, attention_backward_family,
    attention_backward_into, attention_backward_plan, attention_backward_workspace,
    attention_bias_backward_into, attention_forward_into, attention_forward_plan,
    attention_precompile, attention_sinks_backward_into, AdditiveScores, AttentionOptions,
    AttentionPasses, AttentionShape, BackwardViews, BiasView, Context, DType, ForwardViews,
    GpuTensor, GpuTensorF16, KernelFamily, RelativeBuckets,
};

/// A fresh (emptied) dump directory named `name`.
fn dump_dir(name: &str) -> PathBuf {
    let dir = dump_path(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Where [`dump_dir`] puts the dump named `name`.
fn dump_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "wgpu-attention-{}-dump-{}",
        std::process::id(),
        name.replace('/', "-")
    ))
}

/// The fused kernels' names say their family: `<op>_cpu...` for the CPU-driver family,
/// `<op>_gpu...` and `<op>_coop...` for the others; no other family's build says cpu. f16 runs the
/// GPU family where the context runs the CPU-driver family.
fn check_family_labels(labels: &[String], family: KernelFamily) {
    let fused = [
        "attention_forward",
        "attention_backward_dq",
        "attention_backward_dkdv",
    ];
    let mut cpu = 0;
    for label in labels {
        let op = label.split('-').next().unwrap();
        let family_of = fused
            .iter()
            .find_map(|f| op.strip_prefix(f)?.strip_prefix('_'))
            .and_then(|rest| rest.split('_').next())
            .filter(|family| ["cpu", "gpu", "coop"].contains(family));
        match family_of {
            None => assert!(
                family == KernelFamily::CpuDriver || !label.contains("cpu"),
                "{label}: only CPU-driver builds say cpu"
            ),
            Some("cpu") => cpu += 1,
            Some(_) => assert!(!label.contains("cpu"), "{label}"),
        }
    }
    match family {
        KernelFamily::CpuDriver => assert!(cpu >= 3, "{labels:?}"),
        _ => assert_eq!(cpu, 0, "{labels:?}"),
    }
    // Tensor-core labels say coop, and portable for the portable build (no CI adapter has
    // cooperative matrices).
    let coop: Vec<_> = labels.iter().filter(|l| l.contains("coop")).collect();
    assert_eq!(coop.is_empty(), family != KernelFamily::Coop, "{labels:?}");
    assert!(
        coop.iter().all(|l| l.contains("_coop_portable")),
        "{coop:?}"
    );
}

/// Reads a dump: each pipeline's label, source and constants, after checking the pair is complete,
/// named by its label, and what gpu-compile-report reads; each source is validated by naga with
/// its constants applied, as wgpu compiles it.
fn read_dump(dir: &Path) -> Vec<String> {
    let mut labels = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            assert!(
                path.with_extension("wgsl").exists(),
                "{path:?} has no source"
            );
            continue;
        }
        assert!(path.extension().is_some_and(|e| e == "wgsl"), "{path:?}");
        let stem = path.file_stem().unwrap().to_str().unwrap().to_string();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path.with_extension("json")).unwrap())
                .unwrap();
        assert_eq!(json["label"], stem.as_str());
        assert_eq!(json["entry_point"], "main");
        assert!(
            ["checked", "noloop", "unchecked"].contains(&json["runtime_checks"].as_str().unwrap()),
            "{json}"
        );
        let constants: BTreeMap<String, f64> = json["constants"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_f64().unwrap()))
            .collect();
        for (name, value) in &constants {
            assert!(stem.contains(&format!("-{name}{value}")), "{stem}: {name}");
        }
        let source = std::fs::read_to_string(&path).unwrap();
        let module = naga::front::wgsl::parse_str(&source)
            .unwrap_or_else(|e| panic!("{stem}: {}", e.emit_to_string(&source)));
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{stem}: {e:?}"));
        let constants: naga::back::PipelineConstants = constants.into_iter().collect();
        naga::back::pipeline_constants::process_overrides(
            &module,
            &info,
            Some((naga::ShaderStage::Compute, "main")),
            &constants,
        )
        .unwrap_or_else(|e| panic!("{stem}: {e:?}"));
        labels.push(stem);
    }
    labels.sort();
    labels
}

#[test]
fn precompiled_attention_calls_compile_nothing_and_every_pipeline_is_dumped() {
    let s = AttentionShape {
        batch: 2,
        q_seq: 9,
        kv_seq: 11,
        heads: 4,
        kv_heads: 2,
        // The head dims of the attention tests' masks, modifiers and biases: the pipelines this test
        // checks are the ones they compile (a cold shader cache compiles each once).
        head_dim_qk: 40,
        head_dim_v: 24,
    };
    for family in [
        KernelFamily::CpuDriver,
        KernelFamily::Gpu,
        KernelFamily::Coop,
    ] {
        // The back ends run at once, each dumping into a directory named for it.
        let dir_of = |name: &str| format!("{name}-{}", family.name());
        for_each_backend_with_options(
            |name, opts| {
                opts.kernel_family(family)
                    .dump_pipelines(dump_dir(&dir_of(name)))
            },
            |name, ctx| {
                let dir = dump_path(&dir_of(name));
                // The tensor-core family's portable build is not run on GL.
                if !in_family_matrix(name, family) {
                    let _ = std::fs::remove_dir_all(&dir);
                    return;
                }
                run_precompiled_calls(name, ctx, &s, family);
                let labels = read_dump(&dir);
                assert_eq!(labels.len(), ctx.cached_pipelines(), "{name}: {labels:?}");
                check_family_labels(&labels, family);
                // The options' gradient kernels and the f16 kernels are in the set.
                for wanted in ["attention_bias_backward", "attention_sinks_backward"] {
                    assert!(
                        labels.iter().any(|l| l.starts_with(wanted)),
                        "{name}: {wanted}"
                    );
                }
                assert_eq!(
                    labels.iter().any(|l| l.contains("_f16")),
                    has_f16(ctx),
                    "{name}"
                );
                std::fs::remove_dir_all(&dir).unwrap();
            },
        );
    }
}

fn has_f16(ctx: &Context) -> bool {
    ctx.device().features().contains(wgpu::Features::SHADER_F16)
}

/// Precompiles, then records the real calls: they compile nothing new.
fn run_precompiled_calls(name: &str, ctx: &Context, s: &AttentionShape, family: KernelFamily) {
    let name = format!("{name}/{}", family.name());
    let h = s.heads;
    let bias_t = GpuTensor::zeros(ctx, &[h, s.q_seq, s.kv_seq]).unwrap();
    let bias = BiasView::of(&bias_t).unwrap();
    let sinks = GpuTensor::zeros(ctx, &[h]).unwrap();
    let table = GpuTensor::zeros(ctx, &[h, 8]).unwrap();
    let table_grad = GpuTensor::zeros(ctx, &[h, 8]).unwrap();
    let buckets = RelativeBuckets::new(8, 16, true);
    let with_bias = AttentionOptions::new()
        .causal(true)
        .bias(&bias)
        .sinks(&sinks);
    let with_relative = AttentionOptions::new()
        .softcap(5.0)
        .relative_buckets_learned(buckets, &table, &table_grad);
    let f16 = AttentionOptions::new().window(3, 2);
    let mut cases = vec![(DType::F32, with_bias), (DType::F32, with_relative)];
    if has_f16(ctx) {
        cases.push((DType::F16, f16));
    }
    // What the context reports it runs: the tensor-core family's portable build here (no CI adapter
    // has cooperative matrices), its own backward too.
    let plan = attention_forward_plan(ctx, s).unwrap();
    assert_eq!(plan.family, family, "{name}");
    let portable = (family == KernelFamily::Coop).then_some(MatrixBuild::Portable);
    assert_eq!(plan.matrix, portable, "{name}");
    let backward = family;
    assert_eq!(
        attention_backward_family(ctx, DType::F32),
        backward,
        "{name}"
    );
    let plan = attention_backward_plan(ctx, s, DType::F32).unwrap();
    assert_eq!(
        (plan.family, plan.matrix),
        (family, portable),
        "{name}: {plan}"
    );
    let f16_backward = match family {
        KernelFamily::Coop => KernelFamily::Coop,
        _ => KernelFamily::Gpu,
    };
    assert_eq!(
        attention_backward_family(ctx, DType::F16),
        f16_backward,
        "{name}"
    );
    // The qualifications a device with cooperative matrices runs, here with the portable build.
    if family == KernelFamily::Coop {
        let mismatch = qualify_matrix_build(ctx, MatrixBuild::Portable).unwrap();
        assert_eq!(mismatch, None, "{name}");
        let mismatch = qualify_backward_build(ctx, MatrixBuild::Portable).unwrap();
        assert_eq!(mismatch, None, "{name}");
    }
    let before = ctx.cached_pipelines();
    let mut built = 0;
    for (dtype, opts) in &cases {
        built += attention_precompile(ctx, s, *dtype, opts, AttentionPasses::ForwardBackward)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(built > 0, "{name}");
    assert_eq!(ctx.cached_pipelines(), before + built, "{name}");
    // Again: all cached.
    for (dtype, opts) in &cases {
        let again = attention_precompile(ctx, s, *dtype, opts, AttentionPasses::ForwardBackward);
        assert_eq!(again.unwrap(), 0, "{name}");
    }
    let compiled = ctx.cached_pipelines();
    let heads = |shape: [usize; 4], dtype: DType| match dtype {
        DType::F32 => GpuTensor::zeros(ctx, &shape).unwrap().heads().unwrap(),
        DType::F16 => GpuTensorF16::zeros(ctx, &shape).unwrap().heads().unwrap(),
    };
    for (dtype, opts) in &cases {
        let (dtype, opts) = (*dtype, *opts);
        let q = heads([s.batch, s.q_seq, h, s.head_dim_qk], dtype);
        let k = heads([s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk], dtype);
        let v = heads([s.batch, s.kv_seq, s.kv_heads, s.head_dim_v], dtype);
        let [out, d_out] = [0, 1].map(|_| heads([s.batch, s.q_seq, h, s.head_dim_v], dtype));
        let dq = heads([s.batch, s.q_seq, h, s.head_dim_qk], dtype);
        let dk = heads([s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk], dtype);
        let dv = heads([s.batch, s.kv_seq, s.kv_heads, s.head_dim_v], dtype);
        let lse = GpuTensor::zeros(ctx, &[s.batch, h, s.q_seq]).unwrap();
        let workspace = attention_backward_workspace(ctx, s).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        attention_forward_into(
            ctx,
            &mut encoder,
            &ForwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &lse,
            },
            &opts,
        )
        .unwrap();
        let views = BackwardViews {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &lse,
            d_out: &d_out,
            dq: &dq,
            dk: &dk,
            dv: &dv,
            workspace: &workspace,
        };
        attention_backward_into(ctx, &mut encoder, &views, &opts).unwrap();
        if opts.bias.is_some() {
            let d_bias = GpuTensor::zeros(ctx, &[1, h, s.q_seq, s.kv_seq]).unwrap();
            attention_bias_backward_into(ctx, &mut encoder, &views, &d_bias, &opts).unwrap();
        }
        if let Some(sinks) = opts.sinks {
            let d_sinks = GpuTensor::zeros(ctx, &[h]).unwrap();
            attention_sinks_backward_into(ctx, &mut encoder, s, sinks, &workspace, &d_sinks, &opts)
                .unwrap();
        }
        ctx.queue().submit([encoder.finish()]);
    }
    ctx.synchronize().unwrap();
    assert_eq!(
        ctx.cached_pipelines(),
        compiled,
        "{name}: a real call compiled a pipeline precompile did not"
    );
}

#[test]
fn an_unwritable_dump_directory_never_fails_a_kernel() {
    let file =
        std::env::temp_dir().join(format!("wgpu-attention-{}-not-a-dir", std::process::id()));
    std::fs::write(&file, b"a file, not a directory").unwrap();
    let dump = file.clone();
    for_each_backend_with_options(
        |_, opts| opts.dump_pipelines(dump.join("below")),
        |name, ctx| {
            let x = GpuTensor::from_slice(ctx, &[1.0; 8], &[1, 2, 1, 4]).unwrap();
            let x = x.heads().unwrap();
            let out = wgpu_attention::attention_forward(ctx, &x, &x, &x, &AttentionOptions::new());
            assert!(out.is_ok(), "{name}: {:?}", out.err());
        },
    );
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn precompiled_additive_calls_compile_nothing() {
    let s = AttentionShape {
        batch: 2,
        q_seq: 9,
        kv_seq: 70,
        heads: 2,
        kv_heads: 2,
        head_dim_qk: 12,
        head_dim_v: 8,
    };
    for_each_backend(|name, shared| {
        let ctx = fresh_context(name, shared);
        let opts = AttentionOptions::new().causal(true);
        let built = additive_precompile(&ctx, &s, &opts, AttentionPasses::ForwardBackward).unwrap();
        assert!(built > 0 && built == ctx.cached_pipelines(), "{name}");
        let heads = |seq: usize, dim: usize| {
            GpuTensor::zeros(&ctx, &[s.batch, seq, s.heads, dim])
                .unwrap()
                .heads()
                .unwrap()
        };
        let (a, b, v) = (heads(9, 12), heads(70, 12), heads(70, 8));
        let w = GpuTensor::zeros(&ctx, &[2, 12]).unwrap();
        let bias = GpuTensor::zeros(&ctx, &[2, 12]).unwrap();
        let scores = AdditiveScores { w: &w, bias: &bias };
        let forward = additive_forward(&ctx, &a, &b, &v, scores, &opts).unwrap();
        let d_out = heads(9, 8);
        let out = forward.out.heads().unwrap();
        additive_backward(
            &ctx,
            &ForwardViews {
                q: &a,
                k: &b,
                v: &v,
                out: &out,
                lse: &forward.lse,
            },
            scores,
            &d_out,
            &opts,
        )
        .unwrap();
        ctx.synchronize().unwrap();
        assert_eq!(
            ctx.cached_pipelines(),
            built,
            "{name}: a real call compiled"
        );
    });
}
