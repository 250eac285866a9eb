//! Trains a small decoder-only language model (RoPE) on the GPU to continue `BOS digits SEP` with
//! the digits reversed and `EOS`, then generates from held-out prompts through the key/value cache:
//! greedy (exact-sequence accuracy), a few sampled continuations (temperature, top-k, top-p), and
//! tokens/s, against generating the same tokens by re-running the whole model for every new token.
//!
//! ```text
//! cargo run --release --example generate -- [--steps N] [--seed S] [--checkpoint PATH] [--load]
//! ```
//!
//! The trained model is saved to `--checkpoint` (default `target/generate.safetensors`); `--load`
//! generates from that checkpoint without training.
//!
//! With `--model DIR` it instead continues `--prompt` with a published model (a Hugging Face
//! directory: `config.json`, safetensors weights, `tokenizer.json`), streaming the text:
//!
//! ```text
//! cargo run --release --example generate -- --model DIR --prompt "Once upon a time" \
//!     [--max-new-tokens N] [--temperature T --top-k K --top-p P] [--seed S]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::kernels::sampling::Sampling;
use wgpu_attention::{Context, Error};
use wgpu_attention_serve::{CacheLayout, GenerateOptions, Generator, GeneratorShape};
use wgpu_attention_transformer::model::{Batch, BatchShape, Transformer, TransformerConfig};
use wgpu_attention_transformer::training::checkpoint;
use wgpu_attention_transformer::training::Trainer;

const PAD: u32 = 0;
const BOS: u32 = 1;
const SEP: u32 = 2;
const EOS: u32 = 3;
const DIGIT0: u32 = 4;
const MIN_LEN: usize = 3;
const MAX_LEN: usize = 8;
/// `BOS digits SEP reversed`: the longest decoder input (EOS is only predicted).
const SEQ: usize = 2 * MAX_LEN + 2;
const BATCH: usize = 64;
const EVAL_PROMPTS: usize = 256;

/// Trains a small decoder-only model to reverse digit strings (or loads it) and generates with the
/// KV cache: greedy, sampled and batched decoding.
#[derive(clap::Parser)]
#[command(name = "generate")]
struct Args {
    /// Training steps when not loading.
    #[arg(long, default_value_t = 500)]
    steps: usize,
    /// Seed of training and sampling.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The checkpoint file (safetensors).
    #[arg(long, default_value = "target/generate.safetensors")]
    checkpoint: PathBuf,
    /// Load the checkpoint instead of training.
    #[arg(long)]
    load: bool,
    /// A Hugging Face model directory to continue `--prompt` with (no training).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The text to continue (with `--model`).
    #[arg(long, default_value = "The")]
    prompt: String,
    /// Tokens to generate (with `--model`).
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature (with `--model`; 0 is greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k likeliest tokens (with `--temperature`).
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the smallest set of tokens with this probability (with `--temperature`).
    #[arg(long)]
    top_p: Option<f32>,
}

/// Continues `--prompt` with the model in `--model`, printing tokens as they are generated.
fn run_pretrained(args: &Args, dir: &std::path::Path) -> Result<(), String> {
    use std::io::Write;
    use wgpu_attention_transformer::model::pretrained::Pretrained;
    let ctx = Context::from_env().map_err(|e| e.to_string())?;
    let checkpoint = Pretrained::open(dir).map_err(|e| e.to_string())?;
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| format!("{}: {e}", dir.join("tokenizer.json").display()))?;
    let mut ids = tokenizer
        .encode(args.prompt.as_str(), true)
        .map_err(|e| e.to_string())?
        .get_ids()
        .to_vec();
    if ids.is_empty() {
        ids.extend(checkpoint.bos_token_id());
    }
    let capacity = ids.len() + args.max_new_tokens;
    let shape = GeneratorShape {
        batch: 1,
        capacity,
        prefill_chunk: ids.len().min(256),
        src_len: 0,
    };
    // The weights alone (no gradients or training buffers): decoding needs nothing else.
    let mut generator =
        Generator::from_pretrained(&ctx, &checkpoint, shape, CacheLayout::Contiguous)
            .map_err(|e| e.to_string())?;
    let mut sampling = match args.temperature {
        t if t > 0.0 => Sampling::temperature(t, args.seed),
        _ => Sampling::greedy(),
    };
    if let Some(k) = args.top_k {
        sampling = sampling.top_k(k);
    }
    if let Some(p) = args.top_p {
        sampling = sampling.top_p(p);
    }
    println!(
        "{:?} model, {} layers, d_model {}, on {}",
        checkpoint.architecture(),
        checkpoint.config().decoder_layers,
        checkpoint.config().d_model,
        ctx.report().name
    );
    print!("{}", args.prompt);
    let start = Instant::now();
    generator
        .prefill(&ctx, std::slice::from_ref(&ids), None)
        .map_err(|e| e.to_string())?;
    let prefill = start.elapsed().as_secs_f64();
    let (mut text, mut generated) = (String::new(), Vec::new());
    let start = Instant::now();
    for _ in 0..args.max_new_tokens {
        let id = generator
            .sample(&ctx, &sampling)
            .map_err(|e| e.to_string())?[0];
        if Some(id) == checkpoint.eos_token_id() {
            break;
        }
        generated.push(id);
        // Decode the whole continuation each time: byte-level tokens may complete a character late.
        let now = tokenizer
            .decode(&generated, true)
            .map_err(|e| e.to_string())?;
        print!("{}", now.strip_prefix(text.as_str()).unwrap_or(&now));
        std::io::stdout().flush().ok();
        text = now;
        if generated.len() + ids.len() >= capacity {
            break;
        }
        generator
            .step(&ctx, &[Some(id)])
            .map_err(|e| e.to_string())?;
    }
    let decode = start.elapsed().as_secs_f64();
    println!(
        "\n\nprompt {} tokens in {:.3} s ({:.1} tokens/s), {} new tokens in {:.3} s ({:.1} tokens/s)",
        ids.len(),
        prefill,
        ids.len() as f64 / prefill,
        generated.len(),
        decode,
        generated.len() as f64 / decode.max(1e-9)
    );
    Ok(())
}

