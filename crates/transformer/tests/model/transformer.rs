//! The whole Transformer on the GPU against the f64 CPU model: logits, loss and every parameter
//! gradient (encoder-decoder pre-LN and post-LN, decoder-only with learned positions), with odd
//! lengths and padding in the batch; the CPU model's gradients against finite differences; causality
//! and padding invariance of the GPU model.

use crate::common;

use std::collections::HashMap;

use common::{assert_close, for_each_backend, to_f64, BACKWARD_ATOL, BACKWARD_RTOL};
use wgpu_attention::{Context, RelativeBuckets};
use wgpu_attention_transformer::model::transformer::{Activation, Norm, RopeScaling};
use wgpu_attention_transformer::model::{Batch, BatchShape, Transformer, TransformerConfig};
use wgpu_attention_transformer::reference::transformer::{self as reference, ParamMap};

const PAD: u32 = 0;

fn config(encoder_layers: usize, pre_ln: bool, learned_positions: bool) -> TransformerConfig {
    TransformerConfig::default()
        .vocab(11)
        .d_model(32)
        .heads(4)
        .d_ff(48)
        .encoder_layers(encoder_layers)
        .decoder_layers(2)
        .pre_ln(pre_ln)
        .learned_positions(learned_positions)
        .pad_id(PAD)
}

/// The self-attention score modifiers on: softcap, ALiBi and a window shorter than the sequences.
fn with_score_modifiers(c: TransformerConfig) -> TransformerConfig {
    c.attention_softcap(Some(1.5))
        .alibi(true)
        .attention_window(Some(2))
        .relative_buckets(None)
        .attention_sinks(false)
        .cosine_scores(None)
        .key_norm_clip(None)
        .rope_base(None)
}

/// The learned score terms on: T5 relative buckets (one-directional in the decoder) and sinks,
/// with cosine scores or key-norm clipping.
fn with_learned_score_terms(c: TransformerConfig, cosine: bool) -> TransformerConfig {
    c.relative_buckets(Some(RelativeBuckets::new(8, 6, true)))
        .attention_sinks(true)
        .cosine_scores(cosine.then_some(4.0))
        .key_norm_clip((!cosine).then_some(0.3))
}

/// Additive (Bahdanau) scores in self-attention, score dim 5 per head, with a window.
fn with_additive(c: TransformerConfig) -> TransformerConfig {
    c.additive_attention(Some(5)).attention_window(Some(3))
}

/// Rotary position embeddings instead of the additive positions.
fn with_rope(c: TransformerConfig) -> TransformerConfig {
    c.rope_base(Some(10000.0)).learned_positions(false)
}

/// GPT-2's blocks: learned positions in a table longer than the batch, tanh-GELU, tied
/// embeddings, no output bias.
fn gpt2_like(c: TransformerConfig) -> TransformerConfig {
    c.learned_positions(true)
        .max_positions(Some(9))
        .tied_embeddings(true)
        .output_bias(false)
}

/// LLaMA's blocks: RMSNorm, SwiGLU, no biases, grouped key/value heads, rotary embeddings with
/// LLaMA 3's frequency scaling (one pair of each head unscaled, one blended, two scaled).
fn llama_like(c: TransformerConfig) -> TransformerConfig {
    c.norm(Norm::RmsNorm)
        .norm_eps(1e-6)
        .activation(Activation::Silu)
        .gated_feed_forward(true)
        .bias(false)
        .output_bias(false)
        .kv_heads(Some(2))
        .rope_base(Some(10000.0))
        .rope_scaling(Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 64,
        }))
        .learned_positions(false)
}

/// GeGLU with biases, RMSNorm and one key/value head (MQA), linear rope scaling.
fn geglu_mqa(c: TransformerConfig) -> TransformerConfig {
    c.norm(Norm::RmsNorm)
        .activation(Activation::Gelu)
        .gated_feed_forward(true)
        .kv_heads(Some(1))
        .rope_base(Some(500.0))
        .rope_scaling(Some(RopeScaling::Linear { factor: 2.0 }))
        .learned_positions(false)
}

const SHAPE: BatchShape = BatchShape {
    batch: 3,
    src_len: 7,
    tgt_len: 5,
};

