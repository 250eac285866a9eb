//! Fused additive (Bahdanau) attention: the f64 reference's gradients against central finite
//! differences, and the GPU forward and backward against the reference on every back end (padding,
//! causal, windows, Dk != Dv, key loops split into accumulating dispatches by a small loop budget,
//! bitwise reruns), and typed errors.

use crate::common;

use common::*;
use wgpu_attention::kernels::additive::{additive_decode_into, additive_probabilities};
use wgpu_attention::reference::additive as reference;
use wgpu_attention::reference::attention::Masks;
use wgpu_attention::{
    additive_backward, additive_backward_unfused, additive_forward, additive_forward_unfused,
    AdditiveScores, AttentionOptions, AttentionShape, Context, ForwardViews, GpuTensor, SeqLens,
};

/// The case's masks for additive scores (scale 1: the score vector is learned).
fn masks(case: &Case) -> Masks {
    Masks {
        scale: 1.0,
        causal: case.causal,
        q_lens: case.q_lens.clone(),
        kv_lens: case.kv_lens.clone(),
        window: case.window,
        ..Default::default()
    }
}

/// Random score vector and bias `[H, Da]`.
fn score_params(case: &Case) -> (Vec<f32>, Vec<f32>) {
    let mut r = rng(case.seed + 100);
    let n = case.h * case.dk;
    (random(&mut r, n, 1.0), random(&mut r, n, 0.5))
}

#[test]
fn reference_gradients_match_finite_differences() {
    let s = AttentionShape {
        batch: 1,
        q_seq: 3,
        kv_seq: 4,
        heads: 2,
        kv_heads: 2,
        head_dim_qk: 3,
        head_dim_v: 2,
    };
    let mut r = rng(5);
    let mut a = to_f64(&random(&mut r, 3 * 2 * 3, 1.0));
    let mut b = to_f64(&random(&mut r, 4 * 2 * 3, 1.0));
    let mut v = to_f64(&random(&mut r, 4 * 2 * 2, 1.0));
    let mut w = to_f64(&random(&mut r, 2 * 3, 1.0));
    let mut bias = to_f64(&random(&mut r, 2 * 3, 0.5));
    let d_out = to_f64(&random(&mut r, 3 * 2 * 2, 1.0));
    for causal in [false, true] {
        let m = Masks {
            scale: 0.7,
            causal,
            ..Default::default()
        };
        let loss = |a: &[f64], b: &[f64], v: &[f64], w: &[f64], bias: &[f64]| -> f64 {
            let (o, _) =
                reference::additive_forward(&s, a, b, v, reference::ScoreParams { w, bias }, &m);
            o.iter().zip(&d_out).map(|(x, y)| x * y).sum()
        };
        let g = reference::additive_backward(
            &s,
            &a,
            &b,
            &v,
            reference::ScoreParams { w: &w, bias: &bias },
            &d_out,
            &m,
        );
        let h = 1e-6;
        let mut worst: f64 = 0.0;
        for (name, which, grad) in [
            ("a", 0, &g.da),
            ("b", 1, &g.db),
            ("v", 2, &g.dv),
            ("w", 3, &g.dw),
            ("bias", 4, &g.dbias),
        ] {
            for n in 0..grad.len() {
                let mut at = |delta: f64| {
                    let t = match which {
                        0 => &mut a,
                        1 => &mut b,
                        2 => &mut v,
                        3 => &mut w,
                        _ => &mut bias,
                    };
                    t[n] += delta;
                    let x = loss(&a, &b, &v, &w, &bias);
                    let t = match which {
                        0 => &mut a,
                        1 => &mut b,
                        2 => &mut v,
                        3 => &mut w,
                        _ => &mut bias,
                    };
                    t[n] -= delta;
                    x
                };
                let fd = (at(h) - at(-h)) / (2.0 * h);
                let err = (fd - grad[n]).abs();
                assert!(
                    err < 1e-7,
                    "causal {causal} d{name}[{n}]: {} vs fd {fd}",
                    grad[n]
                );
                worst = worst.max(err);
            }
        }
        eprintln!("causal {causal}: worst |reference - finite difference| {worst:.2e}");
    }
}

