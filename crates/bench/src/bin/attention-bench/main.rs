//! `attention-bench`: validated, reproducible attention benchmarks on any adapter.
//!
//!     cargo run --release -p wgpu-attention-bench --bin attention-bench                 # default suite
//!     cargo run --release -p wgpu-attention-bench --bin attention-bench -- --quick      # under a minute on lavapipe
//!     cargo run --release -p wgpu-attention-bench --bin attention-bench -- --suite scaling --json scaling.json --plot scaling.svg
//!     cargo run --release -p wgpu-attention-bench --bin attention-bench -- --list-adapters
//!
//! Every case is first checked against the CPU reference where that is affordable; a failed check is
//! printed loudly and makes the exit code 1. Bad arguments exit with code 2 and a one-line message.
//!
//! `cli.rs` the options, `problem.rs` the problems they describe, `cases.rs` running and validating
//! each case, `report.rs` the tables, JSON, comparison and chart; this file the run itself.

mod cases;
mod cli;
mod compile;
mod problem;
mod report;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;
use wgpu_attention::bench::fma::fma_peak_gflops;
use wgpu_attention::bench::{bench_options, Timer};
use wgpu_attention::{
    enumerate_adapters, parse_backends, Context, DType, Error, KernelFamily, TuningBudget,
    TuningMode,
};

use cases::{run_problem, CaseResult, Measured, Measurement, Selection};
use cli::{reps, Cli, Mask, Modifier, Pass, PathKind, Suite};
use compile::compile_only;
use problem::{problems, Problem};
use report::{print_comparison, print_table, read_json, report_json, svg_plot};

