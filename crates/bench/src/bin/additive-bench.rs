//! Fused against unfused additive (Bahdanau) attention on one adapter, forward and backward (the
//! unfused path materialising the `[B, H, Lq, Lk]` scores, and P and dS in the backward), per
//! sequence length, with the tensor memory each allocates. Every case at the first length is checked
//! against the f64 reference (O in the forward, da in the backward).
//!
//! ```text
//! cargo run --release -p wgpu-attention-bench --bin additive-bench -- [--lengths 256,512,1024 --heads 4 --score-dim 64 --head-dim 64]
//! ```

use std::process::ExitCode;

use clap::Parser;
use wgpu_attention::bench::{bench_options, measure, uniform_values, Timer};
use wgpu_attention::reference::additive as reference;
use wgpu_attention::reference::attention::Masks;
use wgpu_attention::reference::compare::{
    compare, BACKWARD_ATOL, BACKWARD_RTOL, FORWARD_ATOL, FORWARD_RTOL,
};
use wgpu_attention::{
    additive_backward, additive_backward_unfused, additive_forward, additive_forward_unfused,
    additive_precompile, parse_backends, AdditiveScores, AttentionOptions, AttentionPasses,
    AttentionShape, Context, Error, ForwardViews, GpuTensor, TuningMode,
};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Fused vs unfused additive attention on any wgpu adapter"
)]
struct Cli {
    /// Back end: vulkan, gl, metal, dx12 (default: WGPU_BACKEND, else all)
    #[arg(long)]
    backend: Option<String>,
    /// Case-insensitive substring of the adapter name (default: WGPU_ADAPTER_NAME)
    #[arg(long)]
    adapter: Option<String>,
    /// Sequence lengths (Lq = Lk)
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024")]
    lengths: Vec<usize>,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// The score dimension Da of the projections a and b
    #[arg(long, default_value_t = 64)]
    score_dim: usize,
    /// The value head dim
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Causal mask
    #[arg(long)]
    causal: bool,
    /// Timed runs per measurement (after warm-up)
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Write the figures as JSON
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Build every fused pipeline the run would use (forward and backward, each length), run
    /// nothing, and print how many were built; with `WGPU_ATTENTION_DUMP_PIPELINES` each is written
    /// out. The unfused baselines are not built (as `attention-bench --compile-only`).
    #[arg(long)]
    compile_only: bool,
    /// Let the library tune each key first (`TuningMode::Tune`): its "fused" rows then time what
    /// it chose, the fused kernels or the unfused path, and the tuning report is printed
    #[arg(long)]
    tune: bool,
}