/// A padded batch: ids in 1..vocab up to each length, `pad_id` after.
fn batch(seed: u32, src_lens: [u32; 3], tgt_lens: [u32; 3]) -> Batch {
    let mut state = seed.wrapping_mul(2654435761).wrapping_add(12345);
    let mut id = move || {
        state = state.wrapping_mul(1664525).wrapping_add(1013904223);
        1 + (state >> 16) % 10
    };
    let mut fill = |len: usize, lens: &[u32; 3]| -> Vec<u32> {
        (0..3)
            .flat_map(|b| (0..len).map(move |i| (b, i)))
            .map(|(b, i)| if (i as u32) < lens[b] { id() } else { PAD })
            .collect()
    };
    let src = fill(SHAPE.src_len, &src_lens);
    let tgt_in = fill(SHAPE.tgt_len, &tgt_lens);
    let tgt_out = fill(SHAPE.tgt_len, &tgt_lens);
    Batch {
        src,
        src_lens: src_lens.to_vec(),
        tgt_in,
        tgt_out,
        tgt_lens: tgt_lens.to_vec(),
    }
}

fn padded_batch(seed: u32) -> Batch {
    batch(seed, [7, 4, 1], [5, 3, 2])
}

/// Runs forward and backward in one submission; returns (logits, [loss, count], grads by name).
fn run(
    ctx: &Context,
    model: &mut Transformer,
    b: &Batch,
) -> (Vec<f32>, Vec<f32>, HashMap<String, Vec<f32>>) {
    model.set_batch(ctx, b).unwrap();
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    model.forward(ctx, &mut encoder).unwrap();
    model.backward(ctx, &mut encoder).unwrap();
    ctx.queue().submit([encoder.finish()]);
    let grads = model
        .params
        .names()
        .iter()
        .zip(model.params.grads())
        .map(|(n, g)| (n.clone(), g.to_vec(ctx).unwrap()))
        .collect();
    (
        model.logits().to_vec(ctx).unwrap(),
        model.loss().to_vec(ctx).unwrap(),
        grads,
    )
}

fn host_params(ctx: &Context, model: &Transformer) -> ParamMap {
    model
        .params
        .names()
        .iter()
        .zip(model.params.values())
        .map(|(n, v)| (n.clone(), to_f64(&v.to_vec(ctx).unwrap())))
        .collect()
}