fn parse_args() -> Result<Args, String> {
    Ok(<Args as clap::Parser>::parse())
}

/// xorshift64*, seeded per use.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545F4914F6CDD1D) % n as u64) as usize
    }

    fn digits(&mut self) -> Vec<u32> {
        let len = MIN_LEN + self.below(MAX_LEN - MIN_LEN + 1);
        (0..len).map(|_| DIGIT0 + self.below(10) as u32).collect()
    }
}

fn prompt(digits: &[u32]) -> Vec<u32> {
    [&[BOS], digits, &[SEP]].concat()
}

fn answer(digits: &[u32]) -> Vec<u32> {
    digits.iter().rev().copied().chain([EOS]).collect()
}

/// Decoder input `BOS digits SEP reversed`; the loss only on the reversed digits and EOS.
fn make_batch(sequences: &[Vec<u32>]) -> Batch {
    let mut b = Batch::default();
    for digits in sequences {
        let n = digits.len();
        let mut tgt_in = prompt(digits);
        tgt_in.extend(digits.iter().rev());
        let mut tgt_out = vec![PAD; n + 1];
        tgt_out.extend(answer(digits));
        b.tgt_lens.push(tgt_in.len() as u32);
        tgt_in.resize(SEQ, PAD);
        tgt_out.resize(SEQ, PAD);
        b.tgt_in.extend(tgt_in);
        b.tgt_out.extend(tgt_out);
    }
    b
}

fn config() -> TransformerConfig {
    TransformerConfig::default()
        .vocab((DIGIT0 + 10) as usize)
        .d_model(64)
        .heads(4)
        .d_ff(128)
        .encoder_layers(0)
        .decoder_layers(2)
        .pre_ln(true)
        .pad_id(PAD)
        .rope_base(Some(10000.0))
}

fn learning_rate(step: usize, total: usize) -> f32 {
    let (peak, warmup) = (2e-3, 100);
    if step < warmup {
        return peak * (step + 1) as f32 / warmup as f32;
    }
    let progress = (step - warmup) as f32 / (total.max(warmup + 1) - warmup) as f32;
    peak * (0.05 + 0.95 * 0.5 * (1.0 + (std::f32::consts::PI * progress.min(1.0)).cos()))
}

