//! Serves generation requests arriving over time with continuous batching over a paged KV cache
//! ([`Server`]): requests queue, are admitted into free slots while the others decode, stream their
//! tokens, and free their slot and cache blocks when done. Reports each request's time to first
//! token and the throughput. Every other request samples (temperature and top-k, its own seed), the
//! others are greedy: each request keeps its own settings in one shared sampling pass.
//!
//! ```text
//! cargo run --release --example serve -- [--model DIR] [--requests 12] [--slots 4]
//!     [--arrive-every 2] [--prompt 24] [--max-new-tokens 32] [--page 16] [--int8]
//! ```
//!
//! Without `--model`, a randomly initialised LLaMA-style model (d 256, 4 layers, 8 heads over 2 KV
//! heads) serves random prompts.

use std::time::Instant;

use wgpu_attention::kernels::sampling::Sampling;
use wgpu_attention::Context;
use wgpu_attention_serve::{
    CacheConfig, CacheLayout, Generator, GeneratorShape, KvFormat, Request, Server,
};
use wgpu_attention_transformer::model::pretrained::Pretrained;
use wgpu_attention_transformer::model::transformer::{Activation, Norm};
use wgpu_attention_transformer::model::{BatchShape, Transformer, TransformerConfig};

/// Serves requests arriving over time through continuous batching.
#[derive(clap::Parser)]
struct Args {
    /// A Hugging Face model directory (default: a random LLaMA-style model).
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Requests served.
    #[arg(long, default_value_t = 12)]
    requests: usize,
    /// Sequence slots (requests decoded together).
    #[arg(long, default_value_t = 4)]
    slots: usize,
    /// A new request arrives every this many scheduling rounds.
    #[arg(long, default_value_t = 2)]
    arrive_every: usize,
    /// Prompt tokens per request (each request a little longer than the last).
    #[arg(long, default_value_t = 24)]
    prompt: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Tokens per cache block.
    #[arg(long, default_value_t = 16)]
    page: usize,
    /// Store the cache in int8 (one scale per token and head): 3.76x less memory at head_dim 64.
    #[arg(long)]
    int8: bool,
}

fn run(args: &Args) -> Result<(), wgpu_attention::Error> {
    let ctx = Context::from_env()?;
    let capacity = args.prompt + args.requests + args.max_new_tokens;
    let shape = GeneratorShape {
        batch: args.slots,
        capacity,
        prefill_chunk: 64,
        src_len: 0,
    };
    // The pool holds what the slots can have in flight, not slots x capacity.
    let layout = CacheConfig::new(CacheLayout::Paged {
        page: args.page,
        pool_blocks: args.slots * capacity.div_ceil(args.page),
    })
    .with_format(match args.int8 {
        true => KvFormat::Int8,
        false => KvFormat::F32,
    });
    let generator = match &args.model {
        Some(dir) => Generator::from_pretrained(&ctx, &Pretrained::open(dir)?, shape, layout)?,
        None => {
            let config = TransformerConfig::default()
                .vocab(2000)
                .d_model(256)
                .heads(8)
                .kv_heads(Some(2))
                .d_ff(512)
                .encoder_layers(0)
                .decoder_layers(4)
                .norm(Norm::RmsNorm)
                .activation(Activation::Silu)
                .gated_feed_forward(true)
                .bias(false)
                .output_bias(false)
                .rope_base(Some(10000.0));
            let one = BatchShape {
                batch: 1,
                src_len: 0,
                tgt_len: 1,
            };
            let model = Transformer::new(&ctx, config, one, 1)?;
            Generator::with_layout(&ctx, &model, shape, layout)?
        }
    };
    let vocab = generator.config().vocab as u32;
    println!(
        "{} slots, capacity {capacity}, paged cache of {}-token blocks ({:.1} MB) on {}",
        args.slots,
        args.page,
        generator.paged_cache().map_or(0, |c| c.bytes()) as f64 / 1e6,
        ctx.report().name
    );
    let mut server = Server::new(generator)?;
    let start = Instant::now();
    let (mut submitted, mut first, mut done) = (Vec::new(), Vec::new(), Vec::new());
    let mut tokens = 0usize;
    let mut round = 0;
    while submitted.len() < args.requests || !server.is_idle() {
        if submitted.len() < args.requests && round % args.arrive_every == 0 {
            let n = submitted.len();
            let prompt = (0..args.prompt + n)
                .map(|i| 1 + ((i * 7919 + n * 104729) as u32) % (vocab - 1))
                .collect();
            // Every other request samples (temperature 0.8, top-k 40, its own seed); the rest are
            // greedy: one sampling pass serves both.
            let request = Request::new(prompt, args.max_new_tokens);
            let request = match n % 2 {
                0 => request,
                _ => request.sampling(Sampling::temperature(0.8, n as u64).top_k(40)),
            };
            server.submit(request)?;
            submitted.push(start.elapsed().as_secs_f64());
            first.push(None);
            done.push(None);
        }
        server.step(&ctx, |t| {
            let now = start.elapsed().as_secs_f64();
            let r = t.request as usize;
            first[r].get_or_insert(now);
            if t.finished.is_some() {
                done[r] = Some(now);
            }
            tokens += 1;
        })?;
        round += 1;
    }
    let total = start.elapsed().as_secs_f64();
    println!("\n| request | arrived s | time to first token s | finished s |\n|---|---|---|---|");
    let mut ttft = Vec::new();
    for r in 0..args.requests {
        let (f, d) = (first[r].unwrap_or(f64::NAN), done[r].unwrap_or(f64::NAN));
        ttft.push(f - submitted[r]);
        println!(
            "| {r} | {:.3} | {:.3} | {:.3} |",
            submitted[r],
            f - submitted[r],
            d
        );
    }
    ttft.sort_by(f64::total_cmp);
    println!(
        "\n{} requests, {tokens} tokens in {total:.2} s: {:.1} tokens/s; time to first token median {:.3} s, max {:.3} s; {round} rounds",
        args.requests,
        tokens as f64 / total,
        ttft[ttft.len() / 2],
        ttft[ttft.len() - 1]
    );
    Ok(())
}

fn main() {
    wgpu_attention::quiet_headless_start_up();
    let args = <Args as clap::Parser>::parse();
    if let Err(e) = run(&args) {
        eprintln!("serve: {e}");
        std::process::exit(1);
    }
}
