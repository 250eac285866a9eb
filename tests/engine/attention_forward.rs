//! Fused (and unfused) attention forward on the GPU vs the CPU reference, on every back end under
//! test: odd sizes, every mask and their combinations, GQA/MQA, Dk != Dv, large logits, fully masked
//! rows, strided views, permutation properties and the 65535-workgroup dispatch limit.

use crate::common;

use common::*;
use std::sync::Mutex;
use wgpu_attention::reference::attention as reference;
use wgpu_attention::{
    attention_forward, attention_forward_into, attention_forward_plan, attention_forward_unfused,
    attention_probabilities, AttentionOptions, Context, ContextOptions, Error, ForwardViews,
    GpuTensor, KernelFamily,
};

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Fused,
    Unfused,
}

/// Runs `case` on the GPU and compares O and lse with the reference. Returns (O, lse) from the GPU.
fn check(backend: &str, ctx: &Context, case: &Case, path: Path) -> (Vec<f32>, Vec<f32>) {
    let [qv, kv, vv, _] = case.upload(ctx);
    let buffers = case.buffers(ctx);
    let opts = case.options(&buffers);
    let fwd = match path {
        Path::Fused => attention_forward(ctx, &qv, &kv, &vv, &opts),
        Path::Unfused => attention_forward_unfused(ctx, &qv, &kv, &vv, &opts),
    }
    .unwrap_or_else(|e| panic!("{}: {e}", case.label()));
    let out = fwd.out.to_vec(ctx).unwrap();
    let lse = fwd.lse.to_vec(ctx).unwrap();
    let (ref_out, ref_lse) = case.reference_forward();
    let (atol, rtol) = match path {
        // The tensor-core family's f16 rounding of Q and K moves each score by up to |s| 2^-10:
        // its tolerance grows with the inputs' magnitude (scores of order magnitude^2).
        Path::Fused if ctx.kernel_family() == KernelFamily::Coop => {
            let (atol, rtol) = forward_tolerances(ctx);
            let growth = f64::from(case.magnitude.max(1.0));
            (atol * growth, rtol * growth)
        }
        Path::Fused => forward_tolerances(ctx),
        Path::Unfused => (FORWARD_ATOL, FORWARD_RTOL),
    };
    let tag = format!(
        "[{backend}] {} forward {}",
        if path == Path::Fused {
            "fused"
        } else {
            "unfused"
        },
        case.label()
    );
    assert_close(&format!("{tag} out"), &out, &ref_out, atol, rtol);
    assert_close(&format!("{tag} lse"), &lse, &ref_lse, atol, rtol);
    (out, lse)
}