fn run(cli: &Cli) -> Result<(), Error> {
    let backends = cli.backend.as_deref().map(parse_backends).transpose()?;
    let mut options = bench_options(backends, cli.adapter.clone())?;
    if cli.tune {
        options = options.tuning(TuningMode::Tune);
    }
    let ctx = Context::new_with(&options)?;
    println!("adapter: {}", ctx.report());
    let (b, h, da, dv) = (cli.batch, cli.heads, cli.score_dim, cli.head_dim);
    let opts = AttentionOptions::new().causal(cli.causal);
    let shape = |l: usize| AttentionShape {
        batch: b,
        q_seq: l,
        kv_seq: l,
        heads: h,
        kv_heads: h,
        head_dim_qk: da,
        head_dim_v: dv,
    };
    if cli.compile_only {
        for &l in &cli.lengths {
            additive_precompile(&ctx, &shape(l), &opts, AttentionPasses::ForwardBackward)?;
        }
        println!(
            "built {} pipelines (the fused forward and backward at L {:?})",
            ctx.cached_pipelines(),
            cli.lengths
        );
        return Ok(());
    }
    let timer = Timer::new(&ctx, false);
    let w = GpuTensor::from_slice(&ctx, &uniform_values(h * da, 1, 1.0), &[h, da])?;
    let bias = GpuTensor::from_slice(&ctx, &uniform_values(h * da, 2, 0.5), &[h, da])?;
    let scores = AdditiveScores { w: &w, bias: &bias };
    println!(
        "B{b} H{h} Da {da} Dv {dv}{}; {} ({} timed runs after warm-up)\n",
        if cli.causal { " causal" } else { "" },
        timer.clock().name(),
        cli.reps
    );
    println!("| L | pass | path | median ms | min-max ms | tensor MiB | validation |\n|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for (n, &l) in cli.lengths.iter().enumerate() {
        let av = uniform_values(b * l * h * da, 3, 1.0);
        let bv = uniform_values(b * l * h * da, 4, 1.0);
        let vv = uniform_values(b * l * h * dv, 5, 1.0);
        let dov = uniform_values(b * l * h * dv, 6, 1.0);
        let a = GpuTensor::from_slice(&ctx, &av, &[b, l, h, da])?.heads()?;
        let k = GpuTensor::from_slice(&ctx, &bv, &[b, l, h, da])?.heads()?;
        let v = GpuTensor::from_slice(&ctx, &vv, &[b, l, h, dv])?.heads()?;
        let d_out = GpuTensor::from_slice(&ctx, &dov, &[b, l, h, dv])?.heads()?;
        let validation = |pass: &str, gpu: &[f32]| -> String {
            if n > 0 {
                return "-".into();
            }
            let s = shape(l);
            let f = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<_>>();
            let m = Masks {
                scale: 1.0,
                causal: cli.causal,
                ..Default::default()
            };
            let (w64, bias64) = (
                f(&uniform_values(h * da, 1, 1.0)),
                f(&uniform_values(h * da, 2, 0.5)),
            );
            let (a64, b64, v64) = (f(&av), f(&bv), f(&vv));
            let scores64 = reference::ScoreParams {
                w: &w64,
                bias: &bias64,
            };
            let c = match pass {
                "forward" => {
                    let (o, _) = reference::additive_forward(&s, &a64, &b64, &v64, scores64, &m);
                    compare(gpu, &o, FORWARD_ATOL, FORWARD_RTOL)
                }
                _ => {
                    let d_out64 = f(&dov);
                    let g =
                        reference::additive_backward(&s, &a64, &b64, &v64, scores64, &d_out64, &m);
                    compare(gpu, &g.da, BACKWARD_ATOL, BACKWARD_RTOL)
                }
            };
            match c.passed() {
                true => format!("ok ({:.1}% of tol)", 100.0 * c.worst_ratio),
                false => format!("FAILED ({:.1}x tol)", c.worst_ratio),
            }
        };
        let mut case = |pass: &str,
                        path: &str,
                        work: &mut dyn FnMut() -> Result<Vec<f32>, Error>|
         -> Result<f64, Error> {
            ctx.reset_peak_memory();
            let before = ctx.memory().current_bytes;
            let out = work()?;
            let mib = (ctx.memory().peak_bytes - before) as f64 / (1 << 20) as f64;
            let check = validation(pass, &out);
            let t = measure(&ctx, &timer, cli.reps, || work().map(|_| ()))?;
            println!(
                "| {l} | {pass} | {path} | {:.2} | {:.2}-{:.2} | {mib:.2} | {check} |",
                t.median(),
                t.min(),
                t.max()
            );
            rows.push(serde_json::json!({"length": l, "pass": pass, "path": path, "times_ms": t.times_ms, "tensor_mib": mib, "validation": check}));
            Ok(t.median())
        };
        let fused = case("forward", "fused", &mut || {
            additive_forward(&ctx, &a, &k, &v, scores, &opts)?
                .out
                .to_vec(&ctx)
        })?;
        let unfused = case("forward", "unfused", &mut || {
            additive_forward_unfused(&ctx, &a, &k, &v, scores, &opts)?
                .out
                .to_vec(&ctx)
        })?;
        let fwd = additive_forward(&ctx, &a, &k, &v, scores, &opts)?;
        let out = fwd.out.heads()?;
        let fused_backward = case("backward", "fused", &mut || {
            let g = additive_backward(
                &ctx,
                &ForwardViews {
                    q: &a,
                    k: &k,
                    v: &v,
                    out: &out,
                    lse: &fwd.lse,
                },
                scores,
                &d_out,
                &opts,
            )?;
            g.da.to_vec(&ctx)
        })?;
        let unfused_backward = case("backward", "unfused", &mut || {
            let g = additive_backward_unfused(&ctx, &a, &k, &v, scores, &d_out, &opts)?;
            g.da.to_vec(&ctx)
        })?;
        ratios.push((l, unfused / fused, unfused_backward / fused_backward));
    }
    if cli.tune {
        println!("\ntuning (the library's choice per key; its \"fused\" rows ran the winner):");
        for record in ctx.tuning_report() {
            println!("{record}");
        }
    }
    println!("\n| L | fused speed-up over unfused, forward | backward |\n|---|---|---|");
    for (l, forward, backward) in &ratios {
        println!("| {l} | {forward:.2}x | {backward:.2}x |");
    }
    if let Some(path) = &cli.json {
        let report = serde_json::json!({"adapter": ctx.report().to_string(), "cli": format!("{cli:?}"), "clock": timer.clock().name(), "cases": rows});
        wgpu_attention::bench::write_report(path, &serde_json::to_string_pretty(&report).unwrap())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(2);
        }
    };
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("additive-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
