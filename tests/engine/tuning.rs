//! The autotuner (`ContextOptions::tuning`): tuned results against the reference, choices fixed
//! for a context's life, the cache file read by a second context (which times nothing), corrupt
//! and foreign caches ignored, budgets, explicit settings left alone, two threads on one context.
//! On lavapipe only: the tuner is host logic over kernels the other tests prove on every back
//! end, and each candidate costs a pipeline compile (the picking itself, with speeds that differ
//! by construction, is `kernels::attention::tune`'s unit test).

use crate::common;

use common::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use wgpu_attention::reference::compare::{TENSOR_CORE_ATOL, TENSOR_CORE_RTOL};
use wgpu_attention::{
    attention_backward, attention_forward, AttentionOptions, Context, ContextOptions, KernelFamily,
    TuningBudget, TuningMode, TuningRecord, TuningSource,
};

/// A path for a cache file of this test (removed first).
fn cache_path(test: &str) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("wgpu-attention-{}-{test}.json", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

/// Runs `f` on fresh lavapipe contexts made by `make` (mode, cache path).
fn on_lavapipe(f: impl FnMut(&dyn Fn(TuningMode, Option<&Path>) -> Context) + Send) {
    let f = std::sync::Mutex::new(f);
    for_each_backend(|name, shared| {
        if name != "vulkan" {
            return;
        }
        let make = |mode: TuningMode, cache: Option<&Path>| {
            fresh_context_with_options(name, shared, |opts| {
                let mut opts = opts.tuning(mode).tuning_budget(TuningBudget::new(
                    Duration::from_secs(300),
                    Duration::from_secs(600),
                ));
                opts.tuning_cache = cache.map(Path::to_path_buf);
                opts
            })
        };
        (f.lock().unwrap())(&make);
    });
}

fn small_case() -> Case {
    Case::new(1, 48, 64, 2, 2, 16, 16).causal()
}

/// O and lse of the fused forward of `case` on `ctx`, checked against the reference.
fn forward(ctx: &Context, case: &Case) -> (Vec<f32>, Vec<f32>) {
    let [q, k, v, _] = case.upload(ctx);
    let opts = AttentionOptions::new().causal(case.causal);
    let fwd = attention_forward(ctx, &q, &k, &v, &opts).unwrap();
    let (out, lse) = (fwd.out.to_vec(ctx).unwrap(), fwd.lse.to_vec(ctx).unwrap());
    let (ref_out, ref_lse) = case.reference_forward();
    assert_close("tuned O", &out, &ref_out, FORWARD_ATOL, FORWARD_RTOL);
    assert_lse_close("tuned lse", &lse, &ref_lse, FORWARD_ATOL, FORWARD_RTOL);
    (out, lse)
}

/// dQ, dK and dV of the fused backward of `case` (causal) on `ctx`, checked against the reference.
fn backward(ctx: &Context, case: &Case) {
    let [q, k, v, d_out] = case.upload(ctx);
    let opts = AttentionOptions::new().causal(true);
    let fwd = attention_forward(ctx, &q, &k, &v, &opts).unwrap();
    let grads = attention_backward(ctx, &q, &k, &v, &fwd, &d_out, &opts).unwrap();
    let reference = case.reference_backward();
    for (what, got, want) in [
        ("dq", &grads.dq, &reference.dq),
        ("dk", &grads.dk, &reference.dk),
        ("dv", &grads.dv, &reference.dv),
    ] {
        let got = got.to_vec(ctx).unwrap();
        assert_close(what, &got, want, BACKWARD_ATOL, BACKWARD_RTOL);
    }
}

/// The fused forward of `case` on `ctx`, whose choice may be the tensor-core family's: O against
/// the reference within the tensor-core tolerances.
fn tensor_core_forward(ctx: &Context, case: &Case) {
    let [q, k, v, _] = case.upload(ctx);
    let opts = AttentionOptions::new().causal(case.causal);
    let fwd = attention_forward(ctx, &q, &k, &v, &opts).unwrap();
    let (ref_out, _) = case.reference_forward();
    let out = fwd.out.to_vec(ctx).unwrap();
    let label = format!("tuned O {}", case.label());
    assert_close(&label, &out, &ref_out, TENSOR_CORE_ATOL, TENSOR_CORE_RTOL);
}

/// The timed record's winner is its fastest candidate, each other timed one says by how much it
/// was slower.
fn check_verdicts(record: &TuningRecord) {
    let timed: Vec<_> = record
        .candidates
        .iter()
        .filter_map(|c| c.seconds.map(|s| (s, c)))
        .collect();
    assert!(!timed.is_empty(), "{record}");
    let fastest = timed.iter().map(|(s, _)| *s).fold(f64::INFINITY, f64::min);
    for (seconds, candidate) in &timed {
        match *seconds == fastest {
            true => {
                assert_eq!(candidate.verdict, "winner", "{record}");
                assert_eq!(candidate.choice, record.chosen, "{record}");
            }
            false => assert!(candidate.verdict.starts_with("slower by"), "{record}"),
        }
    }
}

#[test]
fn tuned_calls_match_the_reference_and_keep_their_choice() {
    on_lavapipe(|make| {
        let ctx = make(TuningMode::Tune, None);
        let case = small_case();
        let first = forward(&ctx, &case);
        let report = ctx.tuning_report();
        assert_eq!(report.len(), 1, "{report:?}");
        let record = &report[0];
        assert_eq!(
            record.key,
            "attention_forward d16x16 q64 k64 bh2 f32 causal"
        );
        assert_eq!(record.source, TuningSource::Tuned, "{record}");
        // Both families at least (the static one first), each timed or refused with a reason;
        // never the tensor cores, whose accuracy the context did not choose.
        assert!(record.candidates.len() >= 2, "{record}");
        assert!(record
            .candidates
            .iter()
            .all(|c| c.choice.family != Some(KernelFamily::Coop)));
        assert!(record.candidates.iter().all(|c| !c.verdict.is_empty()));
        check_verdicts(record);
        // The choice is made once: the same call again times nothing and gives the same bits.
        assert_eq!(forward(&ctx, &case), first);
        assert_eq!(ctx.tuning_report().len(), 1);

        // The backward too, against the reference.
        backward(&ctx, &case);
        let report = ctx.tuning_report();
        assert_eq!(report.len(), 2, "{report:?}");
        assert!(report[1].key.starts_with("attention_backward d16x16"));
        check_verdicts(&report[1]);
    });
}

/// A context that runs the tensor-core family tunes its forward's shapes (tile groups, keys per
/// tile) within the family, each checked on the family's tolerance, and keeps the result within it.
#[test]
fn the_tensor_core_family_tunes_its_shapes() {
    on_lavapipe(|make| {
        let mut ctx = make(TuningMode::Tune, None);
        ctx.set_kernel_family(Some(KernelFamily::Coop));
        // 33 query rows: two groups' rows, so that more than one shape fits a CPU driver.
        let case = Case::new(1, 33, 64, 2, 2, 16, 16);
        tensor_core_forward(&ctx, &case);
        let report = ctx.tuning_report();
        let record = &report[0];
        let shapes = record
            .candidates
            .iter()
            .filter(|c| c.choice.coop_forward.is_some())
            .count();
        assert!(shapes >= 1, "{record}");
        assert!(
            record
                .candidates
                .iter()
                .all(|c| c.choice.family == Some(KernelFamily::Coop)),
            "{record}"
        );
        check_verdicts(record);
    });
}

/// With `tune_tensor_cores` the tensor-core family is a candidate family (here its portable build,
/// checked on its tolerance), results stay within the tensor-core tolerances whichever wins, and
/// the key says so (` tc`), so that a context without the option never reads its choice.
#[test]
fn tuning_may_pick_the_tensor_cores_where_allowed() {
    on_lavapipe(|make| {
        let mut ctx = make(TuningMode::Tune, None);
        ctx.set_tune_tensor_cores(true);
        assert!(ctx.tunes_tensor_cores());
        tensor_core_forward(&ctx, &small_case());
        let report = ctx.tuning_report();
        let record = &report[0];
        assert_eq!(
            record.key,
            "attention_forward d16x16 q64 k64 bh2 f32 causal tc"
        );
        let coop = record
            .candidates
            .iter()
            .find(|c| c.choice.family == Some(KernelFamily::Coop))
            .unwrap_or_else(|| panic!("no tensor-core candidate: {record}"));
        assert!(!coop.verdict.is_empty(), "{record}");
        check_verdicts(record);
    });
    let options = ContextOptions::new().tune_tensor_cores(true);
    assert!(options.tune_tensor_cores);
    assert!(!ContextOptions::new().tune_tensor_cores);
}

/// Where the context allows atomic gradients, the GPU family's backward tunes the dQ kernel (each
/// of its tiles) against dQ added with atomics by the dK/dV kernel, under a key of their own, and
/// the tuned call matches the reference.
#[test]
fn the_backward_tunes_the_dq_kernel_against_atomics_where_allowed() {
    for_each_backend(|name, shared| {
        if name != "vulkan" {
            return;
        }
        let mut ctx = fresh_context_with_options(name, shared, |opts| {
            opts.tuning(TuningMode::Tune)
                .atomic_gradients(true)
                .tuning_budget(TuningBudget::new(
                    Duration::from_secs(300),
                    Duration::from_secs(600),
                ))
        });
        ctx.set_kernel_family(Some(KernelFamily::Gpu));
        assert!(ctx.atomic_gradients());
        let case = small_case();
        backward(&ctx, &case);
        let report = ctx.tuning_report();
        let record = report
            .iter()
            .find(|r| r.key.starts_with("attention_backward"))
            .unwrap_or_else(|| panic!("no backward key: {report:?}"));
        assert!(record.key.ends_with(" atomic"), "{record}");
        let kernel = record
            .candidates
            .iter()
            .filter(|c| c.choice.dq_atomic == Some(false))
            .count();
        assert!(kernel >= 1, "no dQ-kernel candidate: {record}");
        assert!(record
            .candidates
            .iter()
            .any(|c| c.choice.dq_atomic.is_none()));
        check_verdicts(record);
    });
}

#[test]
fn a_second_context_reads_the_cache_and_times_nothing() {
    on_lavapipe(|make| {
        let path = cache_path("second");
        let case = small_case();
        let tuned = make(TuningMode::Tune, Some(&path));
        forward(&tuned, &case);
        let chosen = tuned.tuning_report()[0].chosen;
        assert!(path.exists(), "the cache file is written");
        for mode in [TuningMode::CacheOnly, TuningMode::Tune] {
            let ctx = make(mode, Some(&path));
            forward(&ctx, &case);
            let report = ctx.tuning_report();
            assert_eq!(report.len(), 1);
            assert_eq!(report[0].source, TuningSource::Cache, "{}", report[0]);
            assert_eq!(report[0].chosen, chosen);
            assert_eq!(report[0].seconds, 0.0);
        }
        // A cache-only context times nothing for a key the cache lacks either.
        let ctx = make(TuningMode::CacheOnly, Some(&path));
        forward(&ctx, &Case::new(1, 48, 64, 2, 2, 16, 16));
        let report = ctx.tuning_report();
        assert_eq!(
            report[0].source,
            TuningSource::Static("not in the cache".into())
        );
        assert!(report[0].candidates.is_empty());
        let _ = std::fs::remove_file(&path);
    });
}

#[test]
fn corrupt_and_foreign_caches_are_ignored() {
    on_lavapipe(|make| {
        let case = small_case();
        // Not JSON: ignored (logged), tuned anew, then replaced by a valid file.
        let path = cache_path("corrupt");
        std::fs::write(&path, "{ this is not a tuning cache").unwrap();
        let ctx = make(TuningMode::Tune, Some(&path));
        forward(&ctx, &case);
        assert_eq!(ctx.tuning_report()[0].source, TuningSource::Tuned);
        let text = std::fs::read_to_string(&path).unwrap();
        let file: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(file["sections"].as_array().unwrap().len(), 1);

        // Another adapter's section: not used, and kept when this context saves its own.
        let mut foreign = file.clone();
        foreign["sections"][0]["identity"]["adapter"] = "Some Other GPU".into();
        std::fs::write(&path, serde_json::to_string(&foreign).unwrap()).unwrap();
        let cached_only = make(TuningMode::CacheOnly, Some(&path));
        forward(&cached_only, &case);
        assert_eq!(
            cached_only.tuning_report()[0].source,
            TuningSource::Static("not in the cache".into())
        );
        let ctx = make(TuningMode::Tune, Some(&path));
        forward(&ctx, &case);
        assert_eq!(ctx.tuning_report()[0].source, TuningSource::Tuned);
        let file: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let adapters: Vec<_> = file["sections"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["identity"]["adapter"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(adapters.len(), 2, "{adapters:?}");
        assert!(adapters.contains(&"Some Other GPU".to_string()));
        let _ = std::fs::remove_file(&path);
    });
}

#[test]
fn budgets_and_explicit_settings_bound_the_search() {
    for_each_backend(|name, shared| {
        if name != "vulkan" {
            return;
        }
        let case = small_case();
        // A family set by the application is not tuned over: the GPU family's tiles and split
        // are.
        let ctx = fresh_context_with_options(name, shared, |opts| {
            opts.kernel_family(KernelFamily::Gpu)
                .tuning(TuningMode::Tune)
                .tuning_budget(TuningBudget::new(
                    Duration::from_secs(300),
                    Duration::from_secs(600),
                ))
        });
        forward(&ctx, &case);
        let record = &ctx.tuning_report()[0];
        assert!(record.candidates.len() >= 2, "{record}");
        assert!(
            record
                .candidates
                .iter()
                .all(|c| c.choice.family == Some(KernelFamily::Gpu)),
            "{record}"
        );
        check_verdicts(record);

        // A per-key budget of nothing times the static choice only; a total of nothing leaves
        // the next key static.
        let ctx = fresh_context_with_options(name, shared, |opts| {
            opts.tuning(TuningMode::Tune)
                .tuning_budget(TuningBudget::new(Duration::ZERO, Duration::from_millis(1)))
        });
        forward(&ctx, &case);
        forward(&ctx, &Case::new(1, 20, 20, 2, 2, 16, 16));
        let report = ctx.tuning_report();
        let timed = report[0]
            .candidates
            .iter()
            .filter(|c| c.seconds.is_some())
            .count();
        assert_eq!(timed, 1, "{}", report[0]);
        assert!(report[0].candidates[1..]
            .iter()
            .all(|c| c.verdict.starts_with("skipped")));
        assert!(
            matches!(&report[1].source, TuningSource::Static(why) if why.contains("budget")),
            "{}",
            report[1]
        );
    });
}

#[test]
fn two_threads_tuning_one_context_agree() {
    on_lavapipe(|make| {
        let ctx = Arc::new(make(TuningMode::Tune, None));
        let case = Arc::new(small_case());
        let results: Vec<_> = (0..2)
            .map(|_| {
                let (ctx, case) = (ctx.clone(), case.clone());
                std::thread::spawn(move || forward(&ctx, &case))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert_eq!(results[0], results[1]);
        assert_eq!(ctx.tuning_report().len(), 1);
    });
}

#[test]
fn tuning_mode_and_options_parse() {
    assert_eq!(TuningMode::parse("tune").unwrap(), TuningMode::Tune);
    assert_eq!(TuningMode::parse(" Cache ").unwrap(), TuningMode::CacheOnly);
    assert_eq!(TuningMode::parse("off").unwrap(), TuningMode::Off);
    let e = TuningMode::parse("fast").unwrap_err().to_string();
    assert!(e.contains("off, cache or tune"), "{e}");
    assert_eq!(ContextOptions::new().tuning, TuningMode::Off);
}
