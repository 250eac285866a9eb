//! Trains a small encoder-decoder Transformer on the GPU to reverse digit sequences of varying
//! length (padded in the batch), evaluates exact-sequence accuracy by greedy decoding on held-out
//! sequences never seen in training, and saves checkpoints it can resume from.
//!
//! ```text
//! cargo run --release --example train_seq2seq -- [--steps N] [--checkpoint PATH] [--save-every N]
//!     [--resume] [--eval-only] [--eval-rerun] [--seed S] [--lr PEAK] [--precision f32|mixed]
//! ```
//!
//! `--precision mixed` trains with f16 products and dynamic loss scaling (`Precision::Mixed`) and
//! reports the loss scale and the skipped steps; evaluation decodes in f32 either way.
//!
//! Evaluation decodes incrementally through the key/value cache (`inference::Generator`: the
//! encoder once per batch, one decoder step per token, only the sampled ids read back);
//! `--eval-rerun` also decodes by re-running the whole model for every token, as before the cache
//! existed, and prints both accuracies and times.
//!
//! The checkpoint path is checked before training starts and written atomically every
//! `--save-every` steps (default 100) and at the end; `--resume` continues from the last save with
//! results bitwise identical to an uninterrupted run of the same seed (each step's batch and learning
//! rate depend only on the seed and the step number). A non-finite loss or gradient norm stops the run
//! with the step named, and the last checkpoint stays as it was. Ends with the line
//! `exact-sequence accuracy: <fraction>`.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;

use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::kernels::sampling::Sampling;
use wgpu_attention::{Context, Error};
use wgpu_attention_serve::{GenerateOptions, Generator, GeneratorShape};
use wgpu_attention_transformer::layers::Precision;
use wgpu_attention_transformer::model::{Batch, BatchShape, Transformer, TransformerConfig};
use wgpu_attention_transformer::training::checkpoint::{self, Checkpointer};
use wgpu_attention_transformer::training::Trainer;

const PAD: u32 = 0;
const BOS: u32 = 1;
const EOS: u32 = 2;
const DIGIT0: u32 = 3;
const MIN_LEN: usize = 3;
const MAX_LEN: usize = 10;
const BATCH: usize = 64;
const EVAL_SEQUENCES: usize = 512;

/// Trains a small encoder-decoder Transformer to reverse digit strings on the GPU, saving
/// checkpoints, then evaluates it by greedy decoding with the KV cache.
#[derive(clap::Parser)]
#[command(name = "train_seq2seq")]
struct Args {
    /// Optimizer steps to train for.
    #[arg(long, default_value_t = 400)]
    steps: usize,
    /// The checkpoint file (safetensors).
    #[arg(long, default_value = "target/train_seq2seq.safetensors")]
    checkpoint: PathBuf,
    /// Save a checkpoint every N steps (and at the end).
    #[arg(long, default_value_t = 100)]
    save_every: u32,
    /// Continue from the checkpoint's last save.
    #[arg(long)]
    resume: bool,
    /// Start a new run over an existing checkpoint (without it, an existing file is refused).
    #[arg(long)]
    overwrite: bool,
    /// Only evaluate the saved checkpoint (implies --resume).
    #[arg(long)]
    eval_only: bool,
    /// Also decode by re-running the whole model for every token (no cache), and compare.
    #[arg(long)]
    eval_rerun: bool,
    /// Seed of the training batches.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Peak learning rate of the warm-up and cosine schedule (positive).
    #[arg(long = "lr", default_value_t = 2e-3, allow_negative_numbers = true, value_parser = positive)]
    peak_lr: f32,
    /// The Linear layers' products: f32, or mixed (f16 products, f32 master weights, loss scaling).
    #[arg(long, default_value = "f32")]
    precision: Precision,
}

/// A positive, finite number, or a message with the value given.
fn positive(value: &str) -> Result<f32, String> {
    match value.parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(_) => Err(format!("{value} is not a positive finite number")),
        Err(e) => Err(format!("{value:?} is not a number ({e})")),
    }
}

