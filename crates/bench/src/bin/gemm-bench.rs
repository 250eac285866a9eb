//! The GEMMs of a Transformer layer on one adapter: the Linear forward `x W^T` and backward
//! (`dx = dy W` and `dW = dy^T x`, one recording) of the feed-forward block's two layers and the
//! attention's fused QKV projection, at the shapes of a training step (`rows` tokens), with GFLOP/s
//! and the share of the adapter's measured FMA peak, for each GEMM tile shape asked for
//! (`--tiles 64x64,128x64,coop,coop64,coop128`, see `GemmTiles`); with `--f16`, also the forward with f16 storage
//! (`linear_forward_f16`: f16 x, W and y, f32 arithmetic); with `--mixed`, mixed precision's forward
//! and backward (`linear_{forward,backward}_mixed_into`: an f16 weight copy, f16-rounded activations
//! and gradients, f32 results). Every case up to [`CHECKED_MACS`]
//! multiply-adds per product (all of the default shapes) is checked against the f64 reference
//! first; larger ones with `--check-all` (the reference takes seconds per product there).
//!
//! ```text
//! cargo run --release -p wgpu-attention-bench --bin gemm-bench -- [--rows 1024 --d-model 256 --d-ff 1024 --tiles 64x64,128x64 --f16 --mixed --reps 5 --json FILE]
//! ```

use std::process::ExitCode;

use clap::Parser;
use wgpu_attention::bench::fma::fma_peak_gflops;
use wgpu_attention::bench::{bench_options, measure, uniform_values, Timer};
use wgpu_attention::kernels::linear::{
    linear_backward_into, linear_backward_mixed_into, linear_forward_f16_into, linear_forward_into,
    linear_forward_mixed_into, Epilogue, LinearGrads,
};
use wgpu_attention::reference::compare::{compare, product_tolerances, F16_FORWARD_ATOL, F16_RTOL};
use wgpu_attention::reference::linear as reference;
use wgpu_attention::{parse_backends, Context, Error, GemmTiles, GpuTensor, GpuTensorF16};

#[derive(Parser, Debug)]
#[command(version, about = "Transformer-layer GEMMs on any wgpu adapter")]
struct Cli {
    /// Back end: vulkan, gl, metal, dx12 (default: WGPU_BACKEND, else all)
    #[arg(long)]
    backend: Option<String>,
    /// Case-insensitive substring of the adapter name (default: WGPU_ADAPTER_NAME)
    #[arg(long)]
    adapter: Option<String>,
    /// Token rows of the activations (batch x sequence length)
    #[arg(long, default_value_t = 1024)]
    rows: usize,
    #[arg(long, default_value_t = 256)]
    d_model: usize,
    /// Feed-forward width (default 4 * d_model)
    #[arg(long)]
    d_ff: Option<usize>,
    /// GEMM output tiles to compare, comma separated: 64x64 (the default kernel), 128x64, and the
    /// tensor cores' coop (128 x 128 where a product fills the GPU, else 64 x 64), coop64, coop128
    /// (their portable build where the device has no cooperative matrices)
    #[arg(long, value_delimiter = ',', default_value = "64x64,128x64")]
    tiles: Vec<String>,
    /// Also time the forward with f16 storage (needs SHADER_F16)
    #[arg(long)]
    f16: bool,
    /// Also time mixed precision's forward and backward (f16 weight copy, f16-rounded activations
    /// and gradients, f32 accumulation and results; needs SHADER_F16)
    #[arg(long)]
    mixed: bool,
    /// Timed runs per case (after warm-up)
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Write the figures as JSON
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Check every case against the f64 reference, also those past CHECKED_MACS
    #[arg(long)]
    check_all: bool,
}

/// The largest product (rows x in x out multiply-adds) checked against the CPU reference unless
/// `--check-all`: 1024 x 1024 x 1024. The reference is a plain f64 triple loop: at 4096 rows and
/// width 1024 it took 15-20 s per case on the GPU machine's CPU, longer than the timed runs.
const CHECKED_MACS: usize = 1 << 30;

