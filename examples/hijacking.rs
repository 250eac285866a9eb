//! The seeds' "attention hijacking", runnable: one key of huge norm captures nearly all the attention
//! whatever its content, because a dot product grows with the key's length. Plants such a key among
//! random ones and prints the share of every query's attention it captures under dot-product scores,
//! key-norm clipping and cosine-similarity scores, each checked against the f64 CPU reference.
//!
//!     cargo run --release --example hijacking [-- --seq 128 --head-dim 64 --norm 40]
//!
//! The share is read off the fused kernel itself: with V the indicator of the planted key
//! (v_j = 1 for it, 0 for every other key), each output row is exactly that row's attention weight
//! on it. A key of ordinary norm gets about 1 / seq.

use std::process::ExitCode;

use wgpu_attention::reference::attention as reference;
use wgpu_attention::{attention_forward, AttentionOptions, AttentionShape, Context, GpuTensor};

/// Plants one key of large norm among ordinary keys and shows how much attention it takes.
#[derive(clap::Parser)]
#[command(name = "hijacking")]
struct Args {
    /// Keys in the sequence (at least 2).
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Norm of the planted key (positive).
    #[arg(long, default_value_t = 40.0)]
    norm: f32,
}

fn parse() -> Result<Args, String> {
    let a = <Args as clap::Parser>::parse();
    if a.seq < 2 || a.head_dim == 0 || !(a.norm.is_finite() && a.norm > 0.0) {
        return Err(format!(
            "--seq {} must be at least 2, --head-dim {} and --norm {} positive",
            a.seq, a.head_dim, a.norm
        ));
    }
    Ok(a)
}

/// Standard-normal-ish values from a fixed xorshift stream (sum of four uniforms, rescaled).
fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut uniform = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| ((0..4).map(|_| uniform()).sum::<f64>() - 2.0) as f32 * 3f32.sqrt())
        .collect()
}

fn main() -> ExitCode {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("hijacking: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("hijacking: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: &Args) -> Result<bool, wgpu_attention::Error> {
    let ctx = Context::from_env()?;
    println!("adapter: {}", ctx.report().name);
    let (l, d) = (a.seq, a.head_dim);
    // Queries and keys with unit-variance components (norm about sqrt(d)); the planted key is a
    // random direction, unrelated to any query, stretched to norm `a.norm`.
    let q = gaussian(l * d, 1);
    let mut k = gaussian(l * d, 2);
    let planted = l / 3;
    let row = &mut k[planted * d..(planted + 1) * d];
    let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
    row.iter_mut().for_each(|x| *x *= a.norm / norm);
    let mut v = vec![0.0f32; l];
    v[planted] = 1.0;
    let typical = (d as f32).sqrt();
    println!(
        "{l} keys of norm about {typical:.1}; key {planted} stretched to norm {:.1}, its direction random",
        a.norm
    );
    println!(
        "share of each query's attention on key {planted} (1/{l} = {:.4} would be fair):",
        1.0 / l as f32
    );
    println!();
    println!("| scores | mean share | max share | min share | worst error vs f64 reference |");
    println!("|---|---|---|---|---|");

    let upload = |data: &[f32], dim: usize| {
        GpuTensor::from_slice(&ctx, data, &[1, l, 1, dim]).and_then(|t| t.heads())
    };
    let (qv, kv, vv) = (upload(&q, d)?, upload(&k, d)?, upload(&v, 1)?);
    let shape = AttentionShape::of(&qv, &kv, &vv)?;
    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let clip = 1.5 * typical;
    let cases = [
        (
            "dot product, 1/sqrt(d)",
            AttentionOptions::new(),
            reference::Masks::default(),
        ),
        (
            "key-norm clipping at 1.5 sqrt(d)",
            AttentionOptions::new().key_norm_clip(clip),
            reference::Masks {
                key_clip: Some(clip as f64),
                ..Default::default()
            },
        ),
        (
            "cosine, scale 10",
            AttentionOptions::new().cosine(10.0),
            reference::Masks {
                scale: 10.0,
                normalize_qk: true,
                ..Default::default()
            },
        ),
    ];
    let mut ok = true;
    for (name, opts, masks) in cases {
        let masks = reference::Masks {
            scale: if masks.normalize_qk {
                masks.scale
            } else {
                1.0 / (d as f64).sqrt()
            },
            ..masks
        };
        let share = attention_forward(&ctx, &qv, &kv, &vv, &opts)?
            .out
            .to_vec(&ctx)?;
        let (expected, _) =
            reference::attention_forward(&shape, &f64s(&q), &f64s(&k), &f64s(&v), &masks);
        let worst = share
            .iter()
            .zip(&expected)
            .map(|(g, r)| (*g as f64 - r).abs())
            .fold(0.0f64, f64::max);
        ok &= worst < 1e-5;
        let mean = share.iter().sum::<f32>() / l as f32;
        let max = share.iter().copied().fold(0.0f32, f32::max);
        let min = share.iter().copied().fold(1.0f32, f32::min);
        println!("| {name} | {mean:.4} | {max:.4} | {min:.4} | {worst:.1e} |");
    }
    println!();
    if !ok {
        println!("validation: FAILED (error above 1e-5)");
    }
    Ok(ok)
}