fn parse_args() -> Result<Args, String> {
    let mut args = <Args as clap::Parser>::parse();
    args.resume |= args.eval_only;
    if !args.resume && !args.overwrite && args.checkpoint.exists() {
        return Err(format!(
            "{} exists: pass --resume to continue that run, or --overwrite to start a new one \
             over it",
            args.checkpoint.display()
        ));
    }
    Ok(args)
}

/// xorshift64*: a small deterministic generator.
struct Rng(u64);

impl Rng {
    /// The generator of one training step's batch: a function of the seed and the step only, so a
    /// resumed run draws what an uninterrupted one would.
    fn for_step(seed: u64, step: usize) -> Self {
        // splitmix64 of (seed, step): decorrelated streams, never the all-zero xorshift state.
        let mut z = seed
            .wrapping_mul(0x9E3779B97F4A7C15)
            .wrapping_add(step as u64 + 1)
            .wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn sequence(&mut self) -> Vec<u32> {
        let len = MIN_LEN + self.below(MAX_LEN - MIN_LEN + 1);
        (0..len).map(|_| DIGIT0 + self.below(10) as u32).collect()
    }
}

fn shape() -> BatchShape {
    BatchShape {
        batch: BATCH,
        src_len: MAX_LEN,
        tgt_len: MAX_LEN + 1,
    }
}

/// Source digits; decoder input BOS + reversed digits; targets reversed digits + EOS; padded.
fn make_batch(sequences: &[Vec<u32>]) -> Batch {
    let s = shape();
    let mut b = Batch::default();
    for seq in sequences {
        let rev: Vec<u32> = seq.iter().rev().copied().collect();
        let pad = |v: Vec<u32>, len: usize| {
            let mut v = v;
            v.resize(len, PAD);
            v
        };
        b.src.extend(pad(seq.clone(), s.src_len));
        b.src_lens.push(seq.len() as u32);
        b.tgt_in
            .extend(pad([vec![BOS], rev.clone()].concat(), s.tgt_len));
        b.tgt_out.extend(pad([rev, vec![EOS]].concat(), s.tgt_len));
        b.tgt_lens.push(seq.len() as u32 + 1);
    }
    b
}

/// Greedy decoding of every sequence through the key/value cache; returns the fraction decoded
/// exactly (digits then EOS).
fn evaluate_cached(
    ctx: &Context,
    model: &Transformer,
    sequences: &[Vec<u32>],
) -> Result<f64, Error> {
    let s = shape();
    let generator_shape = GeneratorShape {
        batch: BATCH,
        // BOS and up to MAX_LEN digits are fed; the EOS after them is only sampled.
        capacity: s.tgt_len,
        prefill_chunk: 1,
        src_len: s.src_len,
    };
    let mut generator = Generator::new(ctx, model, generator_shape)?;
    let options = GenerateOptions::default()
        .max_new_tokens(s.tgt_len)
        .sampling(Sampling::greedy())
        .stop(Some(EOS));
    let prompts = vec![vec![BOS]; BATCH];
    let mut exact = 0;
    for chunk in sequences.chunks(BATCH) {
        let mut group = chunk.to_vec();
        group.resize(BATCH, vec![DIGIT0; MIN_LEN]);
        let out = generator.generate(ctx, &prompts, Some(&group), &options)?;
        for (seq, tokens) in chunk.iter().zip(&out.tokens) {
            let expected: Vec<u32> = seq.iter().rev().copied().chain([EOS]).collect();
            exact += (*tokens == expected) as usize;
        }
    }
    Ok(exact as f64 / sequences.len() as f64)
}

/// Greedy decoding of every sequence by re-running the whole model for each token; returns the
/// fraction decoded exactly (digits then EOS).
fn evaluate_rerun(
    ctx: &Context,
    trainer: &mut Trainer,
    sequences: &[Vec<u32>],
) -> Result<f64, Error> {
    let s = shape();
    let vocab = trainer.model.config().vocab;
    let mut exact = 0;
    for chunk in sequences.chunks(BATCH) {
        let mut group = chunk.to_vec();
        group.resize(BATCH, vec![DIGIT0; MIN_LEN]);
        let mut batch = make_batch(&group);
        // Decoder input grows one predicted token per pass; nothing is predicted for the loss.
        batch.tgt_in.iter_mut().for_each(|t| *t = PAD);
        batch.tgt_out.iter_mut().for_each(|t| *t = PAD);
        for row in 0..BATCH {
            batch.tgt_in[row * s.tgt_len] = BOS;
            batch.tgt_lens[row] = s.tgt_len as u32;
        }
        let mut done = [false; BATCH];
        let mut output: Vec<Vec<u32>> = vec![Vec::new(); BATCH];
        for t in 0..s.tgt_len {
            trainer.forward(ctx, &batch)?;
            let logits = trainer.model.logits().to_vec(ctx)?;
            for row in 0..BATCH {
                if done[row] {
                    continue;
                }
                let at = (row * s.tgt_len + t) * vocab;
                let next = (0..vocab)
                    .max_by(|&a, &b| logits[at + a].total_cmp(&logits[at + b]))
                    .unwrap() as u32;
                if next == EOS {
                    done[row] = true;
                } else {
                    output[row].push(next);
                    if t + 1 < s.tgt_len {
                        batch.tgt_in[row * s.tgt_len + t + 1] = next;
                    }
                }
            }
        }
        for (i, seq) in chunk.iter().enumerate() {
            let rev: Vec<u32> = seq.iter().rev().copied().collect();
            if done[i] && output[i] == rev {
                exact += 1;
            }
        }
    }
    Ok(exact as f64 / sequences.len() as f64)
}

fn learning_rate(peak: f32, step: usize, total: usize) -> f32 {
    let warmup = 100usize;
    if step < warmup {
        peak * (step + 1) as f32 / warmup as f32
    } else {
        let progress = (step - warmup) as f32 / (total.max(warmup + 1) - warmup) as f32;
        peak * (0.05 + 0.95 * 0.5 * (1.0 + (std::f32::consts::PI * progress.min(1.0)).cos()))
    }
}

fn run(args: &Args) -> Result<f64, Error> {
    // Before anything else: a path that cannot be written fails now, not after training.
    let saver = Checkpointer::new(&args.checkpoint, args.save_every)?;
    let ctx = Context::from_env()?;
    println!("adapter: {}", ctx.report());
    let config = TransformerConfig::default()
        .vocab((DIGIT0 + 10) as usize)
        .d_model(64)
        .heads(4)
        .d_ff(128)
        .encoder_layers(2)
        .decoder_layers(2)
        .pre_ln(true)
        .pad_id(PAD);
    let model = Transformer::new(&ctx, config, shape(), 1)?;
    let adam = AdamWConfig::default()
        .lr(learning_rate(args.peak_lr, 0, args.steps))
        .beta1(0.9)
        .beta2(0.98)
        .eps(1e-8)
        .weight_decay(0.01)
        .max_grad_norm(Some(1.0));
    let mut trainer = Trainer::with_precision(&ctx, model, adam, args.precision)?;
    println!(
        "model: {config:?}; {} parameters in {} tensors; batch {BATCH}, lengths {MIN_LEN}..={MAX_LEN}; \
         precision {}",
        trainer.model.params.elements(),
        trainer.model.params.len(),
        args.precision.name()
    );

    // Held-out sequences: drawn from their own stream and excluded from training.
    let mut eval_rng = Rng(0x9E3779B97F4A7C15);
    let held_out: Vec<Vec<u32>> = (0..EVAL_SEQUENCES).map(|_| eval_rng.sequence()).collect();
    let held_out_set: HashSet<Vec<u32>> = held_out.iter().cloned().collect();

    if args.resume {
        match saver.resume(&ctx, &mut trainer)? {
            Some(step) => println!("resumed from {} at step {step}", args.checkpoint.display()),
            None => {
                return Err(Error::Checkpoint(format!(
                    "{}: no checkpoint to resume from; run without --resume first",
                    args.checkpoint.display()
                )))
            }
        }
    }
    let start_step = trainer.optimizer.steps() as usize;
    let started = Instant::now();
    let mut window = (Instant::now(), 0usize);
    let mut memory_reported = false;
    let steps = if args.eval_only {
        start_step
    } else {
        args.steps
    };
    for step in start_step..steps {
        let mut rng = Rng::for_step(args.seed, step);
        let sequences: Vec<Vec<u32>> = (0..BATCH)
            .map(|_| loop {
                let s = rng.sequence();
                if !held_out_set.contains(&s) {
                    break s;
                }
            })
            .collect();
        let batch = make_batch(&sequences);
        window.1 += batch.tgt_lens.iter().sum::<u32>() as usize
            + batch.src_lens.iter().sum::<u32>() as usize;
        trainer
            .optimizer
            .set_lr(learning_rate(args.peak_lr, step, steps))?;
        trainer.step(&ctx, &batch)?;
        if !memory_reported {
            let m = ctx.memory();
            println!(
                "device memory: {:.2} MiB allocated (parameters, gradients, optimizer state, activations); \
                 no allocation per step after this one",
                m.current_bytes as f64 / (1 << 20) as f64
            );
            memory_reported = true;
        }
        if saver.save_if_due(&ctx, &trainer)? {
            println!("saved {} (step {})", args.checkpoint.display(), step + 1);
        }
        if (step + 1) % 50 == 0 || step + 1 == steps {
            trainer.check_finite(&ctx)?;
            let loss = trainer.model.loss().to_vec(&ctx)?[0];
            let secs = window.0.elapsed().as_secs_f64();
            let scaling = match trainer.loss_scale_state(&ctx)? {
                Some(s) => format!("  loss scale {}  skipped {}", s.scale, s.skipped_steps),
                None => String::new(),
            };
            println!(
                "step {:>5}  loss {loss:.4}  lr {:.2e}  {:.0} tokens/s  ({:.0} s){scaling}",
                step + 1,
                learning_rate(args.peak_lr, step, steps),
                window.1 as f64 / secs,
                started.elapsed().as_secs_f64()
            );
            window = (Instant::now(), 0);
        }
    }
    // The last step's save, unless the loop just made it.
    if steps > start_step && !saver.due(trainer.optimizer.steps()) {
        checkpoint::save(&ctx, &trainer, &args.checkpoint)?;
        println!(
            "saved {} (step {})",
            args.checkpoint.display(),
            trainer.optimizer.steps()
        );
    }
    // One line to compare runs by (an interrupted and resumed run prints the same).
    let mut crc = crc32fast::Hasher::new();
    for t in trainer.model.params.values() {
        crc.update(bytemuck::cast_slice(&t.to_vec(&ctx)?));
    }
    println!(
        "parameters after step {}: crc32 {:08x}",
        trainer.optimizer.steps(),
        crc.finalize()
    );
    let t = Instant::now();
    let accuracy = evaluate_cached(&ctx, &trainer.model, &held_out)?;
    let cached_seconds = t.elapsed().as_secs_f64();
    println!(
        "evaluated {} held-out sequences by greedy decoding through the KV cache in {cached_seconds:.1} s",
        held_out.len(),
    );
    if args.eval_rerun {
        let t = Instant::now();
        let rerun = evaluate_rerun(&ctx, &mut trainer, &held_out)?;
        let seconds = t.elapsed().as_secs_f64();
        println!(
            "re-running the model for every token: accuracy {rerun:.4} in {seconds:.1} s ({:.1}x the cached time)",
            seconds / cached_seconds
        );
    }
    Ok(accuracy)
}

fn main() {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("train_seq2seq: {e}");
            std::process::exit(2);
        }
    };
    match run(&args) {
        Ok(accuracy) => println!("exact-sequence accuracy: {accuracy:.4}"),
        Err(e) => {
            eprintln!("train_seq2seq: {e}");
            if matches!(e, Error::NonFinite { .. }) && args.checkpoint.exists() {
                eprintln!(
                    "train_seq2seq: the last checkpoint, {}, is unchanged",
                    args.checkpoint.display()
                );
            }
            std::process::exit(1);
        }
    }
}
