//! Fused vs unfused attention, forward and backward, at B = 1, H = 8, D = 64 over sequence lengths,
//! causal and not: median wall time with the device synchronised, GFLOP/s and peak tensor memory.
//!
//!     cargo bench --bench attention                      # L in 256, 512, 1024, 2048
//!     cargo bench --bench attention -- --lengths 256,512 --reps 5
//!
//! Select the adapter with WGPU_BACKEND / WGPU_ADAPTER_NAME. Figures on shared CPU drivers are noisy:
//! compare the ratios within one run.

use std::time::Instant;

use wgpu_attention::{
    attention_backward, attention_backward_unfused, attention_forward, attention_forward_unfused,
    AttentionOptions, AttentionShape, Context, GpuTensor, HeadsView,
};

struct Args {
    lengths: Vec<usize>,
    reps: usize,
    heads: usize,
    head_dim: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        lengths: vec![256, 512, 1024, 2048],
        reps: 3,
        heads: 8,
        head_dim: 64,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next().unwrap_or_else(|| {
                eprintln!("{name} needs a value");
                std::process::exit(2)
            })
        };
        let number = |name: &str, v: String| -> usize {
            v.parse().unwrap_or_else(|_| {
                eprintln!("{name}: {v:?} is not a number");
                std::process::exit(2)
            })
        };
        match a.as_str() {
            "--lengths" => {
                let v = value("--lengths");
                args.lengths = v
                    .split(',')
                    .map(|x| number("--lengths", x.to_string()))
                    .collect();
            }
            "--reps" => args.reps = number("--reps", value("--reps")).max(1),
            "--heads" => args.heads = number("--heads", value("--heads")),
            "--head-dim" => args.head_dim = number("--head-dim", value("--head-dim")),
            "--bench" => {} // passed by `cargo bench`
            other => {
                eprintln!("unknown argument {other:?}; use --lengths, --reps, --heads, --head-dim");
                std::process::exit(2)
            }
        }
    }
    args
}

/// Median and (min, max) of `reps` timed runs after one warm-up, plus the peak tensor memory.
fn measure(ctx: &Context, reps: usize, mut f: impl FnMut()) -> (f64, f64, f64, u64) {
    f();
    ctx.synchronize().unwrap();
    let mut times = Vec::with_capacity(reps);
    let mut peak = 0;
    for _ in 0..reps {
        ctx.reset_peak_memory();
        let t = Instant::now();
        f();
        ctx.synchronize().unwrap();
        times.push(t.elapsed().as_secs_f64() * 1e3);
        peak = peak.max(ctx.memory().peak_bytes);
    }
    times.sort_by(f64::total_cmp);
    (
        times[times.len() / 2],
        times[0],
        times[times.len() - 1],
        peak,
    )
}

fn random(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

fn main() {
    let args = parse_args();
    let ctx = Context::new().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    println!("adapter: {}", ctx.report());
    println!(
        "B=1 H={} D={}, median of {} runs after a warm-up (wall clock, device synchronised); memory = peak tensor bytes allocated during the call (inputs excluded)\n",
        args.heads, args.head_dim, args.reps
    );
    println!("| pass | L | causal | fused ms | unfused ms | fused GFLOP/s | unfused GFLOP/s | fused/unfused speed-up | fused MiB | unfused MiB |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut ratios = Vec::new();
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    for &l in &args.lengths {
        let (h, d) = (args.heads, args.head_dim);
        let up = |data: &[f32]| -> HeadsView {
            GpuTensor::from_slice(&ctx, data, &[1, l, h, d])
                .unwrap()
                .heads()
                .unwrap()
        };
        let n = l * h * d;
        let (q, k, v, d_out) = (
            up(&random(n, 1)),
            up(&random(n, 2)),
            up(&random(n, 3)),
            up(&random(n, 4)),
        );
        let shape = AttentionShape::of(&q, &k, &v).unwrap();
        for causal in [false, true] {
            let opts = AttentionOptions::new().causal(causal);
            let fwd_flops = shape.forward_flops(causal);
            let base = ctx.memory().current_bytes;
            let fused_f = measure(&ctx, args.reps, || {
                attention_forward(&ctx, &q, &k, &v, &opts).unwrap();
            });
            let unfused_f = measure(&ctx, args.reps, || {
                if let Err(e) = attention_forward_unfused(&ctx, &q, &k, &v, &opts) {
                    eprintln!("unfused forward L={l}: {e}");
                }
            });
            let saved = attention_forward(&ctx, &q, &k, &v, &opts).unwrap();
            let base_b = ctx.memory().current_bytes;
            let fused_b = measure(&ctx, args.reps, || {
                attention_backward(&ctx, &q, &k, &v, &saved, &d_out, &opts).unwrap();
            });
            let unfused_b = measure(&ctx, args.reps, || {
                if let Err(e) = attention_backward_unfused(&ctx, &q, &k, &v, &d_out, &opts) {
                    eprintln!("unfused backward L={l}: {e}");
                }
            });
            let bwd_flops = shape.backward_flops(causal);
            for (pass, fused, unfused, flops, base) in [
                ("forward", fused_f, unfused_f, fwd_flops, base),
                ("backward", fused_b, unfused_b, bwd_flops, base_b),
            ] {
                println!(
                    "| {pass} | {l} | {causal} | {:.2} ({:.2}-{:.2}) | {:.2} ({:.2}-{:.2}) | {:.2} | {:.2} | {:.2}x | {:.2} | {:.2} |",
                    fused.0, fused.1, fused.2, unfused.0, unfused.1, unfused.2,
                    flops / fused.0 / 1e6, flops / unfused.0 / 1e6, unfused.0 / fused.0,
                    mib(fused.3.saturating_sub(base)), mib(unfused.3.saturating_sub(base)),
                );
            }
            ratios.push((l, causal, fused_b.0 / fused_f.0));
        }
    }
    println!("\n| L | causal | fused backward / fused forward time |");
    println!("|---|---|---|");
    for (l, causal, r) in ratios {
        println!("| {l} | {causal} | {r:.2} |");
    }
}
