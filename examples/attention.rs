//! The main job for now: computes fused attention (forward and backward) on the default adapter,
//! checks it against the CPU reference and prints the adapter, worst errors and times.
//!
//!     cargo run --release --example attention [-- --batch 2 --seq 256 --heads 8 --kv-heads 2 --head-dim 64 --causal]
//!
//! Adapter selection: WGPU_BACKEND=vulkan|gl|metal|dx12, WGPU_ADAPTER_NAME=<substring>.

use std::process::ExitCode;
use std::time::Instant;

use wgpu_attention::reference::attention as reference;
use wgpu_attention::{
    attention_backward, attention_forward, AttentionOptions, AttentionShape, Context, GpuTensor,
};

/// Fused attention forward and backward on the default adapter, checked against the CPU
/// reference: prints the adapter, the worst errors and the times.
#[derive(clap::Parser)]
#[command(name = "attention")]
struct Args {
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Sequence length (queries and keys).
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (grouped-query attention when fewer than --heads).
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Causal mask.
    #[arg(long)]
    causal: bool,
}

fn main() -> ExitCode {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    let a = <Args as clap::Parser>::parse();
    match run(a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, a.causal) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn worst(gpu: &[f32], reference: &[f64], atol: f64, rtol: f64) -> (f64, bool) {
    let scale = reference
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |m, x| m.max(x.abs()));
    let mut worst = 0.0f64;
    let mut ok = true;
    for (&g, &r) in gpu.iter().zip(reference) {
        if r.is_infinite() {
            ok &= g as f64 == r;
            continue;
        }
        let err = (g as f64 - r).abs();
        ok &= err <= atol * scale + rtol * r.abs();
        worst = worst.max(err);
    }
    (worst, ok)
}

fn run(
    b: usize,
    l: usize,
    h: usize,
    hkv: usize,
    d: usize,
    causal: bool,
) -> wgpu_attention::Result<bool> {
    let ctx = Context::from_env()?;
    println!("adapter: {}", ctx.report());
    let n_q = b * l * h * d;
    let n_kv = b * l * hkv * d;
    let mut seed = 0x2545f491u32;
    let mut rand = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                seed as f32 / u32::MAX as f32 * 2.0 - 1.0
            })
            .collect()
    };
    let (q, k, v, d_out) = (rand(n_q), rand(n_kv), rand(n_kv), rand(n_q));
    let up = |x: &[f32], heads: usize| {
        GpuTensor::from_slice(&ctx, x, &[b, l, heads, d]).and_then(|t| t.heads())
    };
    let (qv, kv, vv, dov) = (up(&q, h)?, up(&k, hkv)?, up(&v, hkv)?, up(&d_out, h)?);
    let shape = AttentionShape::of(&qv, &kv, &vv)?;
    let opts = AttentionOptions::new().causal(causal);
    println!("shape: B={b} L={l} H={h} Hkv={hkv} D={d} causal={causal}");

    // Warm-up (pipeline compilation), then one timed forward and backward.
    let fwd = attention_forward(&ctx, &qv, &kv, &vv, &opts)?;
    attention_backward(&ctx, &qv, &kv, &vv, &fwd, &dov, &opts)?;
    ctx.synchronize()?;
    let t = Instant::now();
    let fwd = attention_forward(&ctx, &qv, &kv, &vv, &opts)?;
    ctx.synchronize()?;
    let t_fwd = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let grads = attention_backward(&ctx, &qv, &kv, &vv, &fwd, &dov, &opts)?;
    ctx.synchronize()?;
    let t_bwd = t.elapsed().as_secs_f64();

    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let masks = reference::Masks {
        scale: 1.0 / (d as f64).sqrt(),
        causal,
        q_lens: None,
        kv_lens: None,
        ..Default::default()
    };
    let (ref_out, ref_lse) =
        reference::attention_forward(&shape, &f64s(&q), &f64s(&k), &f64s(&v), &masks);
    let r = reference::attention_backward(
        &shape,
        &f64s(&q),
        &f64s(&k),
        &f64s(&v),
        &f64s(&d_out),
        &masks,
    );
    let mut all_ok = true;
    for (name, gpu, reference, atol, rtol) in [
        ("out", fwd.out.to_vec(&ctx)?, &ref_out, 1e-5, 1e-4),
        ("lse", fwd.lse.to_vec(&ctx)?, &ref_lse, 1e-5, 1e-4),
        ("dq", grads.dq.to_vec(&ctx)?, &r.dq, 1e-4, 1e-3),
        ("dk", grads.dk.to_vec(&ctx)?, &r.dk, 1e-4, 1e-3),
        ("dv", grads.dv.to_vec(&ctx)?, &r.dv, 1e-4, 1e-3),
    ] {
        let (err, ok) = worst(&gpu, reference, atol, rtol);
        all_ok &= ok;
        println!(
            "worst |gpu - reference| {name}: {err:.3e} {}",
            if ok { "ok" } else { "FAILED" }
        );
    }
    println!(
        "forward {:.2} ms ({:.2} GFLOP/s), backward {:.2} ms ({:.2} GFLOP/s)",
        t_fwd * 1e3,
        shape.forward_flops(causal) / t_fwd / 1e9,
        t_bwd * 1e3,
        shape.backward_flops(causal) / t_bwd / 1e9
    );
    println!(
        "{}",
        if all_ok {
            "validation: passed"
        } else {
            "validation: FAILED"
        }
    );
    Ok(all_ok)
}
