//! Fused (and unfused) attention backward on the GPU vs the CPU reference on every back end under
//! test, plus determinism (bitwise identical reruns), exact zeros for fully masked rows, and gradients
//! written into strided views of one packed dQKV buffer.

use crate::common;

use common::*;
use std::sync::Mutex;
use wgpu_attention::kernels::attention::MAX_FUSED_BACKWARD_HEAD_DIM_GPU;
use wgpu_attention::{
    attention_backward, attention_backward_into, attention_backward_plan,
    attention_backward_unfused, attention_backward_workspace, attention_forward, AttentionOptions,
    AttentionShape, BackwardViews, Context, DType, Error, GpuTensor, KernelFamily,
};

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Fused,
    Unfused,
}

struct GpuGrads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    d_sinks: Vec<f32>,
    d_bias: Vec<f32>,
    d_relative: Vec<f32>,
    d_cosine: Vec<f32>,
}

fn run(ctx: &Context, case: &Case, path: Path) -> GpuGrads {
    let [qv, kv, vv, dov] = case.upload(ctx);
    let buffers = case.buffers(ctx);
    let opts = case.options(&buffers);
    let grads = match path {
        Path::Fused => {
            let fwd = attention_forward(ctx, &qv, &kv, &vv, &opts).unwrap();
            attention_backward(ctx, &qv, &kv, &vv, &fwd, &dov, &opts)
        }
        Path::Unfused => attention_backward_unfused(ctx, &qv, &kv, &vv, &dov, &opts),
    }
    .unwrap_or_else(|e| panic!("{}: {e}", case.label()));
    GpuGrads {
        dq: grads.dq.to_vec(ctx).unwrap(),
        dk: grads.dk.to_vec(ctx).unwrap(),
        dv: grads.dv.to_vec(ctx).unwrap(),
        d_sinks: grads.d_sinks.map_or(Vec::new(), |t| t.to_vec(ctx).unwrap()),
        d_bias: grads.d_bias.map_or(Vec::new(), |t| t.to_vec(ctx).unwrap()),
        d_relative: grads
            .d_relative
            .map_or(Vec::new(), |t| t.to_vec(ctx).unwrap()),
        d_cosine: buffers
            .cosine
            .as_ref()
            .map_or(Vec::new(), |(_, g)| g.to_vec(ctx).unwrap()),
    }
}

fn check(backend: &str, ctx: &Context, case: &Case, path: Path) -> GpuGrads {
    // GPU adapters refuse head dims above the fused backward's limit there with a typed error.
    let widest = case.dk.max(case.dv);
    if path == Path::Fused
        && ctx.kernel_family() == KernelFamily::CpuDriver
        && !ctx.is_cpu()
        && widest > MAX_FUSED_BACKWARD_HEAD_DIM_GPU
    {
        let [qv, kv, vv, dov] = case.upload(ctx);
        let buffers = case.buffers(ctx);
        let opts = case.options(&buffers);
        let fwd = attention_forward(ctx, &qv, &kv, &vv, &opts).unwrap();
        let err = attention_backward(ctx, &qv, &kv, &vv, &fwd, &dov, &opts).unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { .. }) && err.to_string().contains("head_dim"),
            "{}: {err}",
            case.label()
        );
        eprintln!(
            "[{backend}] {}: refused on this GPU adapter as documented",
            case.label()
        );
        return GpuGrads {
            dq: Vec::new(),
            dk: Vec::new(),
            dv: Vec::new(),
            d_sinks: Vec::new(),
            d_bias: Vec::new(),
            d_relative: Vec::new(),
            d_cosine: Vec::new(),
        };
    }
    let g = run(ctx, case, path);
    let r = case.reference_backward();
    let tag = format!(
        "[{backend}] {} backward {}",
        if path == Path::Fused {
            "fused"
        } else {
            "unfused"
        },
        case.label()
    );
    assert_eq!(g.d_sinks.len(), r.dsinks.len(), "{tag}: d_sinks");
    // A constant bias has no gradient.
    let d_bias = match case.bias {
        Some(b) if !b.learnable => Vec::new(),
        _ => r.dbias.clone(),
    };
    assert_eq!(g.d_bias.len(), d_bias.len(), "{tag}: d_bias");
    assert_eq!(g.d_relative.len(), r.drelative.len(), "{tag}: d_relative");
    assert_eq!(g.d_cosine.len(), r.dcosine.len(), "{tag}: d_cosine");
    let (atol, rtol) = backward_tolerances(ctx);
    for (name, gpu, reference) in [
        ("dq", &g.dq, &r.dq),
        ("dk", &g.dk, &r.dk),
        ("dv", &g.dv, &r.dv),
        ("d_sinks", &g.d_sinks, &r.dsinks),
        ("d_bias", &g.d_bias, &d_bias),
        ("d_relative", &g.d_relative, &r.drelative),
        ("d_cosine", &g.d_cosine, &r.dcosine),
    ] {
        assert!(
            gpu.iter().all(|x| x.is_finite()),
            "{tag} {name}: NaN or Inf"
        );
        assert_close(&format!("{tag} {name}"), gpu, reference, atol, rtol);
    }
    g
}

