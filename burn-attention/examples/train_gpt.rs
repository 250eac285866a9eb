//! A small GPT-style decoder in burn, trained twice on the same data from the same seed: once with
//! burn's attention (unfused, differentiated by burn's autodiff) and once with wgpu-attention's
//! fused kernels through `burn_attention::fused_attention`. Prints the two loss curves and step
//! times side by side (and writes them as CSV with `--csv`).
//!
//! The task: a sequence of random digits, a separator, then the digits reversed; the loss counts the
//! reversed half, which only attention to the right earlier position can predict.
//!
//! `cargo run --release -p burn-attention --example train_gpt -- --steps 300`

use std::time::Instant;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::{activation::gelu, module::attention, ops::AttentionModuleOptions, TensorData};
use burn_attention::{fused_attention, FusedAttentionOptions};
use clap::Parser;
use wgpu_attention::ContextOptions;

#[derive(Parser, Debug)]
struct Args {
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Digits per sequence (the sequence is twice this plus one).
    #[arg(long, default_value_t = 15)]
    digits: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Print the losses every this many steps.
    #[arg(long, default_value_t = 25)]
    every: usize,
    /// Write `step,loss_burn,loss_fused,ms_burn,ms_fused` here.
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
}

const SEP: usize = 10;
/// The target of the positions not scored (the digits before the separator): ignored by the loss.
const IGNORED: usize = 11;
const VOCAB: usize = 12;

/// Which attention a run uses.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Attention {
    Burn,
    Fused,
}

#[derive(Module, Debug)]
struct Block {
    norm1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    norm2: LayerNorm,
    up: Linear,
    down: Linear,
}

#[derive(Module, Debug)]
struct Gpt {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
}

impl Gpt {
    fn new(args: &Args, device: &Device) -> Self {
        let d = args.d_model;
        let block = || Block {
            norm1: LayerNormConfig::new(d).init(device),
            qkv: LinearConfig::new(d, 3 * d).init(device),
            proj: LinearConfig::new(d, d).init(device),
            norm2: LayerNormConfig::new(d).init(device),
            up: LinearConfig::new(d, 4 * d).init(device),
            down: LinearConfig::new(4 * d, d).init(device),
        };
        Self {
            tokens: EmbeddingConfig::new(VOCAB, d).init(device),
            positions: EmbeddingConfig::new(2 * args.digits + 1, d).init(device),
            blocks: (0..args.layers).map(|_| block()).collect(),
            norm: LayerNormConfig::new(d).init(device),
            head: LinearConfig::new(d, VOCAB).init(device),
        }
    }

    /// Logits `[B, L, VOCAB]` of tokens `[B, L]`.
    fn forward(&self, tokens: Tensor<2, Int>, heads: usize, which: Attention) -> Tensor<3> {
        let [b, l] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..l as i64, &device)
            .reshape([1, l])
            .repeat_dim(0, b);
        let mut x = self.tokens.forward(tokens) + self.positions.forward(positions);
        for block in &self.blocks {
            let d = x.dims()[2];
            let qkv = block.qkv.forward(block.norm1.forward(x.clone()));
            // [B, L, 3, H, Dh] -> three [B, H, L, Dh] views (strided: the fused op reads them
            // where they are).
            let qkv = qkv.reshape([b, l, 3, heads, d / heads]);
            let part = |i: usize| {
                qkv.clone()
                    .narrow(2, i, 1)
                    .reshape([b, l, heads, d / heads])
                    .swap_dims(1, 2)
            };
            let (q, k, v) = (part(0), part(1), part(2));
            let attended = match which {
                Attention::Burn => {
                    let options = AttentionModuleOptions {
                        is_causal: true,
                        ..Default::default()
                    };
                    attention(q, k, v, None, None, options)
                }
                Attention::Fused => {
                    let options = FusedAttentionOptions::new().causal(true);
                    fused_attention(q, k, v, &options).expect("fused attention")
                }
            };
            let attended = attended.swap_dims(1, 2).reshape([b, l, d]);
            x = x + block.proj.forward(attended);
            let hidden = gelu(block.up.forward(block.norm2.forward(x.clone())));
            x = x + block.down.forward(hidden);
        }
        self.head.forward(self.norm.forward(x))
    }
}

/// A batch of the reversal task: tokens `[B, 2n+1]` and next-token targets (ignored before the
/// separator), from a deterministic generator so both runs see the same data.
fn batch(args: &Args, step: usize, device: &Device) -> (Tensor<2, Int>, Tensor<1, Int>) {
    let n = args.digits;
    let l = 2 * n + 1;
    let mut state = args.seed ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next_digit = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 10) as i64
    };
    let (mut tokens, mut targets) = (Vec::new(), Vec::new());
    for _ in 0..args.batch {
        let digits: Vec<i64> = (0..n).map(|_| next_digit()).collect();
        let mut sequence = digits.clone();
        sequence.push(SEP as i64);
        sequence.extend(digits.iter().rev());
        for i in 0..l {
            // Position i predicts token i + 1; only the reversed half (after the separator) counts.
            let target = match i >= n && i + 1 < l {
                true => sequence[i + 1],
                false => IGNORED as i64,
            };
            targets.push(target);
        }
        tokens.extend(sequence);
    }
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(tokens, [args.batch, l]), device);
    let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [args.batch * l]), device);
    (tokens, targets)
}