fn check_against_cpu(backend: &str, ctx: &Context, c: TransformerConfig, what: &str) {
    let mut model = Transformer::new(ctx, c, SHAPE, 7).unwrap();
    let b = padded_batch(3);
    let (logits, loss, grads) = run(ctx, &mut model, &b);
    let p = host_params(ctx, &model);
    let cpu = reference::forward_backward(&c, &SHAPE, &p, &b);
    let tag = format!("[{backend}] {what}");
    // Logits of padded target rows are computed but never used: compare the valid rows.
    let valid = |v: usize| {
        let row = v / c.vocab;
        let (bi, i) = (row / SHAPE.tgt_len, row % SHAPE.tgt_len);
        (i as u32) < b.tgt_lens[bi]
    };
    let gpu_logits: Vec<f32> = (0..logits.len())
        .filter(|&i| valid(i))
        .map(|i| logits[i])
        .collect();
    let cpu_logits: Vec<f64> = (0..logits.len())
        .filter(|&i| valid(i))
        .map(|i| cpu.logits[i])
        .collect();
    assert_close(
        &format!("{tag} logits"),
        &gpu_logits,
        &cpu_logits,
        BACKWARD_ATOL,
        BACKWARD_RTOL,
    );
    assert_close(
        &format!("{tag} loss"),
        &loss[..1],
        &[cpu.loss],
        BACKWARD_ATOL,
        BACKWARD_RTOL,
    );
    assert_eq!(
        loss[1],
        b.tgt_lens.iter().sum::<u32>() as f32,
        "{tag}: counted targets"
    );
    assert_eq!(
        grads.len(),
        cpu.grads.len(),
        "{tag}: every parameter has a CPU gradient"
    );
    let mut worst = (0.0f64, 0.0f64, String::new());
    for (name, g) in &grads {
        let w = assert_close(
            &format!("{tag} d {name}"),
            g,
            &cpu.grads[name],
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
        if w.ratio > worst.0 {
            worst = (w.ratio, w.abs, name.clone());
        }
    }
    eprintln!(
        "{tag}: {} parameter gradients match; worst {:.3}% of tolerance, |err| {:.2e} ({})",
        grads.len(),
        100.0 * worst.0,
        worst.1,
        worst.2
    );
}

#[test]
fn encoder_decoder_pre_ln_matches_cpu_model() {
    for_each_backend(|backend, ctx| {
        check_against_cpu(backend, ctx, config(2, true, false), "enc-dec pre-LN")
    });
}

#[test]
fn encoder_decoder_post_ln_matches_cpu_model() {
    for_each_backend(|backend, ctx| {
        check_against_cpu(backend, ctx, config(2, false, false), "enc-dec post-LN")
    });
}

#[test]
fn decoder_only_with_learned_positions_matches_cpu_model() {
    for_each_backend(|backend, ctx| {
        check_against_cpu(backend, ctx, config(0, true, true), "decoder-only")
    });
}

/// The blocks published checkpoints are made of: GPT-2's and LLaMA's, and GeGLU with MQA in an
/// encoder-decoder (cross-attention keeps its full heads).
#[test]
fn checkpoint_architectures_match_cpu_model() {
    for_each_backend(|backend, ctx| {
        check_against_cpu(backend, ctx, gpt2_like(config(0, true, false)), "gpt2-like");
        check_against_cpu(
            backend,
            ctx,
            llama_like(config(0, true, false)),
            "llama-like",
        );
        let c = geglu_mqa(config(2, true, false));
        check_against_cpu(backend, ctx, c, "enc-dec geglu+mqa+rms");
    });
}

#[test]
fn score_modifiers_in_the_model_match_cpu_model() {
    for_each_backend(|backend, ctx| {
        let c = with_score_modifiers(config(2, true, false));
        check_against_cpu(backend, ctx, c, "enc-dec softcap+alibi+window");
        let c = with_score_modifiers(config(0, true, true));
        check_against_cpu(backend, ctx, c, "decoder-only softcap+alibi+window");
        let c = with_learned_score_terms(config(2, true, false), false);
        check_against_cpu(backend, ctx, c, "enc-dec relative+sinks+clip");
        let c = with_learned_score_terms(config(0, false, false), true);
        check_against_cpu(backend, ctx, c, "decoder-only relative+sinks+cosine");
        check_against_cpu(
            backend,
            ctx,
            with_rope(config(2, true, false)),
            "enc-dec rope",
        );
        let c = with_rope(with_learned_score_terms(config(0, true, false), true));
        check_against_cpu(backend, ctx, c, "decoder-only rope+relative+sinks+cosine");
        let c = with_additive(config(2, true, false));
        check_against_cpu(backend, ctx, c, "enc-dec additive+window");
        let c = with_additive(config(0, false, true));
        check_against_cpu(backend, ctx, c, "decoder-only post-LN additive+window");
    });
}

/// Additive scores take only the window among the score terms: the others are refused by name.
#[test]
fn additive_scores_refuse_dot_product_terms() {
    for_each_backend(|_, ctx| {
        for (c, needle) in [
            (
                with_additive(with_rope(config(0, true, false))),
                "rope_base",
            ),
            (
                with_additive(with_score_modifiers(config(0, true, false))),
                "attention_softcap",
            ),
            (
                config(0, true, false).additive_attention(Some(0)),
                "additive_attention",
            ),
        ] {
            let err = Transformer::new(ctx, c, SHAPE, 1).err().expect("refused");
            assert!(err.to_string().contains(needle), "{err}");
        }
    });
}

/// Central differences of the CPU model's loss for a few elements of every parameter.
#[test]
fn cpu_model_gradients_match_finite_differences() {
    for c in [
        config(1, true, true),
        config(1, false, false),
        with_score_modifiers(config(1, true, false)),
        with_learned_score_terms(config(1, true, false), false),
        with_learned_score_terms(config(1, false, false), true),
        with_rope(config(1, true, false)),
        with_additive(config(1, true, false)),
        gpt2_like(config(0, true, false)),
        llama_like(config(0, true, false)),
        geglu_mqa(config(1, false, false)),
    ] {
        let ctx_free_params = {
            // Parameters drawn like the GPU model's, without a GPU: the names and shapes come from a
            // CPU-only run of the reference with zero-filled maps is not possible, so build them on a
            // backend once.
            let out = std::sync::OnceLock::new();
            for_each_backend(|_, ctx| {
                out.get_or_init(|| {
                    let model = Transformer::new(ctx, c, SHAPE, 11).unwrap();
                    host_params(ctx, &model)
                });
            });
            out.into_inner().unwrap()
        };
        let b = padded_batch(5);
        let base = reference::forward_backward(&c, &SHAPE, &ctx_free_params, &b);
        let mut worst = 0.0f64;
        let mut names: Vec<_> = ctx_free_params.keys().cloned().collect();
        names.sort();
        for name in names {
            let n = ctx_free_params[&name].len();
            for &i in &[0, n / 3, n - 1] {
                let h = 1e-5;
                let loss_at = |delta: f64| {
                    let mut p = ctx_free_params.clone();
                    p.get_mut(&name).unwrap()[i] += delta;
                    reference::forward(&c, &SHAPE, &p, &b).1
                };
                let fd = (loss_at(h) - loss_at(-h)) / (2.0 * h);
                let analytic = base.grads[&name][i];
                let err = (fd - analytic).abs();
                assert!(
                    err <= 1e-6 + 1e-5 * analytic.abs(),
                    "{name}[{i}]: analytic {analytic}, finite difference {fd}"
                );
                worst = worst.max(err);
            }
        }
        eprintln!(
            "CPU model (pre_ln {}) vs finite differences: worst |err| {worst:.2e}",
            c.pre_ln
        );
    }
}

/// Changing target tokens at positions >= t leaves the logits of positions < t unchanged.
#[test]
fn decoder_is_causal() {
    for_each_backend(|backend, ctx| {
        for c in [config(2, true, false), config(0, true, true)] {
            let mut model = Transformer::new(ctx, c, SHAPE, 7).unwrap();
            let full = batch(9, [7, 7, 7], [5, 5, 5]);
            let (before, _, _) = run(ctx, &mut model, &full);
            let t = 2;
            let mut changed = full.clone();
            for bi in 0..SHAPE.batch {
                for i in t..SHAPE.tgt_len {
                    let k = bi * SHAPE.tgt_len + i;
                    changed.tgt_in[k] = 1 + (changed.tgt_in[k] + 4) % 10;
                }
            }
            let (after, _, _) = run(ctx, &mut model, &changed);
            let mut changed_later = false;
            for row in 0..SHAPE.batch * SHAPE.tgt_len {
                let r = &before[row * c.vocab..(row + 1) * c.vocab];
                let a = &after[row * c.vocab..(row + 1) * c.vocab];
                if row % SHAPE.tgt_len < t {
                    assert_eq!(r, a, "[{backend}] row {row} saw a later target token");
                } else {
                    changed_later |= r != a;
                }
            }
            assert!(
                changed_later,
                "[{backend}] the changed tokens changed nothing at all"
            );
        }
    });
}

/// Changing padded source and target tokens changes no valid logit, the loss, or any gradient.
#[test]
fn padding_changes_nothing() {
    for_each_backend(|backend, ctx| {
        for c in [config(2, true, false), config(2, false, true)] {
            let mut model = Transformer::new(ctx, c, SHAPE, 7).unwrap();
            let b = padded_batch(13);
            let (logits, loss, grads) = run(ctx, &mut model, &b);
            let mut other = b.clone();
            for (bi, &len) in b.src_lens.iter().enumerate() {
                for i in len as usize..SHAPE.src_len {
                    other.src[bi * SHAPE.src_len + i] = 1 + (bi + i) as u32 % 10;
                }
            }
            for (bi, &len) in b.tgt_lens.iter().enumerate() {
                for i in len as usize..SHAPE.tgt_len {
                    other.tgt_in[bi * SHAPE.tgt_len + i] = 1 + (bi * 3 + i) as u32 % 10;
                }
            }
            assert_ne!(other.src, b.src);
            let (logits2, loss2, grads2) = run(ctx, &mut model, &other);
            assert_eq!(loss, loss2, "[{backend}] loss changed with padded tokens");
            for row in 0..SHAPE.batch * SHAPE.tgt_len {
                let (bi, i) = (row / SHAPE.tgt_len, row % SHAPE.tgt_len);
                if (i as u32) < b.tgt_lens[bi] {
                    let span = row * c.vocab..(row + 1) * c.vocab;
                    assert_eq!(
                        logits[span.clone()],
                        logits2[span],
                        "[{backend}] valid row {row} changed"
                    );
                }
            }
            for (name, g) in &grads {
                assert_eq!(g, &grads2[name], "[{backend}] gradient of {name} changed");
            }
        }
    });
}

/// Rotary embeddings replace the additive positions: asking for both is refused, naming both.
#[test]
fn rope_and_learned_positions_are_exclusive() {
    for_each_backend(|_, ctx| {
        let c = config(0, true, true).rope_base(Some(10000.0));
        let err = Transformer::new(ctx, c, SHAPE, 1).err().expect("refused");
        assert!(
            err.to_string().contains("learned_positions/rope_base"),
            "{err}"
        );
        let c = config(0, true, false).rope_base(Some(0.5));
        let err = Transformer::new(ctx, c, SHAPE, 1).err().expect("refused");
        assert!(err.to_string().contains("rope_base"), "{err}");
    });
}

/// A packed decoder-only model (`Transformer::packed`: sequences one after another, no padding
/// between them) computes what the padded model with the same parameters computes: the logits of
/// every real row, the loss and every parameter gradient, with learned positions and with rotary
/// embeddings and grouped heads.
#[test]
fn packed_batches_match_padded_batches() {
    use wgpu_attention_transformer::model::PackedShape;
    for_each_backend(|backend, ctx| {
        for (what, c) in [
            // A table longer than both models' rows, so that both draw the same parameters.
            (
                "learned positions",
                config(0, true, true).max_positions(Some(16)),
            ),
            ("rope, GQA", llama_like(config(0, true, false))),
        ] {
            let tgt_lens = [5u32, 2, 4];
            let padded_batch = batch(5, [1, 1, 1], tgt_lens);
            let mut padded = Transformer::new(ctx, c, SHAPE, 7).unwrap();
            // The same sequences packed, in 13 rows (2 left over) for up to 4 sequences.
            let rows = 13;
            let mut packed =
                Transformer::packed(ctx, c, PackedShape { sequences: 4, rows }, 7).unwrap();
            let pack = |ids: &[u32]| {
                let mut out: Vec<u32> = (0..3)
                    .flat_map(|b| ids[b * SHAPE.tgt_len..][..tgt_lens[b] as usize].to_vec())
                    .collect();
                out.resize(rows, PAD);
                out
            };
            let packed_batch = Batch {
                tgt_in: pack(&padded_batch.tgt_in),
                tgt_out: pack(&padded_batch.tgt_out),
                tgt_lens: tgt_lens.to_vec(),
                ..Batch::default()
            };
            let (logits, loss, grads) = run(ctx, &mut padded, &padded_batch);
            let (p_logits, p_loss, p_grads) = run(ctx, &mut packed, &packed_batch);
            let tag = format!("[{backend}] packed, {what}");
            assert_close(&format!("{tag} loss"), &p_loss, &to_f64(&loss), 1e-6, 1e-5);
            let vocab = c.vocab;
            let mut row = 0;
            for (b, &len) in tgt_lens.iter().enumerate() {
                let len = len as usize;
                assert_close(
                    &format!("{tag} logits of sequence {b}"),
                    &p_logits[row * vocab..][..len * vocab],
                    &to_f64(&logits[b * SHAPE.tgt_len * vocab..][..len * vocab]),
                    1e-6,
                    1e-5,
                );
                row += len;
            }
            assert_eq!(grads.len(), p_grads.len());
            for (name, g) in &grads {
                assert_close(
                    &format!("{tag} grad {name}"),
                    &p_grads[name],
                    &to_f64(g),
                    BACKWARD_ATOL,
                    BACKWARD_RTOL,
                );
            }
        }
        // Too many sequences or rows, and real targets after the sequences, are refused.
        let c = config(0, true, true);
        let mut packed = Transformer::packed(
            ctx,
            c,
            PackedShape {
                sequences: 2,
                rows: 6,
            },
            7,
        )
        .unwrap();
        let b = |lens: &[u32], out_tail: u32| Batch {
            tgt_in: vec![1; 6],
            tgt_out: [vec![1; 5], vec![out_tail]].concat(),
            tgt_lens: lens.to_vec(),
            ..Batch::default()
        };
        for (lens, tail, expect) in [
            (&[1u32, 1, 1][..], PAD, "up to 2 sequences"),
            (&[4, 3][..], PAD, "up to 2 sequences in 6 rows"),
            (&[3, 2][..], 1, "after the packed sequences"),
        ] {
            let m = packed
                .set_batch(ctx, &b(lens, tail))
                .unwrap_err()
                .to_string();
            assert!(m.contains(expect), "{m}");
        }
        packed.set_batch(ctx, &b(&[3, 2], PAD)).unwrap();
        assert!(Transformer::packed(
            ctx,
            config(1, true, true),
            PackedShape {
                sequences: 2,
                rows: 6
            },
            7
        )
        .is_err());
    });
}