/// The file names of a pipeline dump directory, which is removed.
fn dumped_names(dump: &std::path::Path) -> Vec<String> {
    let names = std::fs::read_dir(dump)
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(dump);
    names
}

/// Head dims of the odd-size backward sweep per back end. Each head dim is a fresh compile of every
/// backward kernel of both families (the suite's largest cost on a cold shader cache: 333 s for this
/// test alone with nine and five dims), and GL here is the same llvmpipe as Vulkan. Vulkan runs the
/// odd dims 1 and 33 (one and nine vec4s, the last partly filled) and each GPU-family tile regime at
/// its edge (64, 128, 256); GL the smallest, an odd one and a non-power-of-two inside the first
/// regime (40). The forward tests run every dim on Vulkan (5 and 80 included), up to 64 on GL.
const VULKAN_SWEEP_HEAD_DIMS: [usize; 5] = [1, 33, 64, 128, 256];
const GL_SWEEP_HEAD_DIMS: [usize; 3] = [1, 33, 40];

#[test]
fn odd_sizes_and_head_dims() {
    for_each_family(|backend, ctx| {
        for case in &odd_size_cases() {
            let dims: &[usize] = match backend.starts_with("gl") {
                true => &GL_SWEEP_HEAD_DIMS,
                false => &VULKAN_SWEEP_HEAD_DIMS,
            };
            if !dims.contains(&case.dk) {
                continue;
            }
            check(backend, ctx, case, Path::Fused);
        }
    });
}

/// On a device with WebGPU's default 16 KiB of workgroup storage the GPU-family backward picks tiles
/// that fit (head dims to 128); wider ones get a typed error naming the bytes needed and the limit.
#[test]
fn gpu_family_fits_the_default_workgroup_storage() {
    for_each_backend_with_storage(16384, |backend, ctx| {
        for case in [
            Case::new(1, 19, 23, 2, 1, 40, 24).causal(),
            Case::new(1, 19, 23, 2, 2, 64, 64),
            Case::new(1, 9, 11, 1, 1, 128, 128).causal(),
        ] {
            check(backend, ctx, &case, Path::Fused);
        }
        let wide = Case::new(1, 4, 4, 1, 1, 256, 256);
        let [q, k, v, d_out] = wide.upload(ctx);
        let opts = AttentionOptions::new();
        let e = match attention_forward(ctx, &q, &k, &v, &opts) {
            Ok(fwd) => attention_backward(ctx, &q, &k, &v, &fwd, &d_out, &opts).unwrap_err(),
            Err(e) => e,
        };
        let text = e.to_string();
        assert!(
            text.contains("workgroup storage") && text.contains("16384"),
            "[{backend}] {text}"
        );
    });
}

