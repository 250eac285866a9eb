//! Dot-product against additive (Bahdanau) attention on a matching rule (seed 004): six distinct
//! digits, a separator and a query digit q; the answer is the position of the digit `(3 q + 7) mod 10`
//! among the six. The query must attend to the key its rule pairs it with: a permutation table of rank
//! 10, which one dot-product head of dimension 4 (a bilinear form of rank 4 at most) cannot hold,
//! while an additive score `w . tanh(a_q + b_k)` of the same dimension is not bound by rank. Two
//! decoder-only models, identical but for the score function, are trained alike and evaluated on
//! held-out sequences.
//!
//! ```text
//! cargo run --release --example additive_task -- [--steps N] [--seed S]
//! ```

use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::model::{Batch, BatchShape, Transformer, TransformerConfig};
use wgpu_attention::training::Trainer;
use wgpu_attention::{Context, Error};

const PAD: u32 = 0;
const SEP: u32 = 1;
const DIGIT0: u32 = 2;
/// Answer tokens: position p of the matching key is `POS0 + p`.
const POS0: u32 = 12;
const KEYS: usize = 6;
/// Keys, separator, query.
const SEQ: usize = KEYS + 2;
const BATCH: usize = 64;
const HELD_OUT: usize = 1024;

fn rule(q: u32) -> u32 {
    (3 * q + 7) % 10
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    /// Six distinct digits, one of them the rule's partner of the query: (keys, query, answer).
    fn example(&mut self) -> (Vec<u32>, u32, u32) {
        let q = self.below(10) as u32;
        let mut keys = vec![rule(q)];
        while keys.len() < KEYS {
            let k = self.below(10) as u32;
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        for i in (1..KEYS).rev() {
            keys.swap(i, self.below(i as u64 + 1) as usize);
        }
        let answer = keys.iter().position(|&k| k == rule(q)).unwrap() as u32;
        (keys, q, answer)
    }
}

fn make_batch(examples: &[(Vec<u32>, u32, u32)]) -> Batch {
    let mut b = Batch::default();
    for (keys, q, answer) in examples {
        b.tgt_in.extend(keys.iter().map(|&k| DIGIT0 + k));
        b.tgt_in.extend([SEP, DIGIT0 + q]);
        b.tgt_out.extend([PAD; SEQ - 1]);
        b.tgt_out.push(POS0 + answer);
        b.tgt_lens.push(SEQ as u32);
    }
    b
}

fn config(additive: bool) -> TransformerConfig {
    TransformerConfig {
        vocab: (POS0 as usize) + KEYS,
        d_model: 16,
        heads: 4,
        d_ff: 32,
        encoder_layers: 0,
        decoder_layers: 2,
        pre_ln: true,
        learned_positions: false,
        pad_id: PAD,
        attention_softcap: None,
        alibi: false,
        attention_window: None,
        relative_buckets: None,
        attention_sinks: false,
        cosine_scores: None,
        key_norm_clip: None,
        rope_base: None,
        additive_attention: additive.then_some(4),
    }
}

/// Trains one model; returns its held-out accuracy and final training loss.
fn train_and_evaluate(
    ctx: &Context,
    additive: bool,
    steps: usize,
    seed: u64,
    held_out: &[(Vec<u32>, u32, u32)],
) -> Result<(f64, f32), Error> {
    let shape = BatchShape {
        batch: BATCH,
        src_len: 0,
        tgt_len: SEQ,
    };
    let model = Transformer::new(ctx, config(additive), shape, seed)?;
    let mut trainer = Trainer::new(ctx, model, AdamWConfig::default())?;
    let mut rng = Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
    for step in 0..steps {
        let examples: Vec<_> = (0..BATCH)
            .map(|_| loop {
                let e = rng.example();
                if !held_out.contains(&e) {
                    break e;
                }
            })
            .collect();
        let warm = ((step + 1) as f32 / 50.0).min(1.0);
        trainer.optimizer.set_lr(3e-3 * warm)?;
        trainer.step(ctx, &make_batch(&examples))?;
        if (step + 1) % 100 == 0 {
            trainer.check_finite(ctx)?;
            let loss = trainer.model.loss().to_vec(ctx)?[0];
            println!(
                "  {} step {:>4}  loss {loss:.4}",
                if additive { "additive" } else { "dot-product" },
                step + 1
            );
        }
    }
    let loss = trainer.model.loss().to_vec(ctx)?[0];
    let vocab = trainer.model.config().vocab;
    let mut correct = 0;
    for chunk in held_out.chunks(BATCH) {
        let mut group = chunk.to_vec();
        group.resize(BATCH, chunk[0].clone());
        trainer.forward(ctx, &make_batch(&group))?;
        let logits = trainer.model.logits().to_vec(ctx)?;
        for (b, (_, _, answer)) in chunk.iter().enumerate() {
            let row = &logits[(b * SEQ + SEQ - 1) * vocab..][..vocab];
            let best = (0..vocab)
                .max_by(|&x, &y| row[x].total_cmp(&row[y]))
                .unwrap_or(0) as u32;
            correct += (best == POS0 + answer) as usize;
        }
    }
    Ok((correct as f64 / held_out.len() as f64, loss))
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (mut steps, mut seed) = (600usize, 1u64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let value = args.next().ok_or(format!("{a} needs a value"))?;
        match a.as_str() {
            "--steps" => steps = value.parse()?,
            "--seed" => seed = value.parse()?,
            _ => return Err(format!("unknown argument {a}; see the example's header").into()),
        }
    }
    let ctx = Context::new()?;
    println!("adapter: {}", ctx.report());
    let mut rng = Rng(0xC0FFEE);
    let held_out: Vec<_> = (0..HELD_OUT).map(|_| rng.example()).collect();
    println!(
        "task: 6 distinct digits, SEP, q -> the position of (3q + 7) mod 10; decoder-only, d_model 16, \
         4 heads, 2 layers; {steps} steps of {BATCH}; {HELD_OUT} held-out sequences (chance 1/6)"
    );
    let mut results = Vec::new();
    for additive in [false, true] {
        let (accuracy, loss) = train_and_evaluate(&ctx, additive, steps, seed, &held_out)?;
        results.push((additive, accuracy, loss));
    }
    println!();
    for (additive, accuracy, loss) in results {
        println!(
            "{:<34} held-out accuracy {accuracy:.4}  final training loss {loss:.4}",
            if additive {
                "additive scores (Da 4 per head):"
            } else {
                "dot-product scores (head dim 4):"
            }
        );
    }
    Ok(())
}

fn main() {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    if let Err(e) = run() {
        eprintln!("additive_task: {e}");
        std::process::exit(1);
    }
}