/// Every head dim on Vulkan; on GL up to 64 (the wider kernels are the same WGSL, and their GLSL is
/// checked by the shader translation test): each wide pipeline of the CPU-driver family costs tens
/// of seconds of compile on a cold shader cache.
#[test]
fn odd_sizes_and_head_dims() {
    for_each_forward_family(|backend, ctx| {
        for case in &odd_size_cases() {
            if backend.starts_with("gl") && case.dk > 64 {
                continue;
            }
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn key_loop_split_into_merged_chunks() {
    for_each_forward_family_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        for case in &split_loop_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn masks_and_their_combinations() {
    for_each_forward_family(|backend, ctx| {
        for case in &mask_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn score_modifiers_softcap_and_alibi() {
    for_each_forward_family(|backend, ctx| {
        for case in &score_modifier_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn attention_sinks() {
    for_each_forward_family(|backend, ctx| {
        for case in &sink_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn bias_tensors_and_relative_buckets() {
    for_each_forward_family(|backend, ctx| {
        for case in &bias_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn cosine_scores_and_key_norm_clipping() {
    for_each_forward_family(|backend, ctx| {
        for case in &qk_norm_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn sliding_windows() {
    for_each_forward_family(|backend, ctx| {
        for case in &window_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
    // Chunked loops and split-KV with a window, softcap, ALiBi and sinks at once (one set of fresh
    // contexts for all of them: each costs compile time on a cold shader cache); and the unfused
    // baseline, which has windows too.
    for_each_forward_family_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        let case = Case::new(2, 129, 200, 4, 2, 40, 40)
            .causal()
            .window(30, 0)
            .kv_lens(&[200, 90])
            .magnitude(3.0)
            .softcap(4.0)
            .alibi()
            .sinks(&[1.0, 2.0, 0.0, -1.0]);
        check(backend, ctx, &case, Path::Fused);
    });
    for_each_backend(|backend, ctx| {
        for case in &window_cases()[..4] {
            check(backend, ctx, case, Path::Unfused);
        }
    });
}

#[test]
fn grouped_and_multi_query_heads_and_distinct_value_dim() {
    for_each_forward_family(|backend, ctx| {
        for case in &grouped_head_cases() {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn large_logits_and_temperature() {
    for_each_forward_family(|backend, ctx| {
        // Inputs of magnitude 8 with D = 64: |s| reaches well above 80, where exp overflows f32.
        let case = Case::new(1, 65, 65, 2, 2, 64, 64).magnitude(8.0);
        let (q, k, _, _) = case.data();
        let s = case.shape();
        let mut max_score = 0.0f64;
        for i in 0..s.q_seq {
            for j in 0..s.kv_seq {
                let dot: f64 = (0..64)
                    .map(|c| q[i * 128 + c] as f64 * k[j * 128 + c] as f64)
                    .sum();
                max_score = max_score.max((dot * case.scale() as f64).abs());
            }
        }
        assert!(
            max_score > 80.0,
            "test data must reach |s| > 80, got {max_score}"
        );
        check(backend, ctx, &case, Path::Fused);
        check(backend, ctx, &case.clone().causal(), Path::Fused);
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

/// Scores that rise along the keys by far more than the tensor-core family's rescale bound per key
/// tile (every tile moves the rows' reference maxima and rescales O), and the same keys falling
/// (only the first tile sets them). Inputs exact in f16, so every family meets its own tolerance
/// at scores up to about 100.
#[test]
fn scores_rising_and_falling_across_key_tiles() {
    for_each_forward_family(|backend, ctx| {
        let (lq, lk, h, d) = (33, 200, 2, 32);
        let case = Case::new(1, lq, lk, h, h, d, d);
        // Row slopes 0.25 to 1 (multiples of 1/4); key j's level j / 16 (multiples of 1/16).
        let q: Vec<f32> = (0..lq * h * d)
            .map(|e| 0.25 * (1 + (e / (h * d)) % 4) as f32)
            .collect();
        let v = random(&mut rng(5), lk * h * d, 1.0);
        for rising in [true, false] {
            let k: Vec<f32> = (0..lk * h * d)
                .map(|e| {
                    let j = e / (h * d);
                    let level = if rising { j } else { lk - j } as f32 / 16.0;
                    level * (1.0 + 0.25 * (e % 4) as f32)
                })
                .collect();
            let views = [(&q, lq), (&k, lk), (&v, lk)].map(|(x, l)| upload(ctx, x, [1, l, h, d]));
            let opts = AttentionOptions::new();
            let fwd = attention_forward(ctx, &views[0], &views[1], &views[2], &opts).unwrap();
            let (ref_out, ref_lse) = reference::attention_forward(
                &case.shape(),
                &to_f64(&q),
                &to_f64(&k),
                &to_f64(&v),
                &case.masks(),
            );
            let max_score = ref_lse.iter().fold(0.0f64, |m, x| m.max(*x));
            assert!(max_score > 90.0, "scores must reach 90, got {max_score}");
            let (atol, rtol) = forward_tolerances(ctx);
            let tag = format!("[{backend}] rising {rising}");
            let out = fwd.out.to_vec(ctx).unwrap();
            assert_close(&format!("{tag} out"), &out, &ref_out, atol, rtol);
            let lse = fwd.lse.to_vec(ctx).unwrap();
            assert_close(&format!("{tag} lse"), &lse, &ref_lse, atol, rtol);
        }
    });
}

/// The tensor-core forward's shape override (`ContextOptions::coop_forward_shape`): a shape that
/// fits is what the plan names and runs (one group on 16-key tiles: a shape the defaults never pick
/// on a CPU driver), one that cannot run is ignored for the default.
#[test]
fn coop_forward_shape_override() {
    let forcing = |shape| {
        move |_: &str, mut opts: ContextOptions| {
            opts.kernel_family = Some(KernelFamily::Coop);
            opts.coop_forward_shape = Some(shape);
            opts
        }
    };
    for_each_backend_with_options(forcing((1, 16)), |backend, ctx| {
        let case = Case::new(1, 37, 53, 2, 2, 24, 24).causal().magnitude(2.0);
        let plan = attention_forward_plan(ctx, &case.shape()).unwrap();
        assert_eq!((plan.block_m, plan.block_n), (16, 16), "[{backend}] {plan}");
        check(backend, ctx, &case, Path::Fused);
    });
    for_each_backend_with_options(forcing((3, 64)), |backend, ctx| {
        let plan = attention_forward_plan(ctx, &Case::new(1, 37, 53, 2, 2, 24, 24).shape());
        assert_ne!(plan.unwrap().block_m, 48, "[{backend}]");
    });
}

#[test]
fn fully_masked_rows_are_zero_with_lse_minus_inf() {
    for_each_forward_family(|backend, ctx| {
        let cases = [
            // Batch 1 has no valid key at all.
            Case::new(2, 9, 9, 2, 2, 16, 16).kv_lens(&[9, 0]),
            // Causal with Lq > Lk: the first Lq - Lk rows see no key.
            Case::new(1, 33, 9, 2, 2, 16, 16).causal(),
            // Padded query rows.
            Case::new(2, 9, 9, 2, 2, 16, 16).q_lens(&[3, 0]),
        ];
        for case in &cases {
            let (out, lse) = check(backend, ctx, case, Path::Fused);
            assert!(out.iter().all(|x| x.is_finite()));
            assert!(lse.contains(&f32::NEG_INFINITY), "{}", case.label());
        }
        // Exact zeros for the rows that see nothing.
        let case = Case::new(2, 9, 9, 2, 2, 16, 16).kv_lens(&[9, 0]);
        let (out, _) = check(backend, ctx, &case, Path::Fused);
        assert!(out[9 * 2 * 16..].iter().all(|&x| x == 0.0));
    });
}

#[test]
fn unfused_path_matches_reference() {
    for_each_backend(|backend, ctx| {
        let cases = [
            Case::new(1, 33, 33, 2, 2, 40, 40),
            Case::new(2, 7, 33, 4, 2, 64, 24).causal(),
            Case::new(2, 33, 33, 2, 1, 16, 16)
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
fn packed_qkv_views_and_strided_output() {
    // `lead` columns before Q in each packed row: with 1, no row starts on a four-element boundary
    // and the GPU family reads Q, K and V element by element, with 0 four elements per access.
    for_each_forward_family(|backend, ctx| {
        for lead in [0, 1] {
            let (b, l, h, d) = (2, 33, 4, 40);
            let width = lead + 3 * h * d;
            let mut r = rng(11);
            let packed = random(&mut r, b * l * width, 1.0);
            let qkv = GpuTensor::from_slice(ctx, &packed, &[b, l, width]).unwrap();
            let q = qkv.split_heads(lead, h, d).unwrap();
            let k = qkv.split_heads(lead + h * d, h, d).unwrap();
            let v = qkv.split_heads(lead + 2 * h * d, h, d).unwrap();
            // Output into the middle of a wider buffer: [B, L, 2 * H * D], columns H*D.. .
            let out_buf = GpuTensor::zeros(ctx, &[b, l, 2 * h * d]).unwrap();
            let out = out_buf.split_heads(h * d, h, d).unwrap();
            let lse = GpuTensor::zeros(ctx, &[b, h, l]).unwrap();
            let opts = AttentionOptions::new().causal(true);
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
            ctx.queue().submit([encoder.finish()]);

            let unpack = |col: usize| -> Vec<f64> {
                let mut x = Vec::new();
                for row in packed.chunks(width) {
                    x.extend(row[col..col + h * d].iter().map(|&v| v as f64));
                }
                x
            };
            let case = Case::new(b, l, l, h, h, d, d).causal();
            let (ref_out, ref_lse) = reference::attention_forward(
                &case.shape(),
                &unpack(lead),
                &unpack(lead + h * d),
                &unpack(lead + 2 * h * d),
                &case.masks(),
            );
            let tag = format!("[{backend}] packed qkv, lead {lead}");
            let (atol, rtol) = forward_tolerances(ctx);
            assert_close(
                &format!("{tag} out"),
                &out.to_vec(ctx).unwrap(),
                &ref_out,
                atol,
                rtol,
            );
            assert_close(
                &format!("{tag} lse"),
                &lse.to_vec(ctx).unwrap(),
                &ref_lse,
                atol,
                rtol,
            );
            // The untouched half of the output buffer is still zero.
            let all = out_buf.to_vec(ctx).unwrap();
            assert!(all
                .chunks(2 * h * d)
                .all(|row| row[..h * d].iter().all(|&x| x == 0.0)));
        }
    });
}

#[test]
fn permutation_properties() {
    for_each_forward_family(|backend, ctx| {
        let case = Case::new(1, 33, 47, 2, 2, 40, 24);
        let (q, k, v, _) = case.data();
        let run = |q: &[f32], k: &[f32], v: &[f32]| {
            let qv = upload(ctx, q, [1, case.lq, 2, case.dk]);
            let kv = upload(ctx, k, [1, case.lk, 2, case.dk]);
            let vv = upload(ctx, v, [1, case.lk, 2, case.dv]);
            let f = attention_forward(ctx, &qv, &kv, &vv, &AttentionOptions::new()).unwrap();
            f.out.to_vec(ctx).unwrap()
        };
        let base = run(&q, &k, &v);
        let (atol, rtol) = forward_tolerances(ctx);
        // Permute keys and values together (a fixed pseudo-random permutation of rows).
        let perm: Vec<usize> = (0..case.lk).map(|j| (j * 17 + 5) % case.lk).collect();
        let permute = |x: &[f32], rows: &[usize], width: usize| -> Vec<f32> {
            rows.iter()
                .flat_map(|&r| x[r * width..(r + 1) * width].to_vec())
                .collect()
        };
        let kp = permute(&k, &perm, 2 * case.dk);
        let vp = permute(&v, &perm, 2 * case.dv);
        let out_kv = run(&q, &kp, &vp);
        let w = assert_close(
            &format!("[{backend}] key/value permutation"),
            &out_kv,
            &to_f64(&base),
            atol,
            rtol,
        );
        // Only the order of f32 sums changes (the tensor-core family also rounds P against another
        // running max).
        assert!(w.abs < atol.min(1e-5) || ctx.kernel_family() == KernelFamily::Coop);
        // Permuting queries permutes the output rows.
        let qperm: Vec<usize> = (0..case.lq).map(|i| (i * 7 + 3) % case.lq).collect();
        let out_q = run(&permute(&q, &qperm, 2 * case.dk), &k, &v);
        let expected = permute(&base, &qperm, 2 * case.dv);
        assert_close(
            &format!("[{backend}] query permutation"),
            &out_q,
            &to_f64(&expected),
            atol,
            rtol,
        );
    });
}

/// (case label, O, lse) of fused forwards, per backend (and family) and case.
type Outputs = Vec<(String, Vec<f32>, Vec<f32>)>;

/// Checks the fused forward of every case against the reference and records its outputs (the back
/// ends run at once: `results` is sorted by label when read).
fn record_fused(results: &Mutex<Outputs>, backend: &str, ctx: &Context, cases: &[Case]) {
    for case in cases {
        let (out, lse) = check(backend, ctx, case, Path::Fused);
        let label = format!("[{backend}] {}", case.label());
        results.lock().unwrap().push((label, out, lse));
    }
}

/// The two settings' runs of the same cases give the same bits.
fn assert_same_bits(first: &Mutex<Outputs>, second: &Mutex<Outputs>) {
    let sorted = |runs: &Mutex<Outputs>| {
        let mut runs = std::mem::take(&mut *runs.lock().unwrap());
        runs.sort_by(|a, b| a.0.cmp(&b.0));
        runs
    };
    let (first, second) = (sorted(first), sorted(second));
    assert_eq!(first.len(), second.len());
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (a, b) in first.iter().zip(&second) {
        assert_eq!(a.0, b.0);
        assert_eq!(bits(&b.1), bits(&a.1), "{} out", b.0);
        assert_eq!(bits(&b.2), bits(&a.2), "{} lse", b.0);
    }
}

/// The GPU family's row-group maxima by subgroup shuffles (where the adapter has a fixed subgroup
/// size: lavapipe's 8) and through workgroup memory give the same bits, both matching the reference.
#[test]
fn subgroup_and_workgroup_row_maxima_agree_bitwise() {
    let cases = [
        Case::new(1, 37, 130, 4, 2, 40, 24),
        Case::new(1, 64, 64, 1, 1, 64, 64),
        Case::new(1, 64, 64, 1, 1, 64, 64).causal(),
        Case::new(2, 70, 90, 2, 2, 64, 64)
            .causal()
            .kv_lens(&[90, 33]),
    ];
    let runs = [false, true].map(|subgroups| {
        let results = Mutex::new(Outputs::new());
        for_each_backend_with(
            |ctx| {
                ctx.set_kernel_family(Some(KernelFamily::Gpu));
                ctx.set_subgroups(subgroups);
            },
            |backend, ctx| {
                if subgroups {
                    println!("[{backend}] subgroup size {:?}", ctx.subgroup_size());
                } else {
                    assert_eq!(ctx.subgroup_size(), None);
                }
                record_fused(&results, backend, ctx, &cases);
            },
        );
        results
    });
    assert_same_bits(&runs[0], &runs[1]);
}

/// The CPU-driver family's staged quads read through subgroup broadcasts (where the adapter runs
/// subgroups of 8: lavapipe) and from workgroup memory give the same bits, both matching the
/// reference; the plan says which build ran.
#[test]
fn cpu_family_subgroup_and_workgroup_quads_agree_bitwise() {
    let cases = [
        // Rows of 9 (Dk 36) and 5 (Dv 20) vec4s, padded to whole quads; 130 keys end in a partial
        // tile whose last two keys go one by one.
        Case::new(1, 37, 130, 4, 2, 36, 20),
        // The diagonal's quads that some rows mask; a batch entry's shorter keys.
        Case::new(2, 70, 90, 2, 2, 64, 64)
            .causal()
            .kv_lens(&[90, 33]),
    ];
    let runs = [false, true].map(|subgroups| {
        let results = Mutex::new(Outputs::new());
        for_each_backend_with(
            |ctx| {
                ctx.set_kernel_family(Some(KernelFamily::CpuDriver));
                ctx.set_subgroups(subgroups);
            },
            |backend, ctx| {
                let plan = attention_forward_plan(ctx, &cases[0].shape()).unwrap();
                let expected = subgroups && ctx.subgroup_size() == Some(8);
                assert_eq!(plan.subgroups, expected, "[{backend}] {plan}");
                println!("[{backend}] {plan}");
                record_fused(&results, backend, ctx, &cases);
            },
        );
        results
    });
    assert_same_bits(&runs[0], &runs[1]);
}

/// The forwards compiled without wgpu's loop-bounding counters (`Context::trusted_shaders`, on by
/// default, so every other test runs them so) give the bits of the fully checked ones.
#[test]
fn trusted_and_checked_forwards_agree_bitwise() {
    let cases = [
        Case::new(1, 37, 130, 4, 2, 40, 24),
        Case::new(2, 70, 90, 2, 2, 64, 64)
            .causal()
            .kv_lens(&[90, 33]),
    ];
    let runs = [false, true].map(|trusted| {
        let results = Mutex::new(Outputs::new());
        for_each_family_with(
            |ctx| ctx.set_trusted_shaders(trusted),
            |backend, ctx| record_fused(&results, backend, ctx, &cases),
        );
        results
    });
    assert_same_bits(&runs[0], &runs[1]);
}

/// On a device with WebGPU's default 16 KiB of workgroup storage the GPU-family forward picks tiles
/// that fit, up to head dim 256.
#[test]
fn gpu_family_forward_fits_the_default_workgroup_storage() {
    for_each_backend_with_storage(16384, |backend, ctx| {
        check(
            backend,
            ctx,
            &Case::new(1, 9, 13, 2, 1, 256, 200).causal(),
            Path::Fused,
        );
    });
}

#[test]
fn dispatch_beyond_the_workgroups_per_dimension() {
    // A device that allows 128 workgroups per dimension (ContextOptions): the grid has rows of 128
    // and a partly used last one, as 65535 would have on any adapter, at 300 workgroups instead of
    // 70 000 (which took 49 s on lavapipe and llvmpipe, warm). The smallest workgroups of the GPU
    // and tensor-core families: one query block per (batch, head).
    let small_grid = |opts: ContextOptions| {
        let mut opts = opts.max_workgroups_per_dimension(128);
        opts.tiled_shapes[0] = Some((32, 16, 8));
        opts.coop_forward_shape = Some((1, 16));
        opts
    };
    for_each_forward_family_with_options(small_grid, |backend, ctx| {
        assert_eq!(ctx.limits().max_compute_workgroups_per_dimension, 128);
        // B * H = 300 (batch, head) pairs with one query block each: a grid of 128 x 3.
        let case = Case::new(3, 2, 3, 100, 100, 4, 4);
        check(backend, ctx, &case, Path::Fused);
        // More workgroups than 128 x 128: a typed error, nothing dispatched.
        let over = Case::new(1, 2, 3, 128 * 128 + 1, 1, 4, 4);
        let [q, k, v, _] = over.upload(ctx);
        let err = attention_forward(ctx, &q, &k, &v, &AttentionOptions::new()).unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { arg, limit: 16384, .. } if arg.contains("workgroups")),
            "[{backend}] {err}"
        );
    });
}

#[test]
fn pipelines_are_compiled_once() {
    // Private contexts: other tests compile pipelines concurrently on the shared ones.
    for_each_family_with(
        |_| {},
        |backend, ctx| {
            let case = Case::new(1, 7, 7, 2, 2, 12, 12);
            check(backend, ctx, &case, Path::Fused);
            let n = ctx.cached_pipelines();
            check(backend, ctx, &case, Path::Fused);
            assert_eq!(
                n,
                ctx.cached_pipelines(),
                "[{backend}] a repeated call compiled a pipeline"
            );
        },
    );
}

/// Attention maps: the probabilities recomputed from lse, by row ranges, with every mask and score
/// term, against the reference; rows that see keys sum to 1 (less their sink's share).
#[test]
fn attention_probabilities_match_reference() {
    let bias = BiasCase {
        batch: 1,
        heads: 4,
        learnable: false,
        masked_every: 5,
        strided: true,
    };
    // Head dims the other tests compile already (each new one is a cold-cache compile).
    let cases = [
        Case::new(2, 33, 47, 4, 2, 40, 24)
            .causal()
            .kv_lens(&[47, 20]),
        Case::new(1, 30, 30, 4, 4, 40, 40)
            .window(6, 2)
            .alibi()
            .softcap(3.0)
            .magnitude(2.0),
        Case::new(1, 17, 29, 4, 2, 40, 40).bias(bias),
        Case::new(2, 20, 25, 4, 1, 40, 40)
            .relative(16, 20, true)
            .sinks(&[0.5, -1.0, 2.0, 0.0]),
        Case::new(1, 19, 23, 4, 2, 40, 40)
            .key_clip(0.8)
            .cosine_learned(&[8.0, 3.0, -2.0, 12.0])
            .q_lens(&[11]),
    ];
    for_each_backend(|backend, ctx| {
        for case in &cases {
            let [q, k, v, _] = case.upload(ctx);
            let buffers = case.buffers(ctx);
            let opts = case.options(&buffers);
            let fwd = attention_forward(ctx, &q, &k, &v, &opts).unwrap();
            let (qh, kh, _, _) = case.data();
            let reference = reference::attention_probabilities(
                &case.shape(),
                &to_f64(&qh),
                &to_f64(&kh),
                &case.masks(),
            );
            let (lq, lk) = (case.lq, case.lk);
            for rows in [0..lq, 3..lq / 2 + 1] {
                let got = attention_probabilities(ctx, &q, &k, &fwd.lse, &opts, rows.clone())
                    .unwrap()
                    .to_vec(ctx)
                    .unwrap();
                let expected: Vec<f64> = (0..case.b * case.h)
                    .flat_map(|bh| {
                        let start = (bh * lq + rows.start) * lk;
                        reference[start..start + rows.len() * lk].to_vec()
                    })
                    .collect();
                assert_close(
                    &format!("[{backend}] probabilities {} rows {rows:?}", case.label()),
                    &got,
                    &expected,
                    FORWARD_ATOL,
                    FORWARD_RTOL,
                );
            }
            // Without sinks, every row that sees a key sums to 1.
            if case.sinks.is_none() {
                for row in reference.chunks(lk) {
                    let sum: f64 = row.iter().sum();
                    assert!(
                        sum == 0.0 || (sum - 1.0).abs() < 1e-9,
                        "{}: {sum}",
                        case.label()
                    );
                }
            }
        }
    });
}