/// Trains one model; returns the loss and the step time (ms) of every step.
fn train(args: &Args, device: &Device, which: Attention) -> Vec<(f32, f64)> {
    device.seed(args.seed);
    let mut model = Gpt::new(args, device);
    let mut optimizer = AdamWConfig::new().with_weight_decay(0.0).init();
    let loss_fn = CrossEntropyLossConfig::new()
        .with_pad_tokens(Some(vec![IGNORED]))
        .init(device);
    let mut curve = Vec::with_capacity(args.steps);
    for step in 0..args.steps {
        let (tokens, targets) = batch(args, step, device);
        let start = Instant::now();
        let logits = model.forward(tokens, args.heads, which);
        let [b, l, v] = logits.dims();
        let loss = loss_fn.forward(logits.reshape([b * l, v]), targets);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(args.lr, model, grads);
        // Reading the loss waits for the step's work: the time covers it all.
        let loss = loss.into_scalar::<f32>();
        curve.push((loss, start.elapsed().as_secs_f64() * 1e3));
    }
    // Greedy accuracy on a batch no step trained on, without autodiff.
    let (tokens, targets) = batch(args, usize::MAX / 2, &device.clone().inner());
    let valid = model.valid();
    let logits = valid.forward(tokens, args.heads, which);
    let [b, l, v] = logits.dims();
    let predicted: Vec<i64> = values_i64(logits.reshape([b * l, v]).argmax(1));
    let targets: Vec<i64> = values_i64(targets.reshape([b * l, 1]));
    let scored = targets.iter().filter(|&&t| t != IGNORED as i64).count();
    let right = (predicted.iter().zip(&targets))
        .filter(|(p, t)| **t != IGNORED as i64 && p == t)
        .count();
    println!(
        "{which:?}: held-out accuracy on the reversed digits {:.1}% ({right}/{scored})",
        100.0 * right as f64 / scored as f64
    );
    curve
}

fn values_i64(t: Tensor<2, Int>) -> Vec<i64> {
    t.into_data()
        .convert::<i64>()
        .try_into_vec()
        .expect("integer data")
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    wgpu_attention::quiet_headless_start_up();
    let args = Args::parse();
    let device = burn_attention::init(Device::wgpu_options(), &ContextOptions::new())?.autodiff();
    let ctx = burn_attention::context(&device)?;
    println!(
        "adapter: {} ({:?}); {} layers, {} heads, d_model {}, sequence {}, batch {}",
        ctx.report().name,
        ctx.report().backend,
        args.layers,
        args.heads,
        args.d_model,
        2 * args.digits + 1,
        args.batch
    );
    let burn = train(&args, &device, Attention::Burn);
    let fused = train(&args, &device, Attention::Fused);
    println!("\n step   loss (burn)  loss (fused)   ms (burn)  ms (fused)");
    for (step, (b, f)) in burn.iter().zip(&fused).enumerate() {
        if step % args.every == 0 || step + 1 == args.steps {
            println!(
                "{step:5}   {:10.4}   {:11.4}   {:9.2}   {:9.2}",
                b.0, f.0, b.1, f.1
            );
        }
    }
    // The first steps compile pipelines; the medians are of the rest.
    let warm = |curve: &[(f32, f64)]| median(curve.iter().skip(5).map(|x| x.1).collect());
    let (ms_burn, ms_fused) = (warm(&burn), warm(&fused));
    println!(
        "median step (after 5): burn {ms_burn:.2} ms, fused {ms_fused:.2} ms, burn / fused {:.2}x",
        ms_burn / ms_fused
    );
    let last = |curve: &[(f32, f64)]| {
        let tail = &curve[curve.len().saturating_sub(10)..];
        tail.iter().map(|x| x.0).sum::<f32>() / tail.len() as f32
    };
    println!(
        "mean loss of the last 10 steps: burn {:.4}, fused {:.4}",
        last(&burn),
        last(&fused)
    );
    if let Some(path) = &args.csv {
        let mut text = String::from("step,loss_burn,loss_fused,ms_burn,ms_fused\n");
        for (step, (b, f)) in burn.iter().zip(&fused).enumerate() {
            text += &format!("{step},{},{},{:.3},{:.3}\n", b.0, f.0, b.1, f.1);
        }
        std::fs::write(path, text)?;
    }
    Ok(())
}
