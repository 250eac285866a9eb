//! Fine-tunes a published model (a Hugging Face directory: `config.json`, safetensors weights,
//! `tokenizer.json`) on a text with the engine's trainer, and saves it back in the Hugging Face
//! layout, which `transformers` loads again:
//!
//! ```text
//! cargo run --release --example finetune_pretrained -- --model DIR --out DIR \
//!     [--text FILE] [--steps N] [--seq L] [--batch B] [--lr LR]
//! ```
//!
//! Next-token prediction on windows of `--seq` tokens of the text (a built-in paragraph without
//! `--text`). Beside the weights it writes `engine_logits.safetensors` (the fine-tuned model's
//! logits for the first window), which `scripts/hf_fixtures.py --check OUT NAME` compares with what
//! `transformers` computes from the saved directory.

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::tensor::{Dtype, TensorView};
use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::Context;
use wgpu_attention_transformer::model::pretrained::Pretrained;
use wgpu_attention_transformer::model::{Batch, BatchShape};
use wgpu_attention_transformer::training::Trainer;

const TEXT: &str = "the quick brown fox jumps over the lazy dog. attention is all you need, said \
the transformer to the recurrent network. a small model runs on any gpu through wgpu and webgpu. \
flash attention tiles the scores so they never leave the chip. keys and values are cached so each \
new token costs one row of attention.";

/// Fine-tunes a Hugging Face model and saves it back.
#[derive(clap::Parser)]
struct Args {
    /// The model directory.
    #[arg(long)]
    model: PathBuf,
    /// Where to save the fine-tuned model.
    #[arg(long)]
    out: PathBuf,
    /// A text file to train on (default: a built-in paragraph).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 24)]
    seq: usize,
    /// Windows per batch.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f32,
}

fn run(args: &Args) -> Result<(), String> {
    let err = |e: wgpu_attention::Error| e.to_string();
    let ctx = Context::from_env().map_err(err)?;
    let checkpoint = Pretrained::open(&args.model).map_err(err)?;
    let tokenizer = tokenizers::Tokenizer::from_file(args.model.join("tokenizer.json"))
        .map_err(|e| format!("tokenizer.json: {e}"))?;
    let text = match &args.text {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => TEXT.to_string(),
    };
    let ids = tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| e.to_string())?
        .get_ids()
        .to_vec();
    let (seq, b) = (args.seq, args.batch);
    if ids.len() < seq + 1 {
        return Err(format!(
            "the text has {} tokens; --seq {seq} needs {}",
            ids.len(),
            seq + 1
        ));
    }
    let windows: Vec<usize> = (0..=ids.len() - seq - 1).step_by(seq.div_ceil(2)).collect();
    let shape = BatchShape {
        batch: b,
        src_len: 0,
        tgt_len: seq,
    };
    let model = checkpoint.model(&ctx, shape).map_err(err)?;
    let config = AdamWConfig::default().lr(args.lr);
    let mut trainer = Trainer::new(&ctx, model, config).map_err(err)?;
    let batch_at = |step: usize| {
        let starts: Vec<usize> = (0..b)
            .map(|i| windows[(step * b + i) % windows.len()])
            .collect();
        Batch {
            tgt_in: starts
                .iter()
                .flat_map(|&s| ids[s..s + seq].to_vec())
                .collect(),
            tgt_out: starts
                .iter()
                .flat_map(|&s| ids[s + 1..s + seq + 1].to_vec())
                .collect(),
            tgt_lens: vec![seq as u32; b],
            ..Default::default()
        }
    };
    println!(
        "{:?} from {}: {} tokens, {} windows of {seq}",
        checkpoint.architecture(),
        args.model.display(),
        ids.len(),
        windows.len()
    );
    for step in 0..args.steps {
        trainer.step(&ctx, &batch_at(step)).map_err(err)?;
        if step % 5 == 0 || step + 1 == args.steps {
            let loss = trainer.model.loss().to_vec(&ctx).map_err(err)?[0];
            println!("step {step:4}  loss {loss:.4}");
        }
    }
    trainer.check_finite(&ctx).map_err(err)?;
    checkpoint
        .save(&ctx, &trainer.model, &args.out)
        .map_err(err)?;
    // The fine-tuned logits of the first window (row 0 of a batch of copies of it).
    let first = Batch {
        tgt_in: ids[..seq].repeat(b),
        tgt_out: ids[1..seq + 1].repeat(b),
        tgt_lens: vec![seq as u32; b],
        ..Default::default()
    };
    trainer.forward(&ctx, &first).map_err(err)?;
    let vocab = checkpoint.config().vocab;
    let logits = trainer.model.logits().to_vec(&ctx).map_err(err)?[..seq * vocab].to_vec();
    let input: Vec<i32> = ids[..seq].iter().map(|&i| i as i32).collect();
    let (input_bytes, logit_bytes) = (bytemuck::cast_slice(&input), bytemuck::cast_slice(&logits));
    let tensors = [
        (
            "input_ids",
            TensorView::new(Dtype::I32, vec![1, seq], input_bytes),
        ),
        (
            "logits",
            TensorView::new(Dtype::F32, vec![1, seq, vocab], logit_bytes),
        ),
    ]
    .into_iter()
    .map(|(n, v)| v.map(|v| (n, v)))
    .collect::<Result<Vec<_>, _>>()
    .map_err(|e| e.to_string())?;
    let path = args.out.join("engine_logits.safetensors");
    safetensors::serialize_to_file(tensors, None::<HashMap<String, String>>, &path)
        .map_err(|e| e.to_string())?;
    println!("saved {} (and {})", args.out.display(), path.display());
    Ok(())
}

fn main() {
    wgpu_attention::quiet_headless_start_up();
    let args = <Args as clap::Parser>::parse();
    if let Err(e) = run(&args) {
        eprintln!("finetune_pretrained: {e}");
        std::process::exit(1);
    }
}