fn run(cli: &Cli) -> Result<(), Error> {
    let backends = cli.backend.as_deref().map(parse_backends).transpose()?;
    let tiles = cli
        .tiles
        .iter()
        .map(|t| GemmTiles::parse(t))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ctx = Context::new_with(&bench_options(backends, cli.adapter.clone())?)?;
    println!("adapter: {}", ctx.report());
    let timer = Timer::new(&ctx, false);
    let peak = fma_peak_gflops(&ctx, &timer)?;
    let (rows, d) = (cli.rows, cli.d_model);
    let ff = cli.d_ff.unwrap_or(4 * d);
    println!(
        "clock: {}; {} timed runs per case after a warm-up; FMA peak {peak:.1} GFLOP/s (measured)\n",
        timer.clock().name(),
        cli.reps
    );
    println!("| tiles | layer | pass | products | GFLOP | median ms | min-max ms | GFLOP/s | % of FMA peak | validation |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut report = Vec::new();
    let has_f16 = ctx.device().features().contains(wgpu::Features::SHADER_F16);
    let (f16, mixed) = (cli.f16 && has_f16, cli.mixed && has_f16);
    if (cli.f16 || cli.mixed) && !has_f16 {
        println!("(no SHADER_F16 on this adapter: the f16 and mixed-precision cases are skipped)");
    }
    let mut passes = vec!["forward"];
    passes.extend(f16.then_some("forward f16"));
    passes.push("backward");
    if mixed {
        passes.extend(["forward mixed", "backward mixed"]);
    }
    let layers = [
        ("attention QKV", d, 3 * d),
        ("feed-forward in", d, ff),
        ("feed-forward out", ff, d),
    ];
    for (tile, (name, in_f, out_f)) in tiles
        .iter()
        .flat_map(|&t| layers.iter().map(move |&l| (t, l)))
    {
        ctx.set_gemm_tiles(Some(tile));
        let ctx = &ctx;
        let x = uniform_values(rows * in_f, 1, 1.0);
        let w = uniform_values(out_f * in_f, 2, 1.0 / (in_f as f32).sqrt());
        let b = uniform_values(out_f, 3, 0.1);
        let dy = uniform_values(rows * out_f, 4, 1.0);
        let xt = GpuTensor::from_slice(ctx, &x, &[rows, in_f])?;
        let wt = GpuTensor::from_slice(ctx, &w, &[out_f, in_f])?;
        let bt = GpuTensor::from_slice(ctx, &b, &[out_f])?;
        let dyt = GpuTensor::from_slice(ctx, &dy, &[rows, out_f])?;
        let y = GpuTensor::zeros(ctx, &[rows, out_f])?;
        let grads = LinearGrads {
            dx: GpuTensor::zeros(ctx, &[rows, in_f])?,
            d_weight: GpuTensor::zeros(ctx, &[out_f, in_f])?,
            d_bias: Some(GpuTensor::zeros(ctx, &[out_f])?),
        };
        let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let (x64, w64) = (f64s(&x), f64s(&w));
        // The f16 case's inputs are the f32 ones rounded; its reference sees the rounded values.
        let halves = match f16 {
            true => Some((
                GpuTensorF16::from_f32(ctx, &x, &[rows, in_f])?,
                GpuTensorF16::from_f32(ctx, &w, &[out_f, in_f])?,
                GpuTensorF16::zeros(ctx, &[rows, out_f])?,
            )),
            false => None,
        };
        // Mixed precision's f16 weight copy (the f32 weights rounded, as the trainer casts them).
        let w16 = match mixed {
            true => Some(GpuTensorF16::from_f32(ctx, &w, &[out_f, in_f])?),
            false => None,
        };
        let flop = 2.0 * (rows * in_f * out_f) as f64;
        for &pass in &passes {
            let record = || -> Result<(), Error> {
                let mut encoder = ctx.device().create_command_encoder(&Default::default());
                let none = Epilogue::default();
                match (pass, &halves, &w16) {
                    ("forward", _, _) => {
                        linear_forward_into(ctx, &mut encoder, &xt, &wt, Some(&bt), &y)?
                    }
                    ("forward f16", Some((x16, w16, y16)), _) => {
                        linear_forward_f16_into(ctx, &mut encoder, x16, w16, Some(&bt), y16)?
                    }
                    ("forward mixed", _, Some(w16)) => {
                        linear_forward_mixed_into(ctx, &mut encoder, &xt, w16, Some(&bt), none, &y)?
                    }
                    ("backward mixed", _, Some(w16)) => {
                        linear_backward_mixed_into(ctx, &mut encoder, &xt, w16, &dyt, &grads, none)?
                    }
                    _ => linear_backward_into(ctx, &mut encoder, &xt, &wt, &dyt, &grads)?,
                }
                ctx.queue().submit([encoder.finish()]);
                Ok(())
            };
            record()?;
            // The tensor-core tiles round f32 operands to f16 (f16 ones lose nothing), as mixed
            // precision does on any tiles.
            let rounded = tile.is_coop() || pass.ends_with("mixed");
            let [fwd_atol, fwd_rtol, bwd_atol, bwd_rtol] = product_tolerances(rounded);
            let checked = cli.check_all || rows * in_f * out_f <= CHECKED_MACS;
            let worst = match (pass, &halves) {
                _ if !checked => None,
                ("forward" | "forward mixed", _) => {
                    let r = reference::linear_forward(&x64, &w64, Some(&f64s(&b)), in_f);
                    Some(compare(&y.to_vec(ctx)?, &r, fwd_atol, fwd_rtol))
                }
                ("forward f16", Some((x16, w16, y16))) => {
                    let (x16, w16) = (f64s(&x16.to_vec(ctx)?), f64s(&w16.to_vec(ctx)?));
                    let r = reference::linear_forward(&x16, &w16, Some(&f64s(&b)), in_f);
                    Some(compare(&y16.to_vec(ctx)?, &r, F16_FORWARD_ATOL, F16_RTOL))
                }
                _ => {
                    let (rdx, rdw, _) = reference::linear_backward(&x64, &w64, &f64s(&dy), in_f);
                    let dx = compare(&grads.dx.to_vec(ctx)?, &rdx, bwd_atol, bwd_rtol);
                    let dw = compare(&grads.d_weight.to_vec(ctx)?, &rdw, bwd_atol, bwd_rtol);
                    Some(if dx.worst_ratio >= dw.worst_ratio {
                        dx
                    } else {
                        dw
                    })
                }
            };
            let failed = worst.as_ref().is_some_and(|w| !w.passed());
            let validation = match &worst {
                None => "not checked (size)".to_string(),
                Some(w) if w.passed() => format!("ok ({:.1}% of tol)", 100.0 * w.worst_ratio),
                Some(w) => format!("**FAILED** ({:.1}x tol)", w.worst_ratio),
            };
            let samples = measure(ctx, &timer, cli.reps, record)?;
            // The backward records dx and dW (two products of the forward's size) and the bias sums.
            let (products, gflop) = match pass {
                "forward" | "forward f16" | "forward mixed" => {
                    (format!("[{rows}x{in_f}] x [{in_f}x{out_f}]"), flop / 1e9)
                }
                _ => (
                    format!(
                        "[{rows}x{out_f}] x [{out_f}x{in_f}], [{out_f}x{rows}] x [{rows}x{in_f}]"
                    ),
                    2.0 * flop / 1e9,
                ),
            };
            let rate = gflop / (samples.median() / 1e3);
            println!(
                "| {} | {name} | {pass} | {products} | {gflop:.2} | {:.3} | {:.3}-{:.3} | {rate:.1} | {:.1}% | {validation} |",
                tile.name(),
                samples.median(),
                samples.min(),
                samples.max(),
                100.0 * rate / peak
            );
            report.push(serde_json::json!({
                "tiles": tile.name(), "layer": name, "pass": pass, "rows": rows, "in": in_f, "out": out_f,
                "gflop": gflop, "times_ms": samples.times_ms, "gflops": rate,
                "fraction_of_fma_peak": rate / peak, "validation": validation,
            }));
            if failed {
                return Err(Error::Device(format!(
                    "{name} {pass}: validation failed ({validation})"
                )));
            }
        }
    }
    // Which matrix build the coop tiles ran (the tensor cores, or the portable build and why).
    let qualifications: Vec<String> = ctx
        .qualifications()
        .iter()
        .map(|q| format!("{} {}", q.kernel, q.detail))
        .collect();
    for q in &qualifications {
        println!("qualification: {q}");
    }
    if let Some(path) = &cli.json {
        let doc = serde_json::json!({
            "adapter": ctx.report().to_string(), "clock": timer.clock().name(),
            "fma_peak_gflops": peak, "cases": report, "qualifications": qualifications,
        });
        wgpu_attention::bench::write_report(path, &serde_json::to_string_pretty(&doc).unwrap())?;
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
    if cli.rows == 0 || cli.d_model == 0 || cli.d_ff == Some(0) || cli.reps == 0 {
        eprintln!("gemm-bench: rows, d-model, d-ff and reps must be positive");
        return ExitCode::from(2);
    }
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gemm-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