/// GPU forward and backward of `case` against the reference; returns the GPU gradients for rerun
/// comparisons.
fn check(ctx: &Context, name: &str, case: &Case) -> Vec<Vec<f32>> {
    let (a, b, v, d_out) = case.data();
    let (w, bias) = score_params(case);
    let [av, bv, vv, dov] = case.upload(ctx);
    let wt = GpuTensor::from_slice(ctx, &w, &[case.h, case.dk]).unwrap();
    let bt = GpuTensor::from_slice(ctx, &bias, &[case.h, case.dk]).unwrap();
    let scores = AdditiveScores { w: &wt, bias: &bt };
    let buffers = case.buffers(ctx);
    let opts = case.options(&buffers);
    let fwd = additive_forward(ctx, &av, &bv, &vv, scores, &opts).unwrap();
    let m = masks(case);
    let s = case.shape();
    let (a64, b64, v64) = (to_f64(&a), to_f64(&b), to_f64(&v));
    let (w64, bias64) = (to_f64(&w), to_f64(&bias));
    let scores64 = reference::ScoreParams {
        w: &w64,
        bias: &bias64,
    };
    let (ref_out, ref_lse) = reference::additive_forward(&s, &a64, &b64, &v64, scores64, &m);
    let what = format!("[{name}] additive {}", case.label());
    assert_close(
        &format!("{what} out"),
        &fwd.out.to_vec(ctx).unwrap(),
        &ref_out,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    let lse = fwd.lse.to_vec(ctx).unwrap();
    assert_lse_close(&what, &lse, &ref_lse, 1e-4, 1e-4);
    let unfused = additive_forward_unfused(ctx, &av, &bv, &vv, scores, &opts).unwrap();
    assert_close(
        &format!("{what} unfused out"),
        &unfused.out.to_vec(ctx).unwrap(),
        &ref_out,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    // Attention maps: the probabilities of rows 1.. (a partial range) from the forward's lse.
    let rows = 1..case.lq;
    let probs =
        additive_probabilities(ctx, &av, &bv, &fwd.lse, scores, &opts, rows.clone()).unwrap();
    let all = reference::additive_probabilities(&s, &a64, &b64, &v64, scores64, &m);
    let expected: Vec<f64> = (0..case.b * case.h)
        .flat_map(|bh| {
            rows.clone()
                .flat_map(move |i| (0..case.lk).map(move |j| (bh * case.lq + i) * case.lk + j))
        })
        .map(|n| all[n])
        .collect();
    assert_close(
        &format!("{what} probabilities"),
        &probs.to_vec(ctx).unwrap(),
        &expected,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    let grads = additive_backward(
        ctx,
        &ForwardViews {
            q: &av,
            k: &bv,
            v: &vv,
            out: &fwd.out.heads().unwrap(),
            lse: &fwd.lse,
        },
        scores,
        &dov,
        &opts,
    )
    .unwrap();
    let expected =
        reference::additive_backward(&s, &a64, &b64, &v64, scores64, &to_f64(&d_out), &m);
    let mut out = Vec::new();
    for (grad, gpu, reference) in [
        ("da", &grads.da, &expected.da),
        ("db", &grads.db, &expected.db),
        ("dv", &grads.dv, &expected.dv),
        ("dw", &grads.dw, &expected.dw),
        ("dbias", &grads.dbias, &expected.dbias),
    ] {
        let g = gpu.to_vec(ctx).unwrap();
        assert_close(
            &format!("{what} {grad}"),
            &g,
            reference,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
        out.push(g);
    }
    // The unfused baseline's backward (materialised P and dS).
    let unfused = additive_backward_unfused(ctx, &av, &bv, &vv, scores, &dov, &opts).unwrap();
    for (grad, gpu, reference) in [
        ("da", &unfused.da, &expected.da),
        ("db", &unfused.db, &expected.db),
        ("dv", &unfused.dv, &expected.dv),
        ("dw", &unfused.dw, &expected.dw),
        ("dbias", &unfused.dbias, &expected.dbias),
    ] {
        assert_close(
            &format!("{what} unfused {grad}"),
            &gpu.to_vec(ctx).unwrap(),
            reference,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
    }
    out
}

fn cases() -> Vec<Case> {
    vec![
        // Padding of queries and keys, causal, Dk != Dv, a score dim and a value dim that are not
        // multiples of the kernels' vec4 packing (nor of the GPU family's 4 lanes per row).
        Case::new(2, 5, 7, 2, 2, 27, 21)
            .causal()
            .q_lens(&[5, 3])
            .kv_lens(&[7, 4]),
        // Cross-attention shape (Lq != Lk), a window, more rows than a workgroup and a key tile
        // (8 lanes per row in the GPU family's backward, one score vec4 and five value dims each).
        Case::new(1, 70, 40, 1, 1, 20, 36).window(6, 3),
    ]
}

#[test]
fn gpu_matches_reference() {
    // Both families: one invocation per row (CPU drivers) and rows over lanes (GPUs).
    for_each_family(|name, ctx| {
        for case in cases() {
            check(ctx, name, &case);
        }
        // The largest dims: staged tiles of 16 rows where the workgroup memory is 32 KiB. On
        // Vulkan only for the CPU-driver family, whose backward keeps a row per invocation: its
        // two kernels take 28 s to compile there on a cold shader cache
        // (`benchmarks/ci-time-2026-11-29/`), and GL runs the same WGSL.
        if name.ends_with("/gpu") || name.starts_with("vulkan") {
            check(ctx, name, &Case::new(1, 5, 40, 1, 1, 128, 128).causal());
        }
        // Da 96 in 32 KiB: the GPU family's forward keeps its rows in workgroup memory beside an
        // 8-row tile (the CPU drivers keep theirs in registers beside 32 at every width, as at the
        // widths above: 20 s of compile each back end for nothing new).
        if name.ends_with("/gpu") {
            check(ctx, name, &Case::new(1, 5, 40, 1, 1, 96, 96).causal());
        }
    });
}

/// A context that tunes times the fused kernels against the unfused path for each additive key
/// (forward and backward), keeps the faster, and its results match the reference; a tuning cache
/// that names the unfused path routes the library's calls there (the pipeline dump shows its
/// kernels), still matching the reference. On lavapipe only: the other back end runs the same
/// host logic over the same kernels, which `gpu_matches_reference` checks on both.
#[test]
fn tuning_routes_additive_calls_to_the_faster_path() {
    use wgpu_attention::{TuningMode, TuningSource};
    for_each_backend(|name, shared| {
        if name != "vulkan" {
            return;
        }
        let cache = std::env::temp_dir().join(format!(
            "wgpu-attention-additive-tuning-{}.json",
            std::process::id()
        ));
        let dump = cache.with_extension("dump");
        let _ = std::fs::remove_file(&cache);
        let _ = std::fs::remove_dir_all(&dump);
        let case = Case::new(1, 20, 30, 2, 2, 12, 8).causal();
        let tuned = fresh_context_with_options(name, shared, |opts| {
            let mut opts = opts.tuning(TuningMode::Tune);
            opts.tuning_cache = Some(cache.clone());
            opts
        });
        check(&tuned, name, &case);
        let report = tuned.tuning_report();
        for kernel in ["additive_forward ", "additive_backward "] {
            let record = report
                .iter()
                .find(|r| r.key.starts_with(kernel))
                .unwrap_or_else(|| panic!("no {kernel}key in {report:?}"));
            let timed: Vec<_> = record
                .candidates
                .iter()
                .filter(|c| c.seconds.is_some())
                .collect();
            assert_eq!(timed.len(), 2, "{record}");
            assert!(
                timed.iter().any(|c| c.choice.unfused == Some(true)),
                "{record}"
            );
            assert!(timed.iter().any(|c| c.verdict == "winner"), "{record}");
        }
        // The cache rewritten to choose the unfused path for both keys: a cache-only context
        // follows it.
        let mut file: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cache).unwrap()).unwrap();
        for section in file["sections"].as_array_mut().unwrap() {
            for (key, entry) in section["entries"].as_object_mut().unwrap() {
                if key.starts_with("additive_") {
                    entry["choice"]["unfused"] = true.into();
                }
            }
        }
        std::fs::write(&cache, serde_json::to_string(&file).unwrap()).unwrap();
        let routed = fresh_context_with_options(name, shared, |opts| {
            let mut opts = opts.tuning(TuningMode::CacheOnly).dump_pipelines(&dump);
            opts.tuning_cache = Some(cache.clone());
            opts
        });
        // The library's calls alone (check() also runs the unfused baselines, whose kernels the
        // route shares), against the reference.
        let (a, b, v, d_out) = case.data();
        let (w, bias) = score_params(&case);
        let [av, bv, vv, dov] = case.upload(&routed);
        let wt = GpuTensor::from_slice(&routed, &w, &[case.h, case.dk]).unwrap();
        let bt = GpuTensor::from_slice(&routed, &bias, &[case.h, case.dk]).unwrap();
        let scores = AdditiveScores { w: &wt, bias: &bt };
        let opts = AttentionOptions::new().causal(true);
        let dumped = || -> Vec<String> {
            std::fs::read_dir(&dump)
                .unwrap()
                .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .collect()
        };
        let fwd = additive_forward(&routed, &av, &bv, &vv, scores, &opts).unwrap();
        // The forward's route compiled the scores kernel and no fused forward.
        let names = dumped();
        assert!(
            names.iter().any(|n| n.starts_with("additive_scores")),
            "{names:?}"
        );
        assert!(
            !names.iter().any(|n| n.starts_with("additive_forward")),
            "{names:?}"
        );
        let forward = ForwardViews {
            q: &av,
            k: &bv,
            v: &vv,
            out: &fwd.out.heads().unwrap(),
            lse: &fwd.lse,
        };
        let grads = additive_backward(&routed, &forward, scores, &dov, &opts).unwrap();
        let (s, m) = (case.shape(), masks(&case));
        let (w64, bias64) = (to_f64(&w), to_f64(&bias));
        let scores64 = reference::ScoreParams {
            w: &w64,
            bias: &bias64,
        };
        let (a64, b64, v64) = (to_f64(&a), to_f64(&b), to_f64(&v));
        let (ref_out, _) = reference::additive_forward(&s, &a64, &b64, &v64, scores64, &m);
        let expected =
            reference::additive_backward(&s, &a64, &b64, &v64, scores64, &to_f64(&d_out), &m);
        let out = fwd.out.to_vec(&routed).unwrap();
        assert_close("routed out", &out, &ref_out, FORWARD_ATOL, FORWARD_RTOL);
        for (grad, gpu, want) in [
            ("da", &grads.da, &expected.da),
            ("db", &grads.db, &expected.db),
            ("dv", &grads.dv, &expected.dv),
            ("dw", &grads.dw, &expected.dw),
            ("dbias", &grads.dbias, &expected.dbias),
        ] {
            let got = gpu.to_vec(&routed).unwrap();
            assert_close(grad, &got, want, BACKWARD_ATOL, BACKWARD_RTOL);
        }
        let report = routed.tuning_report();
        let additive: Vec<_> = report
            .iter()
            .filter(|r| r.key.starts_with("additive_"))
            .collect();
        assert_eq!(additive.len(), 2, "{report:?}");
        for record in additive {
            assert_eq!(record.source, TuningSource::Cache, "{record}");
            assert_eq!(record.chosen.unfused, Some(true), "{record}");
        }
        let names = dumped();
        assert!(
            names
                .iter()
                .any(|n| n.starts_with("additive_backward_unfused")),
            "{names:?}"
        );
        assert!(
            !names.iter().any(|n| n.starts_with("additive_backward_da")),
            "{names:?}"
        );
        let _ = std::fs::remove_file(&cache);
        let _ = std::fs::remove_dir_all(&dump);
    });
}

#[test]
fn long_loops_split_into_accumulating_dispatches_bitwise() {
    // A budget of 400 iterations splits every key and query loop into several dispatches.
    for_each_family_with_loop_budget(400, |name, ctx| {
        let case = &cases()[1];
        let first = check(ctx, name, case);
        let again = check(ctx, name, case);
        assert!(
            first
                .iter()
                .flatten()
                .zip(again.iter().flatten())
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "[{name}] reruns differ"
        );
    });
}

/// The backward kernels compiled without wgpu's runtime checks (`Context::trusted_shaders`, on by
/// default) give the bits of the fully checked ones.
#[test]
fn trusted_and_checked_kernels_agree_bitwise() {
    let mut runs = Vec::new();
    for trusted in [false, true] {
        let results = std::sync::Mutex::new(Vec::new());
        for_each_family_with(
            |ctx| ctx.set_trusted_shaders(trusted),
            |name, ctx| {
                for (i, case) in cases().iter().enumerate() {
                    let out = check(ctx, name, case);
                    results.lock().unwrap().push((format!("{name} {i}"), out));
                }
            },
        );
        // The families ran at once: in the order of their names.
        let mut results = results.into_inner().unwrap();
        results.sort_by(|a, b| a.0.cmp(&b.0));
        runs.push(results.into_iter().map(|(_, out)| out).collect::<Vec<_>>());
    }
    for (checked, trusted) in runs[0].iter().zip(&runs[1]) {
        for (x, y) in checked.iter().zip(trusted) {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(x), bits(y));
        }
    }
}

#[test]
fn bad_additive_input_is_a_typed_error() {
    for_each_backend(|name, ctx| {
        let case = Case::new(1, 3, 3, 2, 2, 4, 4);
        let [a, b, v, _] = case.upload(ctx);
        let w = GpuTensor::zeros(ctx, &[2, 4]).unwrap();
        let short = GpuTensor::zeros(ctx, &[2, 3]).unwrap();
        let opts = AttentionOptions::new();
        let e = additive_forward(
            ctx,
            &a,
            &b,
            &v,
            AdditiveScores {
                w: &short,
                bias: &w,
            },
            &opts,
        )
        .unwrap_err();
        assert!(e.to_string().contains("w"), "[{name}] {e}");
        let scores = AdditiveScores { w: &w, bias: &w };
        let e = additive_forward(ctx, &a, &b, &v, scores, &opts.softcap(5.0)).unwrap_err();
        assert!(e.to_string().contains("softcap"), "[{name}] {e}");
        let big = Case::new(1, 2, 2, 1, 1, 132, 4);
        let [a, b, v, _] = big.upload(ctx);
        let w1 = GpuTensor::zeros(ctx, &[1, 132]).unwrap();
        let scores = AdditiveScores { w: &w1, bias: &w1 };
        let e = additive_forward(ctx, &a, &b, &v, scores, &opts).unwrap_err();
        assert!(e.to_string().contains("132"), "[{name}] {e}");
    });
}

/// Decoding: the last rows of each sequence as new queries against caches holding the whole
/// sequences (`additive_decode_into`, masks aligned on each sequence's lengths) give the rows of the
/// full forward.
#[test]
fn decode_matches_the_full_forward() {
    for_each_backend(|name, ctx| {
        // One tile of keys; then several, with more value dims than the kernel's workgroup (two per
        // invocation).
        decode_case(ctx, name, [7, 5], 6, 5);
        decode_case(ctx, name, [150, 97], 6, 70);
    });
    // Key loops split into accumulating dispatches.
    for_each_backend_with_loop_budget(300, |name, ctx| decode_case(ctx, name, [150, 97], 6, 70));
}

/// Decodes the last rows of two sequences of `kv_lens` keys (two new rows, then one) against the
/// whole caches and compares them with the full forward's rows, with and without a window.
fn decode_case(ctx: &Context, name: &str, kv_lens: [u32; 2], da: usize, dv: usize) {
    let (bsz, h) = (2usize, 2usize);
    let len = kv_lens[0] as usize;
    let new = [2u32, 1];
    let slots = 2usize;
    let mut r = rng(77);
    let a = random(&mut r, bsz * len * h * da, 1.0);
    let b = random(&mut r, bsz * len * h * da, 1.0);
    let v = random(&mut r, bsz * len * h * dv, 1.0);
    let w = random(&mut r, h * da, 1.0);
    let bias = random(&mut r, h * da, 0.5);
    let wt = GpuTensor::from_slice(ctx, &w, &[h, da]).unwrap();
    let bt = GpuTensor::from_slice(ctx, &bias, &[h, da]).unwrap();
    let scores = AdditiveScores { w: &wt, bias: &bt };
    let upload = |x: &[f32], shape: [usize; 4]| GpuTensor::from_slice(ctx, x, &shape).unwrap();
    let (at, bt_, vt) = (
        upload(&a, [bsz, len, h, da]),
        upload(&b, [bsz, len, h, da]),
        upload(&v, [bsz, len, h, dv]),
    );
    for window in [None, Some((2, 0))] {
        let full_lens = SeqLens::new(ctx, Some(&kv_lens), Some(&kv_lens)).unwrap();
        let mut opts = AttentionOptions::new().causal(true).seq_lens(&full_lens);
        if let Some((left, right)) = window {
            opts = opts.window(left, right);
        }
        let full = additive_forward(
            ctx,
            &at.heads().unwrap(),
            &bt_.heads().unwrap(),
            &vt.heads().unwrap(),
            scores,
            &opts,
        )
        .unwrap()
        .out
        .to_vec(ctx)
        .unwrap();
        // The new rows: the last new[s] positions of each sequence, in slots 0.. of a_new.
        let mut a_new = vec![0.0f32; bsz * slots * h * da];
        let mut expected = vec![0.0f64; bsz * slots * h * dv];
        for s in 0..bsz {
            for r in 0..new[s] as usize {
                let pos = (kv_lens[s] - new[s]) as usize + r;
                let (src, dst) = ((s * len + pos) * h * da, (s * slots + r) * h * da);
                a_new[dst..dst + h * da].copy_from_slice(&a[src..src + h * da]);
                let (src, dst) = ((s * len + pos) * h * dv, (s * slots + r) * h * dv);
                for (e, x) in expected[dst..dst + h * dv].iter_mut().zip(&full[src..]) {
                    *e = *x as f64;
                }
            }
        }
        let a_new = upload(&a_new, [bsz, slots, h, da]);
        let out = GpuTensor::zeros(ctx, &[bsz, slots, h, dv]).unwrap();
        let lse = GpuTensor::zeros(ctx, &[bsz, h, slots]).unwrap();
        let lens = SeqLens::new(ctx, Some(&new), Some(&kv_lens)).unwrap();
        let mut opts = AttentionOptions::new().causal(true).seq_lens(&lens);
        if let Some((left, right)) = window {
            opts = opts.window(left, right);
        }
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        additive_decode_into(
            ctx,
            &mut encoder,
            &ForwardViews {
                q: &a_new.heads().unwrap(),
                k: &bt_.heads().unwrap(),
                v: &vt.heads().unwrap(),
                out: &out.heads().unwrap(),
                lse: &lse,
            },
            scores,
            &opts,
        )
        .unwrap();
        ctx.queue().submit([encoder.finish()]);
        let got = out.to_vec(ctx).unwrap();
        // Padded slots (sequence 1's second) are zero in the decode output: compare those too.
        assert_close(
            &format!("[{name}] additive decode {kv_lens:?} Dv {dv} window {window:?}"),
            &got,
            &expected,
            FORWARD_ATOL,
            FORWARD_RTOL,
        );
    }
}

/// Each fused backward kernel binds 8 storage buffers (w, the bias and lse are copied into its
/// workspace): the whole path runs on a device with WebGPU's default limits, as a browser's may be.
#[test]
fn runs_on_a_device_with_webgpu_default_limits() {
    let Some((device, queue)) = vulkan_device_with_default_limits() else {
        eprintln!("no Vulkan adapter: skipped");
        return;
    };
    assert_eq!(device.limits().max_storage_buffers_per_shader_stage, 8);
    let mut ctx = Context::from_device(device, queue).unwrap();
    let case = Case::new(2, 9, 13, 2, 2, 16, 8).causal().kv_lens(&[13, 6]);
    for family in FAMILIES {
        ctx.set_kernel_family(Some(family));
        check(
            &ctx,
            &format!("vulkan/default limits/{}", family.name()),
            &case,
        );
    }
    ctx.synchronize().unwrap();
}