/// The CPU-driver backward's subgroup build steps several quads (16 staged rows in dK/dV, 8 keys in
/// dQ) at a time; where the workgroup storage holds fewer rows than a step (here 4 KiB at head dim
/// 72: four-row dK/dV and dQ tiles), a step's quads past the tile read inside it and are masked.
/// The workgroup build (GL) steps one quad, so it has no such case and is not run here.
#[test]
fn cpu_family_backward_with_tiles_shorter_than_a_step() {
    for_each_backend_with_storage_and(
        4096,
        |ctx| ctx.set_kernel_family(Some(KernelFamily::CpuDriver)),
        |backend, ctx| {
            if backend.starts_with("gl") {
                return;
            }
            let case = Case::new(2, 13, 21, 2, 1, 72, 72)
                .causal()
                .kv_lens(&[21, 9]);
            check(backend, ctx, &case, Path::Fused);
        },
    );
}

#[test]
fn query_and_key_loops_split_into_accumulated_chunks() {
    for_each_family_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        for case in &split_loop_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn every_workgroup_width_matches_reference() {
    // The defaults are 64 (CPU drivers, GPU forward) and 32 (GPU backward); the narrowest and widest
    // widths an override may pick must give the same gradients.
    for width in [16, 128] {
        // The width override applies to the CPU-driver kernels.
        for_each_backend_with(
            |ctx| {
                ctx.set_kernel_family(Some(KernelFamily::CpuDriver));
                ctx.set_attention_workgroup(Some(width)).unwrap();
            },
            |backend, ctx| {
                // One case with several query and key tiles, causal, padding, GQA and Dk != Dv:
                // every extra width is a fresh shader compile (seconds each on a cold CPU driver).
                let case = Case::new(2, 70, 137, 4, 2, 40, 24)
                    .causal()
                    .kv_lens(&[137, 60]);
                check(&format!("{backend} wg{width}"), ctx, &case, Path::Fused);
            },
        );
    }
}

/// The tensor-core family's own backward (its portable build here: the tiling, masks, modifiers
/// and NaN rules the tensor cores run) against the reference within the family's tolerance:
/// masks, modifiers, windows, sinks and biases (the learned relative table runs the GPU family's
/// dQ), grouped heads, head dims 5 to 128 with Dk != Dv, key loops split into chunks, and the same
/// bits from two runs.
#[test]
fn tensor_core_family_backward() {
    // Two contexts at once, their pipelines disjoint (a cold shader cache compiles each once): the
    // masks, modifiers, windows, sinks and biases at head dims 40/40 and 40/24; the other head dims,
    // then the loops split into chunks.
    let mut at_40 = mask_cases();
    at_40.extend(score_modifier_cases());
    at_40.extend(window_cases());
    at_40.extend(sink_cases());
    at_40.extend(bias_cases());
    at_40.push(Case::new(1, 17, 29, 6, 3, 40, 24));
    let other_dims = [
        Case::new(2, 33, 33, 8, 2, 64, 64),
        Case::new(2, 33, 47, 4, 1, 64, 64).causal(),
        Case::new(2, 9, 13, 2, 1, 5, 5),
        Case::new(1, 129, 97, 2, 2, 128, 128).causal(),
    ];
    let run_cases = |cases: &[Case], reruns: bool| {
        for_tensor_core_family_with(
            |_| {},
            |backend, ctx| {
                for case in cases {
                    check(backend, ctx, case, Path::Fused);
                }
                if reruns {
                    assert_reruns_bitwise(backend, ctx);
                }
            },
        )
    };
    std::thread::scope(|scope| {
        scope.spawn(|| run_cases(&at_40, true));
        run_cases(&other_dims, false);
        for_tensor_core_family_with(
            |ctx| ctx.set_loop_budget(Some(SMALL_LOOP_BUDGET)),
            |backend, ctx| {
                for case in &split_loop_cases() {
                    check(backend, ctx, case, Path::Fused);
                }
            },
        );
    });
}

/// The GPU and tensor-core families' builds with their flags fixed for unmasked and causal calls
/// (on by default on GPUs only, so the other tests here run the builds that read them from the
/// uniform): against the reference, and compiled (the dump names them `FIXED_FLAGS0` and `1`).
#[test]
fn fixed_flag_builds_match_reference() {
    let dump =
        std::env::temp_dir().join(format!("wgpu-attention-fixed-flags-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dump);
    // One shape (its forward and the shared builds compile once), unmasked and causal.
    let cases = [
        Case::new(2, 33, 47, 4, 2, 16, 16),
        Case::new(2, 33, 47, 4, 2, 16, 16).causal(),
    ];
    for_each_forward_family_with_options(
        |opts| opts.fixed_flag_builds(true).dump_pipelines(&dump),
        |backend, ctx| {
            if backend.ends_with("/cpu") {
                return;
            }
            assert!(ctx.fixed_flag_builds());
            for case in &cases {
                check(backend, ctx, case, Path::Fused);
            }
        },
    );
    let names = dumped_names(&dump);
    for family in ["gpu", "coop"] {
        for flags in ["FIXED_FLAGS0", "FIXED_FLAGS1"] {
            assert!(
                names
                    .iter()
                    .any(|n| n.starts_with("attention_backward_dkdv")
                        && n.contains(&format!("_{family}"))
                        && n.contains(flags)),
                "no {family} dK/dV build with {flags}: {names:?}"
            );
        }
    }
}

/// The GPU and tensor-core families' dK/dV kernels adding dQ with f32 atomics
/// (`ContextOptions::atomic_gradients`, where the device has them: lavapipe, not wgpu's GL; the
/// tensor-core family's portable build there): against the reference with grouped heads, ragged
/// tiles, the causal mask and padded rows (whose dQ must be zero), dK and dV still bitwise
/// repeatable, and the dump showing the atomic builds and the store ran instead of the dQ kernel.
#[test]
fn atomic_dq_matches_reference() {
    let dump = std::env::temp_dir().join(format!("wgpu-attention-dqsums-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dump);
    let cases = [
        Case::new(2, 33, 47, 4, 2, 16, 16),
        Case::new(2, 33, 47, 4, 2, 16, 16).causal(),
        Case::new(2, 33, 33, 4, 2, 16, 16)
            .causal()
            .q_lens(&[33, 20])
            .kv_lens(&[33, 20]),
    ];
    let atomic_ran = Mutex::new(false);
    for_each_forward_family_with_options(
        |opts| opts.atomic_gradients(true).dump_pipelines(&dump),
        |backend, ctx| {
            if backend.ends_with("/cpu") {
                return;
            }
            assert_eq!(
                ctx.atomic_gradients(),
                backend.starts_with("vulkan"),
                "{backend}"
            );
            *atomic_ran.lock().unwrap() |= ctx.atomic_gradients();
            let shape = AttentionShape {
                batch: 2,
                q_seq: 33,
                kv_seq: 47,
                heads: 4,
                kv_heads: 2,
                head_dim_qk: 16,
                head_dim_v: 16,
            };
            let plan = attention_backward_plan(ctx, &shape, DType::F32).unwrap();
            assert_eq!(plan.dq_atomic, ctx.atomic_gradients(), "{backend}: {plan}");
            for case in &cases {
                let first = check(backend, ctx, case, Path::Fused);
                let again = run(ctx, case, Path::Fused);
                assert!(
                    first.dk == again.dk && first.dv == again.dv,
                    "{backend}: dK, dV"
                );
            }
        },
    );
    // Under a loop budget the dK/dV dispatches split the query rows into chunks, each adding its
    // rows' dQ terms (lavapipe: the families that add dQ there).
    for_each_backend(|name, shared| {
        for family in [KernelFamily::Gpu, KernelFamily::Coop] {
            let mut ctx = fresh_context_with_options(name, shared, |o| o.atomic_gradients(true));
            if !ctx.atomic_gradients() {
                return;
            }
            ctx.set_kernel_family(Some(family));
            ctx.set_loop_budget(Some(SMALL_LOOP_BUDGET));
            let backend = format!("{name}/{} chunked", family.name());
            for case in [
                Case::new(2, 65, 200, 4, 2, 16, 16).causal(),
                Case::new(1, 200, 200, 4, 1, 16, 16).kv_lens(&[150]),
            ] {
                check(&backend, &ctx, &case, Path::Fused);
            }
        }
    });
    let names = dumped_names(&dump);
    if atomic_ran.into_inner().unwrap() {
        // The tensor-core family's build is `_coop_dqsums` with cooperative matrices, else
        // `_coop_portable_dqsums`.
        for (build, marker) in [
            ("attention_backward_dkdv_gpu", "_dqsums"),
            ("attention_backward_dkdv_coop", "_dqsums"),
            ("attention_backward_dq_store", ""),
        ] {
            assert!(
                names
                    .iter()
                    .any(|n| n.starts_with(build) && n.contains(marker)),
                "no {build} {marker}: {names:?}"
            );
        }
    }
}

#[test]
fn masks_and_their_combinations() {
    for_each_family(|backend, ctx| {
        for case in &mask_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn score_modifiers_softcap_and_alibi() {
    for_each_family(|backend, ctx| {
        for case in &score_modifier_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn attention_sinks_with_their_gradient() {
    for_each_family(|backend, ctx| {
        for case in &sink_cases() {
            check(backend, ctx, case, Path::Fused);
        }
        // Bitwise reproducible, the sink gradient included.
        let case = &sink_cases()[0];
        let (a, b) = (run(ctx, case, Path::Fused), run(ctx, case, Path::Fused));
        assert_eq!(
            (&a.dq, &a.dk, &a.dv, &a.d_sinks),
            (&b.dq, &b.dk, &b.dv, &b.d_sinks),
            "[{backend}] rerun differs"
        );
    });
}

#[test]
fn bias_tensors_and_relative_buckets_with_their_gradients() {
    for_each_family(|backend, ctx| {
        for case in &bias_cases() {
            check(backend, ctx, case, Path::Fused);
        }
        // Bitwise reproducible, the bias and table gradients included.
        for case in [&bias_cases()[1], &bias_cases()[4]] {
            let (a, b) = (run(ctx, case, Path::Fused), run(ctx, case, Path::Fused));
            assert_eq!(
                (&a.dq, &a.dk, &a.dv, &a.d_bias, &a.d_relative),
                (&b.dq, &b.dk, &b.dv, &b.d_bias, &b.d_relative),
                "[{backend}] rerun differs"
            );
        }
    });
}

#[test]
fn cosine_scores_and_key_norm_clipping() {
    for_each_family(|backend, ctx| {
        for case in &qk_norm_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn sliding_windows() {
    for_each_family(|backend, ctx| {
        for case in &window_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
    // Chunked loops and split-KV with a window, softcap, ALiBi and sinks at once, then with a bias
    // and with relative buckets (one set of fresh
    // contexts for all of them: each costs compile time on a cold shader cache); and the unfused
    // baseline, which has windows too.
    for_each_family_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        let case = Case::new(2, 129, 200, 4, 2, 40, 40)
            .causal()
            .window(30, 0)
            .kv_lens(&[200, 90])
            .magnitude(3.0)
            .softcap(4.0)
            .alibi()
            .sinks(&[1.0, 2.0, 0.0, -1.0]);
        check(backend, ctx, &case, Path::Fused);
        // The bias gradient kernel's key splits and member chunks (accumulated) too.
        let bias = BiasCase {
            batch: 1,
            heads: 4,
            learnable: true,
            masked_every: 7,
            strided: false,
        };
        check(backend, ctx, &case.clone().bias(bias), Path::Fused);
        check(backend, ctx, &case.relative(16, 64, true), Path::Fused);
    });
    for_each_backend(|backend, ctx| {
        for case in &window_cases()[..4] {
            check(backend, ctx, case, Path::Unfused);
        }
    });
}

#[test]
fn grouped_and_multi_query_heads_and_distinct_value_dim() {
    for_each_family(|backend, ctx| {
        for case in &grouped_head_cases() {
            // The 256-wide cases cost the CPU-driver family 45-100 s of compile each on a cold
            // cache (one fresh unrolled kernel set per dim pair, 260 s for this test alone): the GPU
            // family runs them on both back ends (2-5 s each), the CPU-driver family the others,
            // and its 256-wide kernels run in the odd-size sweep on Vulkan.
            if ctx.kernel_family() == KernelFamily::CpuDriver && case.dk.max(case.dv) > 128 {
                continue;
            }
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn large_logits_and_temperature() {
    for_each_family(|backend, ctx| {
        check(
            backend,
            ctx,
            &Case::new(1, 65, 65, 2, 2, 64, 64).magnitude(8.0),
            Path::Fused,
        );
        check(
            backend,
            ctx,
            &Case::new(1, 65, 65, 2, 2, 64, 64).magnitude(8.0).causal(),
            Path::Fused,
        );
        check(
            backend,
            ctx,
            &Case::new(1, 33, 33, 2, 1, 40, 40).temperature(0.5),
            Path::Fused,
        );
        check(
            backend,
            ctx,
            &Case::new(1, 33, 33, 2, 1, 40, 40).temperature(3.0).causal(),
            Path::Fused,
        );
    });
}

#[test]
fn fully_masked_rows_have_exactly_zero_gradients() {
    for_each_family(|backend, ctx| {
        // Batch 1 sees no key: all of its dQ, dK, dV are exactly 0.
        let case = Case::new(2, 9, 9, 2, 2, 16, 16).kv_lens(&[9, 0]);
        let g = check(backend, ctx, &case, Path::Fused);
        let half = |x: &[f32]| x[x.len() / 2..].iter().all(|&v| v == 0.0);
        assert!(
            half(&g.dq) && half(&g.dk) && half(&g.dv),
            "[{backend}] masked batch has gradients"
        );
        // Causal with Lq > Lk: the first Lq - Lk query rows see nothing; their dQ rows are 0.
        let case = Case::new(1, 33, 9, 2, 2, 16, 16).causal();
        let g = check(backend, ctx, &case, Path::Fused);
        assert!(g.dq[..(33 - 9) * 2 * 16].iter().all(|&v| v == 0.0));
        // Padded query rows.
        let case = Case::new(2, 9, 9, 2, 2, 16, 16).q_lens(&[3, 0]);
        let g = check(backend, ctx, &case, Path::Fused);
        assert!(g.dq[3 * 2 * 16..9 * 2 * 16].iter().all(|&v| v == 0.0));
        assert!(half(&g.dq) && half(&g.dk) && half(&g.dv));
        // A bias that is -inf everywhere masks every pair: O = 0, lse = -inf, every gradient 0
        // (d_bias included).
        let case = Case::new(2, 9, 9, 2, 2, 16, 16).bias(BiasCase {
            batch: 2,
            heads: 2,
            learnable: true,
            masked_every: 1,
            strided: false,
        });
        let [q, k, v, _] = case.upload(ctx);
        let buffers = case.buffers(ctx);
        let fwd = attention_forward(ctx, &q, &k, &v, &case.options(&buffers)).unwrap();
        assert!(fwd.out.to_vec(ctx).unwrap().iter().all(|&x| x == 0.0));
        assert!(fwd
            .lse
            .to_vec(ctx)
            .unwrap()
            .iter()
            .all(|&x| x == f32::NEG_INFINITY));
        let g = check(backend, ctx, &case, Path::Fused);
        let zero = |x: &[f32]| x.iter().all(|&v| v == 0.0);
        assert!(
            zero(&g.dq) && zero(&g.dk) && zero(&g.dv) && zero(&g.d_bias) && !g.d_bias.is_empty(),
            "[{backend}] a fully -inf bias left gradients"
        );
    });
}

#[test]
fn gradients_are_bitwise_reproducible() {
    for_each_family(assert_reruns_bitwise);
}

/// Two identical backward runs on `ctx` give the same bits (no atomics, fixed summation orders).
fn assert_reruns_bitwise(backend: &str, ctx: &Context) {
    let case = Case::new(2, 129, 97, 4, 2, 40, 24)
        .causal()
        .kv_lens(&[97, 50]);
    let a = run(ctx, &case, Path::Fused);
    let b = run(ctx, &case, Path::Fused);
    for (name, x, y) in [
        ("dq", &a.dq, &b.dq),
        ("dk", &a.dk, &b.dk),
        ("dv", &a.dv, &b.dv),
    ] {
        let same = x
            .iter()
            .zip(y.iter())
            .all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(
            same,
            "[{backend}] {name} differs between two identical runs"
        );
    }
}

/// The dQ and dK/dV kernels compiled without wgpu's loop counters (`Context::trusted_shaders`, the
/// default on a device the context creates) give the bits of the checked builds. Vulkan only (wgpu's
/// GL back end adds no runtime checks either way), GPU family only (the CPU-driver family's kernels
/// drop the counters the same way, and compile slowest on llvmpipe).
#[test]
fn trusted_and_checked_backwards_agree_bitwise() {
    let case = Case::new(2, 70, 45, 4, 2, 40, 24)
        .causal()
        .kv_lens(&[45, 20]);
    let runs = [false, true].map(|trusted| {
        let grads = Mutex::new(Vec::new());
        for_each_family_with(
            |ctx| ctx.set_trusted_shaders(trusted),
            |backend, ctx| {
                if backend == "vulkan/gpu" {
                    let g = run(ctx, &case, Path::Fused);
                    grads.lock().unwrap().push((backend.to_string(), g));
                }
            },
        );
        grads.into_inner().unwrap()
    });
    // Not vacuous: vulkan/gpu ran, unless Vulkan is not under test (or allowed missing).
    let vulkan_tested = std::env::var("WGPU_ATTENTION_TEST_BACKENDS")
        .map_or(true, |v| v.to_lowercase().contains("vulkan"));
    let may_skip = std::env::var("WGPU_ATTENTION_ALLOW_NO_GPU").is_ok_and(|v| v == "1");
    assert!(
        runs[0].len() == 1 || !vulkan_tested || may_skip,
        "vulkan/gpu ran {} times",
        runs[0].len()
    );
    assert_eq!(runs[1].len(), runs[0].len());
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for ((backend, checked), (_, trusted)) in runs[0].iter().zip(&runs[1]) {
        assert_eq!(bits(&checked.dq), bits(&trusted.dq), "[{backend}] dq");
        assert_eq!(bits(&checked.dk), bits(&trusted.dk), "[{backend}] dk");
        assert_eq!(bits(&checked.dv), bits(&trusted.dv), "[{backend}] dv");
    }
}

/// The CPU-driver family's dQ and dK/dV kernels read their staged quads through subgroup broadcasts
/// where the adapter runs subgroups of 8 (lavapipe) and from workgroup memory elsewhere (and with
/// subgroups off): the same bits, both matching the reference.
#[test]
fn cpu_family_subgroup_and_workgroup_quads_agree_bitwise() {
    // The subgroup build steps several quads at a time, the workgroup build one: the same bits.
    // Head dim 33 (rows of 9 vec4s, padded to whole quads; the head-dim sweep's pipelines), the
    // causal diagonal's masked quads, a batch entry's shorter keys, four query heads per kv head.
    let case = Case::new(2, 70, 45, 4, 2, 33, 33)
        .causal()
        .kv_lens(&[45, 20]);
    let runs = [false, true].map(|subgroups| {
        let grads = Mutex::new(Vec::new());
        for_each_backend_with(
            |ctx| {
                ctx.set_kernel_family(Some(KernelFamily::CpuDriver));
                ctx.set_subgroups(subgroups);
            },
            |backend, ctx| {
                let g = check(backend, ctx, &case, Path::Fused);
                grads.lock().unwrap().push((backend.to_string(), g));
            },
        );
        // The back ends ran at once: in the order of their names.
        let mut grads = grads.into_inner().unwrap();
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        grads
    });
    assert_eq!(runs[0].len(), runs[1].len());
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for ((backend, workgroup), (_, subgroup)) in runs[0].iter().zip(&runs[1]) {
        assert_eq!(bits(&workgroup.dq), bits(&subgroup.dq), "[{backend}] dq");
        assert_eq!(bits(&workgroup.dk), bits(&subgroup.dk), "[{backend}] dk");
        assert_eq!(bits(&workgroup.dv), bits(&subgroup.dv), "[{backend}] dv");
    }
}

/// On a device created with WebGPU's default limits (8 storage buffers per stage, 16 KiB of
/// workgroup storage) both families' fused backward runs without a score bias: its kernels bind 8
/// (the score-bias binding is compiled out), and match the reference.
#[test]
fn fused_backward_fits_the_default_storage_buffer_limit() {
    let Some((device, queue)) = vulkan_device_with_default_limits() else {
        eprintln!("no Vulkan adapter: skipped");
        return;
    };
    assert_eq!(device.limits().max_storage_buffers_per_shader_stage, 8);
    let case = Case::new(2, 19, 23, 4, 2, 40, 24)
        .causal()
        .kv_lens(&[23, 9])
        .softcap(5.0);
    for family in FAMILIES {
        let mut ctx = Context::from_device(device.clone(), queue.clone()).unwrap();
        ctx.set_kernel_family(Some(family));
        check(
            &format!("vulkan, 8 buffers/{}", family.name()),
            &ctx,
            &case,
            Path::Fused,
        );
        ctx.synchronize().unwrap();
    }
}

#[test]
fn unfused_backward_matches_reference() {
    for_each_backend(|backend, ctx| {
        let cases = [
            Case::new(1, 33, 33, 2, 2, 40, 40),
            Case::new(2, 7, 33, 4, 2, 64, 24).causal(),
            Case::new(2, 33, 33, 4, 1, 16, 16)
                .q_lens(&[5, 33])
                .kv_lens(&[33, 0]),
            Case::new(1, 129, 65, 2, 2, 80, 80).causal().magnitude(8.0),
        ];
        for case in &cases {
            check(backend, ctx, case, Path::Unfused);
        }
    });
}

#[test]
fn gradients_into_a_packed_dqkv_buffer() {
    for_each_family(|backend, ctx| {
        let (b, l, h, d) = (2, 33, 4, 40);
        let width = 3 * h * d;
        let case = Case::new(b, l, l, h, h, d, d).causal();
        let (q, k, v, d_out) = case.data();
        // Pack q, k, v into one [B, L, 3 * H * D] projection.
        let mut packed = vec![0.0f32; b * l * width];
        for t in 0..b * l {
            let row = &mut packed[t * width..(t + 1) * width];
            row[..h * d].copy_from_slice(&q[t * h * d..(t + 1) * h * d]);
            row[h * d..2 * h * d].copy_from_slice(&k[t * h * d..(t + 1) * h * d]);
            row[2 * h * d..].copy_from_slice(&v[t * h * d..(t + 1) * h * d]);
        }
        let qkv = GpuTensor::from_slice(ctx, &packed, &[b, l, width]).unwrap();
        let (qv, kv, vv) = (
            qkv.split_heads(0, h, d).unwrap(),
            qkv.split_heads(h * d, h, d).unwrap(),
            qkv.split_heads(2 * h * d, h, d).unwrap(),
        );
        let opts = AttentionOptions::new().causal(true);
        let fwd = attention_forward(ctx, &qv, &kv, &vv, &opts).unwrap();
        let dov = upload(ctx, &d_out, [b, l, h, d]);
        let dqkv = GpuTensor::zeros(ctx, &[b, l, width]).unwrap();
        let (dq, dk, dv) = (
            dqkv.split_heads(0, h, d).unwrap(),
            dqkv.split_heads(h * d, h, d).unwrap(),
            dqkv.split_heads(2 * h * d, h, d).unwrap(),
        );
        let shape = AttentionShape::of(&qv, &kv, &vv).unwrap();
        let workspace = attention_backward_workspace(ctx, &shape).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        attention_backward_into(
            ctx,
            &mut encoder,
            &BackwardViews {
                q: &qv,
                k: &kv,
                v: &vv,
                out: &fwd.out.heads().unwrap(),
                lse: &fwd.lse,
                d_out: &dov,
                dq: &dq,
                dk: &dk,
                dv: &dv,
                workspace: &workspace,
            },
            &opts,
        )
        .unwrap();
        ctx.queue().submit([encoder.finish()]);
        let r = case.reference_backward();
        let tag = format!("[{backend}] packed dqkv");
        assert_close(
            &format!("{tag} dq"),
            &dq.to_vec(ctx).unwrap(),
            &r.dq,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
        assert_close(
            &format!("{tag} dk"),
            &dk.to_vec(ctx).unwrap(),
            &r.dk,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
        assert_close(
            &format!("{tag} dv"),
            &dv.to_vec(ctx).unwrap(),
            &r.dv,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
    });
}
