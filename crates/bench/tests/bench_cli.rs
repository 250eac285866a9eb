//! The `attention-bench` binary end to end: bad arguments end with one line and exit code 2; a tiny
//! validated run writes a JSON report with every figure and an SVG chart, and `--compare` reads it;
//! a headless start-up prints nothing on stderr.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::process::Command;

/// The binary as a headless machine runs it: no display session, no runtime directory.
fn bench() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_attention-bench"));
    for name in [
        "WAYLAND_DISPLAY",
        "DISPLAY",
        "XDG_RUNTIME_DIR",
        "NODEVICE_SELECT",
    ] {
        command.env_remove(name);
    }
    command
}

#[test]
fn headless_start_up_prints_nothing_on_stderr() {
    let out = bench().arg("--list-adapters").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.is_empty(), "start-up printed: {stderr}");
    assert!(!out.stdout.is_empty(), "no adapter listed");
    // The control: with a display named, the binary leaves Mesa's device-selection layer on, and
    // where that layer is installed (as here) its Wayland probe prints the lines the fix removes.
    let control = bench()
        .arg("--list-adapters")
        .env("DISPLAY", ":99")
        .output()
        .unwrap();
    let control = String::from_utf8_lossy(&control.stderr);
    eprintln!(
        "control run with the device-selection layer on: {}",
        match control.contains("XDG_RUNTIME_DIR") {
            true => "prints the XDG_RUNTIME_DIR lines",
            false => "quiet too (no Mesa device-selection layer on this machine)",
        }
    );
}