fn train(
    ctx: &Context,
    trainer: &mut Trainer,
    args: &Args,
    held_out: &[Vec<u32>],
) -> Result<(), Error> {
    let started = Instant::now();
    for step in 0..args.steps {
        let mut rng = Rng::new(args.seed ^ (step as u64 + 1) << 20);
        let sequences: Vec<Vec<u32>> = (0..BATCH)
            .map(|_| loop {
                let s = rng.digits();
                if !held_out.contains(&s) {
                    break s;
                }
            })
            .collect();
        trainer.optimizer.set_lr(learning_rate(step, args.steps))?;
        trainer.step(ctx, &make_batch(&sequences))?;
        if (step + 1) % 50 == 0 || step + 1 == args.steps {
            trainer.check_finite(ctx)?;
            let loss = trainer.model.loss().to_vec(ctx)?[0];
            println!(
                "step {:>4}  loss {loss:.4}  ({:.0} s)",
                step + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// Greedy continuation of every prompt by re-running the whole model for each new token.
fn generate_by_rerunning(
    ctx: &Context,
    trainer: &mut Trainer,
    prompts: &[Vec<u32>],
) -> Result<Vec<Vec<u32>>, Error> {
    let vocab = trainer.model.config().vocab;
    let mut out = Vec::new();
    for chunk in prompts.chunks(BATCH) {
        let mut seqs: Vec<Vec<u32>> = chunk.to_vec();
        seqs.resize(BATCH, prompt(&[DIGIT0; MIN_LEN]));
        let mut done = [false; BATCH];
        let mut generated = vec![Vec::new(); BATCH];
        while done.iter().any(|d| !d) {
            let mut batch = Batch::default();
            for s in &seqs {
                // Finished rows are fed too (the batch is fixed), cut to the model's length.
                let mut t = s[..s.len().min(SEQ)].to_vec();
                batch.tgt_lens.push(t.len() as u32);
                t.resize(SEQ, PAD);
                batch.tgt_in.extend(t);
            }
            batch.tgt_out = vec![PAD; BATCH * SEQ];
            trainer.forward(ctx, &batch)?;
            let logits = trainer.model.logits().to_vec(ctx)?;
            for b in 0..BATCH {
                if done[b] {
                    continue;
                }
                let at = (b * SEQ + seqs[b].len() - 1) * vocab;
                let next = (0..vocab)
                    .max_by(|&x, &y| logits[at + x].total_cmp(&logits[at + y]).then(y.cmp(&x)))
                    .unwrap() as u32;
                generated[b].push(next);
                seqs[b].push(next);
                // A full input still predicts one more token, as the cache does.
                done[b] = next == EOS || seqs[b].len() > SEQ;
            }
        }
        out.extend(generated.into_iter().take(chunk.len()));
    }
    Ok(out)
}

fn show(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| match t {
            BOS => "<s>".to_string(),
            SEP => "|".to_string(),
            EOS => "</s>".to_string(),
            PAD => "_".to_string(),
            d => (d - DIGIT0).to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn run(args: &Args) -> Result<(), Error> {
    let ctx = Context::from_env()?;
    println!("adapter: {}", ctx.report());
    let shape = BatchShape {
        batch: BATCH,
        src_len: 0,
        tgt_len: SEQ,
    };
    let model = Transformer::new(&ctx, config(), shape, args.seed)?;
    let mut trainer = Trainer::new(&ctx, model, AdamWConfig::default())?;
    println!(
        "model: decoder-only, d_model 64, 4 heads, 2 layers, RoPE; {} parameters",
        trainer.model.params.elements()
    );
    let mut rng = Rng::new(0xD1CE);
    let held_out: Vec<Vec<u32>> = (0..EVAL_PROMPTS).map(|_| rng.digits()).collect();
    if args.load {
        checkpoint::load(&ctx, &mut trainer, &args.checkpoint)?;
        println!("loaded {}", args.checkpoint.display());
    } else {
        checkpoint::check_writable(&args.checkpoint)?;
        train(&ctx, &mut trainer, args, &held_out)?;
        checkpoint::save(&ctx, &trainer, &args.checkpoint)?;
        println!("saved {}", args.checkpoint.display());
    }

    let prompts: Vec<Vec<u32>> = held_out.iter().map(|d| prompt(d)).collect();
    let generator_shape = GeneratorShape {
        batch: BATCH,
        capacity: SEQ,
        prefill_chunk: MAX_LEN + 2,
        src_len: 0,
    };
    let mut generator = Generator::new(&ctx, &trainer.model, generator_shape)?;
    let greedy = GenerateOptions::default()
        .max_new_tokens(MAX_LEN + 1)
        .sampling(Sampling::greedy())
        .stop(Some(EOS));
    // Compile every pipeline before timing.
    generator.generate(&ctx, &prompts[..BATCH], None, &greedy)?;
    let started = Instant::now();
    let (mut exact, mut tokens, mut cached) = (0, 0, Vec::new());
    let (mut prefill_s, mut decode_s, mut decode_tokens) = (0.0, 0.0, 0);
    for (chunk, digits) in prompts.chunks(BATCH).zip(held_out.chunks(BATCH)) {
        let out = generator.generate(&ctx, chunk, None, &greedy)?;
        for (got, d) in out.tokens.iter().zip(digits) {
            exact += (*got == answer(d)) as usize;
            tokens += got.len();
        }
        prefill_s += out.prefill_seconds;
        decode_s += out.decode_seconds;
        decode_tokens += out.decode_tokens;
        cached.extend(out.tokens);
        println!("generated {} of {} prompts", cached.len(), prompts.len());
    }
    let cached_s = started.elapsed().as_secs_f64();
    println!(
        "\ngreedy through the KV cache: exact-sequence accuracy {:.4} ({exact} of {}); {tokens} tokens in {cached_s:.2} s: {:.0} tokens/s (prefill {:.2} s, decoding {decode_tokens} tokens at {:.0} tokens/s)",
        exact as f64 / prompts.len() as f64,
        prompts.len(),
        tokens as f64 / cached_s,
        prefill_s,
        decode_tokens as f64 / decode_s
    );
    for (p, got) in prompts.iter().zip(&cached).take(4) {
        println!("  {}  ->  {}", show(p), show(got));
    }
    let sampled = GenerateOptions::default()
        .max_new_tokens(MAX_LEN + 1)
        .sampling(Sampling::temperature(0.8, args.seed).top_k(3).top_p(0.95))
        .stop(Some(EOS));
    let out = generator.generate(&ctx, &prompts[..BATCH], None, &sampled)?;
    println!("sampled (temperature 0.8, top-k 3, top-p 0.95):");
    for (p, got) in prompts.iter().zip(&out.tokens).take(4) {
        println!("  {}  ->  {}", show(p), show(got));
    }

    let started = Instant::now();
    let rerun = generate_by_rerunning(&ctx, &mut trainer, &prompts)?;
    let rerun_s = started.elapsed().as_secs_f64();
    let rerun_tokens: usize = rerun.iter().map(Vec::len).sum();
    let same = rerun.iter().zip(&cached).filter(|(a, b)| a == b).count();
    println!(
        "\nre-running the model for every token: {rerun_tokens} tokens in {rerun_s:.2} s ({:.0} tokens/s): the cache is {:.1}x faster; the same continuation for {same} of {} prompts",
        rerun_tokens as f64 / rerun_s,
        rerun_s / cached_s,
        prompts.len()
    );
    if let Some((i, (a, b))) = rerun
        .iter()
        .zip(&cached)
        .enumerate()
        .find(|(_, (a, b))| a != b)
    {
        println!(
            "  first difference, prompt {i}: {} (re-run) vs {} (cached)",
            show(a),
            show(b)
        );
    }
    Ok(())
}

fn main() {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("generate: {e}");
            std::process::exit(2);
        }
    };
    if let Some(dir) = &args.model {
        if let Err(e) = run_pretrained(&args, dir) {
            eprintln!("generate: {e}");
            std::process::exit(1);
        }
        return;
    }
    if let Err(e) = run(&args) {
        eprintln!("generate: {e}");
        std::process::exit(1);
    }
}
