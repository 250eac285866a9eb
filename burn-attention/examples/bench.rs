//! burn's attention against wgpu-attention's fused kernels inside burn, same run, same adapter:
//!
//! - forward: burn's flash kernel (cubek's unit routine, what burn runs for a plain causal or full
//!   problem once autotune picks it; `n/a` where it refuses the problem), burn's unfused fallback,
//!   and `burn_attention::fused_attention`;
//! - forward + backward under autodiff: burn's attention (unfused; burn has no fused backward)
//!   against the fused op, whose backward is the fused backward kernels.
//!
//! `cargo run --release -p burn-attention --example bench -- --lengths 128,256,512`

use std::time::Instant;

use burn::backend::wgpu::{CubeBackend, CubeTensor};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch};
use burn::tensor::{module::attention, ops::AttentionModuleOptions, Device, Distribution, Tensor};
use burn_attention::{fused_attention, FusedAttentionOptions};
use burn_cubecl::kernel::attention::{attention as cube_attention, AttentionStrategy};
use clap::Parser;
use wgpu_attention::{ContextOptions, KernelFamily};

#[derive(Parser, Debug)]
struct Args {
    /// Sequence lengths (self-attention, Lq = Lk).
    #[arg(long, value_delimiter = ',', default_values_t = [128, 256, 512])]
    lengths: Vec<usize>,
    #[arg(long, default_value_t = 2)]
    batch: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Timed calls per trial (after two warm-up calls); the median of three trials is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Only causal problems (default: both full and causal).
    #[arg(long)]
    causal_only: bool,
    /// The fused kernel family: cpu, gpu or coop (default: the adapter's own).
    #[arg(long)]
    family: Option<String>,
}

/// burn's flash attention kernel (cubek's unit routine), reachable only on the cubecl back end.
#[backend_extension(Cube)]
pub trait BurnFlash: Backend {
    /// Runs it (the output is dropped); `false` where the flash routine refuses the problem.
    fn burn_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
    ) -> bool;
}

impl BurnFlash for CubeBackend {
    fn burn_flash_attention(q: CubeTensor, k: CubeTensor, v: CubeTensor, causal: bool) -> bool {
        let options = AttentionModuleOptions {
            is_causal: causal,
            ..Default::default()
        };
        cube_attention(q, k, v, None, None, options, AttentionStrategy::FlashUnit).is_ok()
    }
}

/// Under burn's fusion (the crate's default feature): the cubecl tensors under the fusion ones.
#[cfg(feature = "fusion")]
impl BurnFlash for burn_fusion::Fusion<CubeBackend> {
    fn burn_flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        causal: bool,
    ) -> bool {
        let client = q.client.clone();
        let resolve = |t| client.resolve_tensor_float::<CubeBackend>(t);
        CubeBackend::burn_flash_attention(resolve(q), resolve(k), resolve(v), causal)
    }
}

fn burn_flash(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool) -> Option<()> {
    Dispatch::burn_flash_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        causal,
    )
    .then_some(())
}

/// Median over three trials of the mean time (ms) of `reps` calls of `run`, after two warm-up
/// calls; `None` if `run` declines.
fn time(device: &Device, reps: usize, mut run: impl FnMut() -> Option<()>) -> Option<f64> {
    let ctx = burn_attention::context(device).expect("registered");
    let wait = || {
        device.sync().expect("burn sync");
        ctx.synchronize().expect("attention sync");
    };
    for _ in 0..2 {
        run()?;
    }
    wait();
    let mut trials: Vec<f64> = (0..3)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..reps {
                run();
            }
            wait();
            start.elapsed().as_secs_f64() * 1e3 / reps as f64
        })
        .collect();
    trials.sort_by(f64::total_cmp);
    Some(trials[1])
}

fn show(ms: Option<f64>) -> String {
    ms.map_or("n/a".into(), |ms| format!("{ms:.2}"))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}x", a / b),
        _ => "n/a".into(),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    wgpu_attention::quiet_headless_start_up();
    let args = Args::parse();
    let mut options = ContextOptions::new();
    if let Some(family) = &args.family {
        options = options.kernel_family(KernelFamily::parse(family)?);
    }
    let device = burn_attention::init(Device::wgpu_options(), &options)?;
    let ctx = burn_attention::context(&device)?;
    println!(
        "adapter: {} ({:?}), fused family {:?}; batch {}, heads {}, head_dim {}, f32, {} calls x 3 trials",
        ctx.report().name,
        ctx.report().backend,
        ctx.kernel_family(),
        args.batch,
        args.heads,
        args.head_dim,
        args.reps
    );
    println!(
        "\n{:>6} {:>7} | {:>10} {:>10} {:>10} {:>9} {:>9} | {:>10} {:>10} {:>9}",
        "L",
        "causal",
        "burn flash",
        "burn unfus",
        "fused",
        "flash/fus",
        "unfus/fus",
        "burn f+b",
        "fused f+b",
        "burn/fus"
    );
    let grad_device = device.clone().autodiff();
    let masks: &[bool] = match args.causal_only {
        true => &[true],
        false => &[false, true],
    };
    for &l in &args.lengths {
        for &causal in masks {
            let shape = [args.batch, args.heads, l, args.head_dim];
            let make = |d: &Device| Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), d);
            let (q, k, v) = (make(&device), make(&device), make(&device));
            let burn_options = AttentionModuleOptions {
                is_causal: causal,
                ..Default::default()
            };
            let fused_options = FusedAttentionOptions::new().causal(causal);
            let flash = time(&device, args.reps, || {
                burn_flash(q.clone(), k.clone(), v.clone(), causal)
            });
            let unfused = time(&device, args.reps, || {
                let out = attention(q.clone(), k.clone(), v.clone(), None, None, burn_options);
                drop(out);
                Some(())
            });
            let fused = time(&device, args.reps, || {
                let out = fused_attention(q.clone(), k.clone(), v.clone(), &fused_options);
                drop(out.expect("fused attention"));
                Some(())
            });
            // Forward and backward under autodiff.
            let tracked =
                |t: &Tensor<4>| Tensor::<4>::from_data(t.to_data(), &grad_device).require_grad();
            let (gq, gk, gv) = (tracked(&q), tracked(&k), tracked(&v));
            let upstream = make(&grad_device);
            let train = |fused: bool| {
                let out = match fused {
                    true => fused_attention(gq.clone(), gk.clone(), gv.clone(), &fused_options)
                        .expect("fused attention"),
                    false => {
                        attention(gq.clone(), gk.clone(), gv.clone(), None, None, burn_options)
                    }
                };
                let grads = (out * upstream.clone()).sum().backward();
                for t in [&gq, &gk, &gv] {
                    drop(t.grad(&grads).expect("a gradient"));
                }
                Some(())
            };
            let burn_train = time(&grad_device, args.reps, || train(false));
            let fused_train = time(&grad_device, args.reps, || train(true));
            println!(
                "{l:>6} {causal:>7} | {:>10} {:>10} {:>10} {:>9} {:>9} | {:>10} {:>10} {:>9}",
                show(flash),
                show(unfused),
                show(fused),
                ratio(flash, fused),
                ratio(unfused, fused),
                show(burn_train),
                show(fused_train),
                ratio(burn_train, fused_train)
            );
        }
    }
    println!("\nms per call; ratios > 1 mean the fused op is faster.");
    Ok(())
}