#[test]
fn bad_arguments_exit_2_with_one_line() {
    for (args, named) in [
        (&["--backend", "foo"][..], "--backend"),
        (&["--heads", "8", "--kv-heads", "3"], "--kv-heads"),
        (&["--adapter", "no-such-adapter-anywhere"], "--adapter"),
        (&["--lengths", "0"], "--lengths"),
        (&["--masks", "weird"], "--masks"),
        (&["--reps", "x"], "--reps"),
        (&["--kernels", "tpu"], "--kernels"),
        (
            &["--lengths", "64,128", "--kv-lengths", "64"],
            "--kv-lengths",
        ),
    ] {
        let out = bench().args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
        assert!(
            lines[0].starts_with("attention-bench: "),
            "{args:?}: {stderr}"
        );
        assert!(
            lines[0].contains(named),
            "{args:?}: the message names the argument: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn tiny_run_writes_validated_json_plot_and_compares() {
    let dir = std::env::temp_dir().join(format!("attention-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("run.json");
    let svg = dir.join("run.svg");
    common::for_each_backend(|backend, _ctx| {
        let out = bench()
            .args([
                "--backend",
                backend,
                "--quick",
                "--lengths",
                "33",
                "--heads",
                "2",
            ])
            .args(["--masks", "causal,padding", "--reps", "1", "--wall-clock"])
            .args(["--kernels", "cpu,gpu"])
            .arg("--json")
            .arg(&json)
            .arg("--plot")
            .arg(&svg)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "[{backend}] {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for family in ["cpu", "gpu"] {
            assert!(
                stdout.contains(&format!("| forward | fused-{family} | f32 | {family} ")),
                "{stdout}"
            );
        }
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let cases = report["cases"].as_array().unwrap();
        // 2 masks x 3 paths (fused with each kernel family, unfused) x 2 passes, plus the
        // Transformer layer per family (causal mask only), every one validated against the reference.
        assert_eq!(cases.len(), 14);
        assert!(cases.iter().any(|c| c["pass"] == "layer fwd+bwd"));
        for case in cases {
            assert_eq!(case["validation"]["passed"], true, "{case}");
            assert_eq!(case["dtype"], "f32", "{case}");
            assert!(case["median_ms"].as_f64().unwrap() > 0.0);
            let fused = case["path"].as_str().unwrap().starts_with("fused-");
            assert_eq!(
                fused,
                !case["kernel"].as_str().unwrap().is_empty(),
                "{case}"
            );
        }
        assert!(report["fma_peak_gflops"].as_f64().unwrap() > 0.0);
        assert!(report["adapter"]["name"].is_string());
        assert!(std::fs::read_to_string(&svg).unwrap().contains("<polyline"));

        let again = bench()
            .args([
                "--backend",
                backend,
                "--quick",
                "--lengths",
                "33",
                "--heads",
                "2",
            ])
            .args(["--masks", "causal", "--reps", "1", "--paths", "fused"])
            .arg("--compare")
            .arg(&json)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&again.stdout);
        assert_eq!(again.status.code(), Some(0), "{stdout}");
        assert!(stdout.contains("speed-up"), "{stdout}");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_case_the_library_refuses_is_reported_and_skipped() {
    // A bias gradient over packed views is refused by the library (it takes padded views); the
    // run goes on, reports the refusal in its table and ends with success.
    common::for_each_backend(|backend, _ctx| {
        if backend != "vulkan" {
            return;
        }
        let out = bench()
            .args(["--backend", backend, "--lengths", "16", "--heads", "2"])
            .args([
                "--head-dim",
                "8",
                "--masks",
                "packed",
                "--modifiers",
                "bias",
            ])
            .args([
                "--passes",
                "forward,backward",
                "--paths",
                "fused",
                "--kernels",
                "gpu",
            ])
            .args(["--reps", "1", "--wall-clock"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
        assert!(
            stdout.contains("is packed"),
            "the refusal is reported: {stdout}"
        );
        assert!(
            stdout.contains("| forward | fused-gpu |"),
            "the forward still ran: {stdout}"
        );
    });
}

#[test]
fn compile_only_dumps_the_suite_without_running_it() {
    common::for_each_backend(|backend, _ctx| {
        // One directory per back end: the back ends run at once.
        let dir = std::env::temp_dir().join(format!(
            "attention-bench-dump-{}-{backend}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let out = bench()
            .args(["--backend", backend, "--compile-only", "--quick"])
            .args(["--lengths", "64", "--heads", "2", "--head-dim", "8"])
            .args(["--kernels", "cpu,gpu", "--modifiers", "none,bias,sinks"])
            .env("WGPU_ATTENTION_DUMP_PIPELINES", &dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{backend}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // No case was timed or validated: no table, no FMA peak.
        assert!(!stdout.contains("GFLOP/s"), "{backend}: {stdout}");
        let built: usize = stdout
            .lines()
            .find_map(|l| l.strip_prefix("built ")?.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{backend}: no count in {stdout}"));
        let dumped: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "wgsl"))
            .collect();
        assert!(built > 0, "{backend}: {stdout}");
        assert_eq!(dumped.len(), built, "{backend}: {stdout}");
        assert!(
            dumped.iter().all(|p| p.with_extension("json").exists()),
            "{backend}"
        );
        let names: Vec<String> = dumped
            .iter()
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        for wanted in [
            "attention_forward_cpu",
            "attention_forward_gpu",
            "attention_bias_backward",
        ] {
            assert!(
                names.iter().any(|n| n.starts_with(wanted)),
                "{backend}: {wanted} in {names:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// The labels of the pipelines `binary` (a bench binary's path) compiled with `args`, from its
/// pipeline dump, and its standard output.
fn dumped_labels(binary: &str, args: &[&str]) -> (Vec<String>, String) {
    static RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("bench-dump-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(binary)
        .args(args)
        .env("WGPU_ATTENTION_DUMP_PIPELINES", &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut labels: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "wgsl"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    labels.sort();
    let _ = std::fs::remove_dir_all(&dir);
    (labels, stdout)
}

/// `additive-bench --compile-only` builds the fused pipelines a real run then uses, every one of
/// them: a real run's dump holds them plus the unfused baseline's kernels only.
#[test]
fn additive_compile_only_builds_what_the_run_uses() {
    common::for_each_backend(|backend, _ctx| {
        if backend != "vulkan" {
            return;
        }
        let args = [
            "--backend",
            backend,
            "--lengths",
            "16,40",
            "--heads",
            "2",
            "--score-dim",
            "8",
            "--head-dim",
            "8",
            "--reps",
            "1",
        ];
        let binary = env!("CARGO_BIN_EXE_additive-bench");
        let (built, stdout) = dumped_labels(binary, &[&args[..], &["--compile-only"]].concat());
        let (ran, _) = dumped_labels(binary, &args);
        assert!(!built.is_empty(), "{stdout}");
        assert!(
            stdout.contains(&format!("built {} pipelines", built.len())),
            "{stdout}"
        );
        let unfused = [
            "additive_backward_unfused",
            "additive_scores",
            "attention_softmax",
            "matmul",
        ];
        for label in &ran {
            let baseline = unfused.iter().any(|u| label.starts_with(u));
            assert_eq!(
                built.contains(label),
                !baseline,
                "{label}: compile-only built {built:?}"
            );
        }
        assert!(built.iter().all(|l| ran.contains(l)), "{built:?} {ran:?}");
    });
}

/// `transformer-bench --varlen --compile-only` builds exactly the pipelines of the padded and the
/// packed training steps that a real `--varlen` run uses (it used to ignore the flag and run).
#[test]
fn transformer_varlen_compile_only_builds_what_the_run_uses() {
    common::for_each_backend(|backend, _ctx| {
        if backend != "vulkan" {
            return;
        }
        let args = [
            "--backend",
            backend,
            "--varlen",
            "--d-model",
            "16",
            "--heads",
            "2",
            "--layers",
            "1",
            "--seq",
            "8",
            "--batch",
            "2",
            "--vocab",
            "20",
            "--reps",
            "1",
        ];
        let binary = env!("CARGO_BIN_EXE_transformer-bench");
        let (built, stdout) = dumped_labels(binary, &[&args[..], &["--compile-only"]].concat());
        assert!(
            stdout.contains(&format!("built {} pipelines", built.len())),
            "{stdout}"
        );
        assert!(
            !stdout.contains("training step ms"),
            "nothing timed: {stdout}"
        );
        let (ran, _) = dumped_labels(binary, &args);
        assert!(!built.is_empty());
        assert_eq!(built, ran);
    });
}

/// `generate-bench --page --compile-only` builds every pipeline the contiguous and paged generations
/// of a real run use (the microbenchmarks off; a pool's and a block table's sizes are uniforms, so
/// they compile nothing of their own). It builds more:
/// `Generator::precompile` covers any request (per-row sampling, packed prefill rows).
#[test]
fn generate_paged_compile_only_builds_what_the_run_uses() {
    common::for_each_backend(|backend, _ctx| {
        if backend != "vulkan" {
            return;
        }
        let args = [
            "--backend",
            backend,
            "--d-model",
            "16",
            "--heads",
            "2",
            "--layers",
            "1",
            "--vocab",
            "20",
            "--context",
            "24",
            "--prompt",
            "6",
            "--prefill-chunk",
            "4",
            "--new-tokens",
            "3",
            "--batches",
            "2",
            "--page",
            "4",
            "--attention-lengths",
            "0",
            "--prefill-attention",
            "0",
            "--reps",
            "1",
        ];
        let binary = env!("CARGO_BIN_EXE_generate-bench");
        let (built, stdout) = dumped_labels(binary, &[&args[..], &["--compile-only"]].concat());
        assert!(!built.is_empty(), "{stdout}");
        let (ran, _) = dumped_labels(binary, &args);
        let missed: Vec<_> = ran.iter().filter(|l| !built.contains(l)).collect();
        assert!(missed.is_empty(), "compile-only missed {missed:?}");
        assert!(ran.iter().any(|l| l.contains("PAGE4")), "{ran:?}");
    });
}