fn usage_error(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("attention-bench: {message}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // clap's message, its list of possible values if any, on one line.
            let text = e.to_string();
            let mut line = text
                .lines()
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ")
                .to_string();
            if let Some(values) = text.lines().find(|l| l.contains("possible values")) {
                line = format!("{line} {}", values.trim());
            }
            return usage_error(line);
        }
    };
    let backends = match cli.backend.as_deref().map(parse_backends).transpose() {
        Ok(b) => b,
        Err(e) => return usage_error(format!("--backend: {e}")),
    };
    if cli.list_adapters {
        return match enumerate_adapters(backends) {
            Ok(list) => {
                for info in list {
                    println!(
                        "{} ({:?}, {:?}, driver {} {})",
                        info.name, info.backend, info.device_type, info.driver, info.driver_info
                    );
                }
                ExitCode::SUCCESS
            }
            Err(e) => usage_error(e),
        };
    }
    let problems = match problems(&cli) {
        Ok(p) => p,
        Err(e) => return usage_error(e),
    };
    let options = bench_options(backends, cli.adapter.clone()).map(|mut o| {
        o.tuning_cache = cli.tuning_cache.clone();
        o.tune_tensor_cores |= cli.tune_tensor_cores;
        o.atomic_gradients |= cli.atomic_gradients;
        if let Some(per_key) = cli.tuning_budget.filter(|s| s.is_finite() && *s > 0.0) {
            let per_key = std::time::Duration::from_secs_f64(per_key);
            o.tuning_budget = TuningBudget::new(per_key, 12 * per_key);
        }
        o
    });
    let ctx = match options.and_then(|o| Context::new_with(&o)) {
        Ok(ctx) => ctx,
        Err(e @ Error::NoAdapter { .. }) => {
            let arg = if cli.adapter.is_some() {
                "--adapter"
            } else {
                "--backend"
            };
            return usage_error(format!("{arg}: {e}"));
        }
        Err(e @ Error::UnknownBackend(..)) => return usage_error(format!("WGPU_BACKEND: {e}")),
        Err(e) => return usage_error(e),
    };
    let mut ctx = ctx;
    match run(&cli, &mut ctx, &problems) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("attention-bench: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: &Cli, ctx: &mut Context, problems: &[Problem]) -> wgpu_attention::Result<bool> {
    if cli.compile_only {
        return compile_only(cli, ctx, problems);
    }
    let timer = Timer::new(ctx, cli.wall_clock);
    let reps = reps(cli);
    let report = ctx.report();
    println!("adapter: {report}");
    if ctx.atomic_gradients() {
        println!("backward: dQ added with f32 atomics by the dK/dV kernel (GPU and tensor-core families)");
    } else if cli.atomic_gradients {
        println!("backward: --atomic-gradients asked, but the device has no f32 atomics");
    }
    let peak = fma_peak_gflops(ctx, &timer)?;
    println!(
        "clock: {}; {reps} timed runs per case after a warm-up; FMA peak {peak:.1} GFLOP/s (measured)",
        timer.clock().name()
    );
    let paths = cli
        .paths
        .clone()
        .unwrap_or(vec![PathKind::Fused, PathKind::Unfused]);
    let suite = if cli.quick { Suite::Quick } else { cli.suite };
    let passes = cli.passes.clone().unwrap_or(match suite {
        // The scaling study is about the fused forward's time and memory against L.
        Suite::Scaling => vec![Pass::Forward],
        _ => vec![Pass::Forward, Pass::Backward, Pass::Layer],
    });
    // The layer case runs at the shortest length of a preset suite, at every one when asked for.
    let shortest = problems.iter().map(|p| p.q_len).min().unwrap_or(0);
    let families: Vec<KernelFamily> = match (&cli.kernels, suite) {
        (Some(k), _) => k.iter().map(|k| k.family()).collect(),
        (None, Suite::Gpu) => vec![KernelFamily::CpuDriver, KernelFamily::Gpu],
        (None, _) => vec![ctx.kernel_family()],
    };
    let layer_at = |p: &Problem| {
        (cli.passes.is_some() || p.q_len == shortest)
            && matches!(p.mask, Mask::None | Mask::Causal)
            && p.modifier == Modifier::None
            && p.window.is_none()
            && p.q_len == p.kv_len
            && p.heads == p.kv_heads
            && p.dk == p.dv
            && p.dtype == DType::F32
    };
    let total = problems
        .iter()
        .map(|p| {
            let runs = p.runs(&paths, &families, cli.tune).len();
            runs * passes.iter().filter(|&&x| x != Pass::Layer).count()
                + families.len() * usize::from(passes.contains(&Pass::Layer) && layer_at(p))
        })
        .sum();
    let mut progress = Progress {
        total,
        done: 0,
        tty: std::io::stderr().is_terminal(),
    };
    let measurement = Measurement {
        timer: &timer,
        reps,
        validate_limit: cli.validate_limit,
        profile: cli.profile,
    };
    let selection = Selection {
        paths: &paths,
        families: &families,
        passes: &passes,
        tuned: cli.tune,
    };
    let mut results = Vec::new();
    for problem in problems {
        let with_layer = layer_at(problem);
        results.extend(run_problem(
            ctx,
            measurement,
            problem,
            selection,
            with_layer,
            &mut progress,
        )?);
    }
    progress.finish();

    print_table(&results, peak);
    ctx.set_tuning_mode(TuningMode::Off);
    for record in ctx.tuning_report() {
        println!("tuning: {record}");
    }
    // Why a family ran another build than asked (the tensor-core attention's portable fallback).
    for q in ctx.qualifications() {
        println!("qualification: {} {}", q.kernel, q.detail);
    }
    let failed: Vec<&CaseResult> = results
        .iter()
        .filter(|r| {
            matches!(
                &r.outcome,
                Ok(Measured {
                    validation: Some((false, _, _)),
                    ..
                })
            )
        })
        .collect();
    let base = match &cli.compare {
        Some(path) => Some(read_json(path)?),
        None => None,
    };
    if let Some(base) = &base {
        print_comparison(&results, base);
    }
    ctx.set_kernel_family(None);
    let doc = report_json(ctx, &timer, peak, reps, &results);
    if let Some(path) = &cli.json {
        wgpu_attention::bench::write_report(
            path,
            &serde_json::to_string_pretty(&doc).unwrap_or_default(),
        )?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &cli.plot {
        wgpu_attention::bench::write_report(path, &svg_plot(&results))?;
        println!("wrote {}", path.display());
    }
    if failed.is_empty() {
        Ok(true)
    } else {
        eprintln!("\n!!!!!!!! VALIDATION FAILED !!!!!!!!");
        for r in failed {
            if let Ok(Measured {
                validation: Some((_, ratio, detail)),
                ..
            }) = &r.outcome
            {
                eprintln!(
                    "  {}: worst error {ratio:.2}x the tolerance ({detail})",
                    r.id
                );
            }
        }
        Ok(false)
    }
}

struct Progress {
    total: usize,
    done: usize,
    tty: bool,
}

impl Progress {
    fn step(&mut self, what: &str) {
        self.done += 1;
        let line = format!("[{}/{}] {what}", self.done, self.total);
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }

    /// A line that stays (a skipped path, say), on stderr.
    fn note(&self, what: &str) {
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K");
        }
        let _ = writeln!(err, "note: {what}");
    }

    fn finish(&self) {
        if self.tty {
            eprint!("\r\x1b[2K");
        }
    }
}
