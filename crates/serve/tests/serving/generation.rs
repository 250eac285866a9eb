//! Incremental generation from a key/value cache against the model's full forward, on every back
//! end: after a ragged chunked prefill and after every decoding step, each sequence's logits equal
//! the full forward's at its last position (decoder-only with RoPE, a window, ALiBi, softcap and
//! sinks; with relative buckets, post-LN; encoder-decoder with learned positions and padded
//! sources). Greedy generation reproduces re-running the forward. Bad input is a typed error that
//! leaves the cache unchanged.

use crate::common;

use common::{assert_close, for_each_backend, rng, FORWARD_ATOL, FORWARD_RTOL};
use rand::Rng;
use wgpu_attention::kernels::sampling::Sampling;
use wgpu_attention::{Context, Error, RelativeBuckets};
use wgpu_attention_serve::{
    CacheConfig, CacheLayout, Draft, Finish, GenerateOptions, Generator, GeneratorShape, KvFormat,
    Request, Server, Token,
};
use wgpu_attention_transformer::model::transformer::{Activation, Norm, RopeScaling};
use wgpu_attention_transformer::model::{Batch, BatchShape, Transformer, TransformerConfig};

const PAD: u32 = 0;
const VOCAB: usize = 13;
const SHAPE: BatchShape = BatchShape {
    batch: 3,
    src_len: 7,
    tgt_len: 9,
};

fn config(encoder_layers: usize) -> TransformerConfig {
    TransformerConfig::default()
        .vocab(VOCAB)
        .d_model(16)
        .heads(2)
        .d_ff(24)
        .encoder_layers(encoder_layers)
        .decoder_layers(2)
        .pre_ln(true)
        .pad_id(PAD)
}

fn configs() -> Vec<(&'static str, TransformerConfig)> {
    vec![
        (
            "decoder-only rope window alibi softcap sinks",
            config(0)
                .rope_base(Some(10000.0))
                .attention_window(Some(3))
                .alibi(true)
                .attention_softcap(Some(2.0))
                .attention_sinks(true),
        ),
        (
            "decoder-only post-LN relative",
            config(0)
                .pre_ln(false)
                .relative_buckets(Some(RelativeBuckets::new(8, 6, true))),
        ),
        (
            "encoder-decoder learned positions",
            config(1).learned_positions(true),
        ),
        (
            "decoder-only cosine scores",
            config(0).cosine_scores(Some(4.0)),
        ),
        (
            "encoder-decoder key-norm clipping",
            config(1).key_norm_clip(Some(1.5)),
        ),
        (
            "decoder-only LLaMA blocks: GQA, RMSNorm, SwiGLU, no biases, llama3 rope",
            config(0)
                .heads(4)
                .kv_heads(Some(2))
                .norm(Norm::RmsNorm)
                .activation(Activation::Silu)
                .gated_feed_forward(true)
                .bias(false)
                .output_bias(false)
                .rope_base(Some(10000.0))
                .rope_scaling(Some(RopeScaling::Llama3 {
                    factor: 4.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_positions: 16,
                })),
        ),
        (
            "decoder-only GPT-2 blocks: tied, a longer learned position table",
            config(0)
                .learned_positions(true)
                .max_positions(Some(24))
                .tied_embeddings(true)
                .output_bias(false),
        ),
        (
            "encoder-decoder additive window",
            config(1)
                .additive_attention(Some(6))
                .attention_window(Some(4)),
        ),
    ]
}

/// Random target sequences with lengths `lens` (padded), and sources (lengths `src_lens`).
fn sequences(seed: u64, lens: &[usize], len: usize) -> Vec<Vec<u32>> {
    let mut r = rng(seed);
    lens.iter()
        .map(|&n| {
            (0..n)
                .map(|_| r.random_range(1..VOCAB as u32))
                .collect::<Vec<_>>()
        })
        .map(|mut s| {
            s.truncate(len);
            s
        })
        .collect()
}

/// The full forward's logits `[B, tgt_len, vocab]` for `targets` (and `sources`).
fn full_logits(
    ctx: &Context,
    model: &mut Transformer,
    targets: &[Vec<u32>],
    sources: &[Vec<u32>],
) -> Vec<f32> {
    let s = *model.shape();
    let pad = |seqs: &[Vec<u32>], len: usize| -> Vec<u32> {
        seqs.iter()
            .flat_map(|q| (0..len).map(move |i| q.get(i).copied().unwrap_or(PAD)))
            .collect()
    };
    let lens = |seqs: &[Vec<u32>]| seqs.iter().map(|q| q.len() as u32).collect::<Vec<_>>();
    let has_encoder = model.config().has_encoder();
    let batch = Batch {
        src: if has_encoder {
            pad(sources, s.src_len)
        } else {
            Vec::new()
        },
        src_lens: if has_encoder {
            lens(sources)
        } else {
            Vec::new()
        },
        tgt_in: pad(targets, s.tgt_len),
        tgt_out: vec![PAD; s.batch * s.tgt_len],
        tgt_lens: lens(targets),
    };
    model.set_batch(ctx, &batch).unwrap();
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    model.forward(ctx, &mut encoder).unwrap();
    ctx.queue().submit([encoder.finish()]);
    model.logits().to_vec(ctx).unwrap()
}

/// The cache layouts a configuration decodes with: contiguous, and paged in blocks of 2 tokens
/// unless its scores are additive (cosine scores and key clipping transform the gathered pool).
fn layouts(c: &TransformerConfig) -> Vec<CacheLayout> {
    let mut layouts = vec![CacheLayout::Contiguous];
    if c.additive_attention.is_none() {
        layouts.push(CacheLayout::Paged {
            page: 2,
            pool_blocks: 3 * SHAPE.tgt_len.div_ceil(2),
        });
    }
    layouts
}

#[test]
fn cached_decoding_matches_the_full_forward_at_every_step() {
    let target_lens = [9, 6, 8];
    let prompt_lens = [5, 2, 3];
    for_each_backend(|name, ctx| {
        for (n, (label, c)) in configs().into_iter().enumerate() {
            for layout in layouts(&c) {
                let label = format!("{label} {layout:?}");
                let mut model = Transformer::new(ctx, c, SHAPE, 20 + n as u64).unwrap();
                let targets = sequences(30 + n as u64, &target_lens, SHAPE.tgt_len);
                let sources = sequences(40 + n as u64, &[7, 4, 6], SHAPE.src_len);
                let full = full_logits(ctx, &mut model, &targets, &sources);
                let shape = GeneratorShape {
                    batch: 3,
                    capacity: SHAPE.tgt_len,
                    prefill_chunk: 4,
                    src_len: SHAPE.src_len,
                };
                let mut generator = Generator::with_layout(ctx, &model, shape, layout).unwrap();
                let prompts: Vec<Vec<u32>> = targets
                    .iter()
                    .zip(prompt_lens)
                    .map(|(t, p)| t[..p].to_vec())
                    .collect();
                let srcs = c.has_encoder().then_some(sources.as_slice());
                generator.prefill(ctx, &prompts, srcs).unwrap();
                let mut lens: Vec<usize> = prompt_lens.to_vec();
                let mut previous = vec![0.0f32; 3 * VOCAB];
                let mut fed = [true; 3];
                let mut step = 0;
                loop {
                    assert_eq!(
                        generator.lens(),
                        lens.iter().map(|&l| l as u32).collect::<Vec<_>>()
                    );
                    let got = generator.logits().to_vec(ctx).unwrap();
                    for b in 0..3 {
                        let row = &got[b * VOCAB..][..VOCAB];
                        let at = lens[b] - 1;
                        let expected: Vec<f64> = full[(b * SHAPE.tgt_len + at) * VOCAB..][..VOCAB]
                            .iter()
                            .map(|&x| x as f64)
                            .collect();
                        assert_close(
                            &format!("[{name}] {label} step {step} sequence {b} (position {at})"),
                            row,
                            &expected,
                            FORWARD_ATOL,
                            FORWARD_RTOL,
                        );
                        if !fed[b] {
                            // A finished sequence took no token and kept its logits.
                            assert_eq!(row, &previous[b * VOCAB..][..VOCAB]);
                        }
                    }
                    previous = got;
                    if (0..3).all(|b| lens[b] >= target_lens[b]) {
                        break;
                    }
                    let feed: Vec<Option<u32>> = (0..3)
                        .map(|b| (lens[b] < target_lens[b]).then(|| targets[b][lens[b]]))
                        .collect();
                    generator.step(ctx, &feed).unwrap();
                    for b in 0..3 {
                        fed[b] = feed[b].is_some();
                        lens[b] += fed[b] as usize;
                    }
                    step += 1;
                }
            }
        }
    });
}

/// Prompts are prefilled packed, one after another in the pass's rows: a prompt spanning passes,
/// sequences with no tokens in a pass, the short pass for a remainder that fits it, requests
/// admitted together, and a prompt of 64 rows or more (the fused forward over the cache, read as
/// stored: through the block table, int8 and f16 words dequantised as staged). Each sequence's logits after the prefill and a step later equal the full
/// forward's at its position (f32 caches at the forward tolerances; int8 within 3% of the largest
/// logit), with learned positions (placed after each sequence's cached tokens) and GQA.
#[test]
fn packed_prefill_passes_match_the_full_forward() {
    const LEN: usize = 72;
    let shape = BatchShape {
        batch: 3,
        src_len: 0,
        tgt_len: LEN,
    };
    let paged = CacheLayout::Paged {
        page: 4,
        pool_blocks: 3 * LEN / 4,
    };
    let caches = [
        CacheConfig::from(CacheLayout::Contiguous),
        CacheConfig::from(paged),
        CacheConfig::default().with_format(KvFormat::Int8),
        CacheConfig::from(paged).with_format(KvFormat::Int8),
        CacheConfig::from(paged).with_format(KvFormat::F16),
    ];
    // (prefill chunk, prompt lengths, admitted one at a time into an empty generator); chunk 2
    // packs 6 rows: [6, 0, 0], [3, 1, 2], then the short pass [0, 0, 2].
    let cases = [
        (2, [9, 1, 4], false),
        (2, [3, 2, 1], true),
        (32, [70, 3, 5], false),
    ];
    // One model: learned positions (placed after each sequence's cached tokens) and GQA; packed
    // RoPE after a cache is tests/engine/packed.rs's. Each pipeline compiled costs test time.
    let c = config(0).heads(4).kv_heads(Some(2)).learned_positions(true);
    for_each_backend(|name, ctx| {
        let label = "decoder-only, learned positions, GQA";
        let mut model = Transformer::new(ctx, c, shape, 60).unwrap();
        let targets = sequences(70, &[LEN; 3], LEN);
        let full = full_logits(ctx, &mut model, &targets, &[]);
        let largest = full.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
        for (chunk, prompt_lens, admit) in cases {
            for cache in caches {
                let what = format!("[{name}] {label}, {cache:?}, chunk {chunk} {prompt_lens:?}");
                let generator_shape = GeneratorShape {
                    batch: 3,
                    capacity: LEN,
                    prefill_chunk: chunk,
                    src_len: 0,
                };
                let mut g = Generator::with_layout(ctx, &model, generator_shape, cache).unwrap();
                let prompts: Vec<&[u32]> = (0..3).map(|b| &targets[b][..prompt_lens[b]]).collect();
                if admit {
                    for b in 0..3 {
                        g.release(b).unwrap();
                    }
                    // Refused whole: a slot twice.
                    assert!(g
                        .admit_all(ctx, &[(0, prompts[0]), (0, prompts[1])])
                        .is_err());
                    assert_eq!(g.lens(), &[0, 0, 0]);
                    g.admit_all(ctx, &[(2, prompts[2]), (0, prompts[0])])
                        .unwrap();
                    g.admit(ctx, 1, prompts[1]).unwrap();
                } else {
                    let owned: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
                    g.prefill(ctx, &owned, None).unwrap();
                }
                let format = cache.format;
                let check = |g: &Generator, lens: [usize; 3], when: &str| {
                    assert_eq!(g.lens(), lens.map(|l| l as u32));
                    let got = g.logits().to_vec(ctx).unwrap();
                    for b in 0..3 {
                        let at = lens[b] - 1;
                        let want: Vec<f64> = full[(b * LEN + at) * VOCAB..][..VOCAB]
                            .iter()
                            .map(|&x| x as f64)
                            .collect();
                        // Keys and values rounded to int8 (max |row| / 254) or f16 (2^-11
                        // relative) move the logits by that much of their size.
                        let (atol, rtol) = match format {
                            KvFormat::Int8 => (0.03 * largest, 0.0),
                            KvFormat::F16 => (2e-3 * largest, 0.0),
                            _ => (FORWARD_ATOL, FORWARD_RTOL),
                        };
                        let row = &got[b * VOCAB..][..VOCAB];
                        assert_close(
                            &format!("{what} {when}, sequence {b}"),
                            row,
                            &want,
                            atol,
                            rtol,
                        );
                    }
                };
                check(&g, prompt_lens, "after the prefill");
                let feed: Vec<Option<u32>> =
                    (0..3).map(|b| Some(targets[b][prompt_lens[b]])).collect();
                g.step(ctx, &feed).unwrap();
                check(&g, prompt_lens.map(|l| l + 1), "a step later");
            }
        }
    });
}

/// Continuous batching over a paged cache: a finished sequence is released (its blocks freed)
/// and a new request admitted into its slot while the others keep decoding, and a sequence forked
/// into another slot shares its prefix; every slot's logits equal the full forward of its own
/// tokens.
#[test]
fn paged_generation_admits_releases_and_forks() {
    for_each_backend(|name, ctx| {
        let (label, c) = configs()
            .into_iter()
            .find(|(l, _)| l.starts_with("decoder-only LLaMA"))
            .unwrap();
        let mut model = Transformer::new(ctx, c, SHAPE, 5).unwrap();
        let seqs = sequences(6, &[9, 9, 9, 9], SHAPE.tgt_len);
        // The full forward of three sequences at a time.
        let full = |model: &mut Transformer, rows: [&Vec<u32>; 3]| {
            full_logits(ctx, model, &rows.map(|r| r.clone()), &[])
        };
        let shape = GeneratorShape {
            batch: 3,
            capacity: SHAPE.tgt_len,
            prefill_chunk: 3,
            src_len: 0,
        };
        let layout = CacheLayout::Paged {
            page: 2,
            pool_blocks: 14,
        };
        let mut generator = Generator::with_layout(ctx, &model, shape, layout).unwrap();
        let check =
            |generator: &Generator, expected: &[Vec<f32>; 3], lens: [usize; 3], what: &str| {
                let got = generator.logits().to_vec(ctx).unwrap();
                for b in 0..3 {
                    let row = &got[b * VOCAB..][..VOCAB];
                    let want: Vec<f64> = expected[b][(b * SHAPE.tgt_len + lens[b] - 1) * VOCAB..]
                        [..VOCAB]
                        .iter()
                        .map(|&x| x as f64)
                        .collect();
                    let tag = format!("[{name}] {label} {what}, slot {b}");
                    assert_close(&tag, row, &want, FORWARD_ATOL, FORWARD_RTOL);
                }
            };
        let prompts: Vec<Vec<u32>> = (0..3).map(|b| seqs[b][..4].to_vec()).collect();
        generator.prefill(ctx, &prompts, None).unwrap();
        let all = full(&mut model, [&seqs[0], &seqs[1], &seqs[2]]);
        let expected = [all.clone(), all.clone(), all.clone()];
        check(&generator, &expected, [4, 4, 4], "after the prefill");
        let free = generator.paged_cache().unwrap().free_blocks();
        assert_eq!(free, 14 - 3 * 2, "[{name}] blocks follow the tokens");
        // Slot 1 finishes: its blocks are freed; a new request (sequence 3) is admitted there.
        generator.release(1).unwrap();
        assert_eq!(generator.paged_cache().unwrap().free_blocks(), free + 2);
        assert_eq!(generator.lens(), &[4, 0, 4]);
        generator.admit(ctx, 1, &seqs[3][..5]).unwrap();
        assert_eq!(generator.lens(), &[4, 5, 4]);
        let now = full(&mut model, [&seqs[0], &seqs[3], &seqs[2]]);
        let expected = [now.clone(), now.clone(), now.clone()];
        check(
            &generator,
            &expected,
            [4, 5, 4],
            "after admitting a request",
        );
        // All three decode a step.
        let feed = [Some(seqs[0][4]), Some(seqs[3][5]), Some(seqs[2][4])];
        generator.step(ctx, &feed).unwrap();
        check(&generator, &expected, [5, 6, 5], "a step later");
        // Slot 0 forks into slot 2 (which ends): the two continue with different tokens; the shared
        // half-full block is copied at the first write.
        generator.fork(0, 2).unwrap();
        let mut branch = seqs[0].clone();
        branch[5] = (seqs[0][5] % (VOCAB as u32 - 1)) + 1;
        if branch[5] == seqs[0][5] {
            branch[5] = branch[5] % (VOCAB as u32 - 1) + 1;
        }
        generator
            .step(ctx, &[Some(seqs[0][5]), None, Some(branch[5])])
            .unwrap();
        let forked = full(&mut model, [&seqs[0], &seqs[3], &branch]);
        let expected = [forked.clone(), now.clone(), forked.clone()];
        check(&generator, &expected, [6, 6, 6], "after the fork");
        let cache = generator.paged_cache().unwrap();
        assert_eq!(
            cache.blocks(0).unwrap()[..2],
            cache.blocks(2).unwrap()[..2],
            "[{name}] the full prefix blocks stay shared"
        );
        // Forks need a paged cache; admitting into a busy slot is refused.
        let mut contiguous = Generator::new(ctx, &model, shape).unwrap();
        assert!(contiguous.fork(0, 1).is_err());
        assert!(generator.admit(ctx, 0, &seqs[3][..2]).is_err());
    });
}

#[test]
fn greedy_generation_matches_rerunning_the_forward() {
    for_each_backend(|name, ctx| {
        let c = configs()[0].1;
        let mut model = Transformer::new(ctx, c, SHAPE, 7).unwrap();
        let prompts = sequences(8, &[3, 1, 4], SHAPE.tgt_len);
        let shape = GeneratorShape {
            batch: 3,
            capacity: SHAPE.tgt_len,
            prefill_chunk: 2,
            src_len: 0,
        };
        let mut generator = Generator::new(ctx, &model, shape).unwrap();
        let options = GenerateOptions::default()
            .max_new_tokens(4)
            .sampling(Sampling::greedy())
            .stop(None);
        let out = generator.generate(ctx, &prompts, None, &options).unwrap();
        assert!(out.tokens.iter().all(|t| t.len() == 4), "[{name}] {out:?}");
        // A second generation creates no bind group (nor parameter block): every recording reuses
        // the first one's.
        let (created, _) = generator.binding_counts();
        let again = generator.generate(ctx, &prompts, None, &options).unwrap();
        assert_eq!(
            again.tokens, out.tokens,
            "[{name}] a rerun generated other tokens"
        );
        let (created_again, reused) = generator.binding_counts();
        assert_eq!(created_again, created, "[{name}] {reused} reused");
        assert!(
            created > 0 && reused > created,
            "[{name}] {created} created, {reused} reused"
        );
        assert_eq!(out.decode_steps, 3);
        // Each generated token is the arg max of the full forward over the prompt and the tokens
        // before it.
        let whole: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&out.tokens)
            .map(|(p, t)| p.iter().chain(t).copied().collect())
            .collect();
        let full = full_logits(ctx, &mut model, &whole, &[]);
        for (b, p) in prompts.iter().enumerate() {
            for (k, &token) in out.tokens[b].iter().enumerate() {
                let at = p.len() - 1 + k;
                let row = &full[(b * SHAPE.tgt_len + at) * VOCAB..][..VOCAB];
                let arg = (0..VOCAB)
                    .max_by(|&x, &y| row[x].total_cmp(&row[y]).then(y.cmp(&x)))
                    .unwrap();
                assert_eq!(token, arg as u32, "[{name}] sequence {b} token {k}");
            }
        }
    });
}

#[test]
fn bad_generation_input_is_a_typed_error_and_leaves_the_cache() {
    for_each_backend(|name, ctx| {
        let model = Transformer::new(ctx, configs()[0].1, SHAPE, 3).unwrap();
        let shape = GeneratorShape {
            batch: 2,
            capacity: 4,
            prefill_chunk: 4,
            src_len: 0,
        };
        let mut generator = Generator::new(ctx, &model, shape).unwrap();
        generator
            .prefill(ctx, &[vec![1, 2, 3], vec![4]], None)
            .unwrap();
        let before = generator.lens().to_vec();
        let check = |generator: &Generator, e: wgpu_attention::Error, needle: &str| {
            let text = e.to_string();
            assert!(text.contains(needle), "[{name}] {text}");
            assert_eq!(
                generator.lens(),
                before,
                "[{name}] the cache changed: {text}"
            );
        };
        // Past the capacity: a prompt, then a step once a sequence is full.
        let e = generator
            .prefill(ctx, &[vec![1; 5], vec![2]], None)
            .unwrap_err();
        check(&generator, e, "capacity");
        generator.step(ctx, &[Some(5), None]).unwrap();
        let before = generator.lens().to_vec();
        assert_eq!(before, [4, 1]);
        let e = generator.step(ctx, &[Some(1), Some(1)]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("sequence 0") && text.contains("capacity 4"),
            "[{name}] {text}"
        );
        assert_eq!(generator.lens(), before);
        // A batch index out of range, an id past the vocabulary, sources for a decoder-only model.
        let e = generator.step(ctx, &[None, None, Some(1)]).unwrap_err();
        assert!(e.to_string().contains("batch 2"), "[{name}] {e}");
        let e = generator
            .step(ctx, &[None, Some(VOCAB as u32)])
            .unwrap_err();
        assert!(e.to_string().contains("vocab"), "[{name}] {e}");
        let e = generator
            .prefill(ctx, &[vec![1], vec![1]], Some(&[vec![1], vec![1]]))
            .unwrap_err();
        assert!(e.to_string().contains("decoder-only"), "[{name}] {e}");
        assert_eq!(generator.lens(), before);
        // Configurations the cache cannot serve are refused when the generator is built.
        let learned = config(0).learned_positions(true);
        let model = Transformer::new(ctx, learned, SHAPE, 3).unwrap();
        let long = GeneratorShape {
            capacity: 10,
            ..shape
        };
        let e = Generator::new(ctx, &model, long).err().unwrap();
        assert!(e.to_string().contains("learned"), "[{name}] {e}");
        // Prompts a paged pool cannot hold fail before any prefill pass runs, whether they would
        // take one pass or several (chunk 2 of a batch of 2: four tokens per pass): 4 blocks of
        // 2 tokens hold 8.
        let paged = CacheLayout::Paged {
            page: 2,
            pool_blocks: 4,
        };
        let small = GeneratorShape {
            capacity: 8,
            prefill_chunk: 2,
            ..shape
        };
        let model = Transformer::new(ctx, configs()[0].1, SHAPE, 3).unwrap();
        let mut g = Generator::with_layout(ctx, &model, small, paged).unwrap();
        g.prefill(ctx, &[vec![1, 2, 3], vec![4]], None).unwrap();
        for prompts in [vec![vec![1; 7], vec![2; 3]], vec![vec![1; 5], vec![2; 5]]] {
            let e = g.prefill(ctx, &prompts, None).unwrap_err();
            assert!(
                matches!(e, wgpu_attention::Error::KvCacheFull { .. }),
                "[{name}] {e}"
            );
            assert_eq!(g.lens(), &[3, 1], "[{name}] the cache changed: {e}");
        }
        // Admitting with 2 free blocks: a prompt of 5 tokens needs 3 (over two passes, 4 and 1).
        g.release(1).unwrap();
        g.admit(ctx, 1, &[1, 2]).unwrap();
        g.release(1).unwrap();
        g.admit(ctx, 1, &[1, 2, 3, 4]).unwrap();
        let before = g.lens().to_vec();
        g.release(1).unwrap();
        let e = g.admit(ctx, 1, &[1; 5]).unwrap_err();
        assert!(
            matches!(e, wgpu_attention::Error::KvCacheFull { .. }),
            "[{name}] {e}"
        );
        assert_eq!(g.lens(), &[before[0], 0], "[{name}] the cache changed: {e}");
    });
}

/// The serving loop: requests arriving over time, with their own token limits and stop ids, more
/// requests than slots, over a paged cache: each request's streamed tokens are those of greedy
/// generation of its prompt alone, in order, the last one marked with why it ended.
#[test]
fn server_streams_each_request_as_if_it_ran_alone() {
    for_each_backend(|name, ctx| {
        let (_, c) = configs()
            .into_iter()
            .find(|(l, _)| l.starts_with("decoder-only LLaMA"))
            .unwrap();
        let model = Transformer::new(ctx, c, SHAPE, 8).unwrap();
        let capacity = SHAPE.tgt_len;
        let prompts = sequences(9, &[3, 2, 4, 1, 3], capacity);
        let limits = [4, 6, 3, 5, 2];
        // Request 2 stops at its second greedy token.
        let alone = |prompt: &[u32], max_new_tokens: usize, stop: Option<u32>| {
            let shape = GeneratorShape {
                batch: 1,
                capacity,
                prefill_chunk: 4,
                src_len: 0,
            };
            let mut g = Generator::new(ctx, &model, shape).unwrap();
            let options = GenerateOptions::default()
                .max_new_tokens(max_new_tokens)
                .stop(stop);
            g.generate(ctx, &[prompt.to_vec()], None, &options)
                .unwrap()
                .tokens[0]
                .clone()
        };
        let stop2 = alone(&prompts[2], 3, None)[1];
        let shape = GeneratorShape {
            batch: 2,
            capacity,
            prefill_chunk: 2,
            src_len: 0,
        };
        let layout = CacheLayout::Paged {
            page: 2,
            pool_blocks: 10,
        };
        let generator = Generator::with_layout(ctx, &model, shape, layout).unwrap();
        let mut server = Server::new(generator).unwrap();
        let request = |i: usize| {
            let r = Request::new(prompts[i].clone(), limits[i]);
            if i == 2 {
                r.stop(stop2)
            } else {
                r
            }
        };
        let mut streamed: Vec<Vec<Token>> = vec![Vec::new(); 5];
        for i in 0..2 {
            assert_eq!(server.submit(request(i)).unwrap(), i as u64);
        }
        let mut round = 0;
        while !server.is_idle() || round < 3 {
            // Three more arrive while the first two decode.
            if (1..=3).contains(&round) {
                server.submit(request(round + 1)).unwrap();
            }
            server
                .step(ctx, |t| streamed[t.request as usize].push(t))
                .unwrap();
            assert!(server.in_flight() <= 2);
            round += 1;
        }
        for i in 0..5 {
            let stop = (i == 2).then_some(stop2);
            let want = alone(&prompts[i], limits[i], stop);
            let got: Vec<u32> = streamed[i].iter().map(|t| t.id).collect();
            assert_eq!(got, want, "[{name}] request {i}");
            let indices: Vec<usize> = streamed[i].iter().map(|t| t.index).collect();
            assert_eq!(indices, (0..want.len()).collect::<Vec<_>>());
            let finish = streamed[i].last().unwrap().finished;
            let expected = if i == 2 { Finish::Stop } else { Finish::Length };
            assert_eq!(finish, Some(expected), "[{name}] request {i}");
            assert!(streamed[i][..want.len() - 1]
                .iter()
                .all(|t| t.finished.is_none()));
        }
        // Every block is free again.
        assert_eq!(server.generator().paged_cache().unwrap().free_blocks(), 10);
        // Refused at submission: an empty prompt, one filling the capacity, an id past the vocabulary.
        for prompt in [vec![], vec![1; capacity], vec![VOCAB as u32]] {
            assert!(server.submit(Request::new(prompt, 1)).is_err());
        }
    });
}

/// A server step that fails streams nothing and leaves every request where it was: on an
/// application's own device, destroyed between two rounds, the next round returns the typed
/// `DeviceLost`, calls no callback, and keeps the requests in flight and queued; so do the rounds
/// after it (nothing panics in wgpu).
#[test]
fn a_failed_server_step_streams_nothing_and_keeps_every_request() {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let Some(adapter) = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN))
        .into_iter()
        .next()
    else {
        eprintln!("no Vulkan adapter: skipped");
        return;
    };
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .unwrap();
    let ctx = Context::from_device(device.clone(), queue).unwrap();
    device.set_device_lost_callback(ctx.device_lost_handler());
    let (_, c) = configs()
        .into_iter()
        .find(|(l, _)| l.starts_with("decoder-only LLaMA"))
        .unwrap();
    let model = Transformer::new(&ctx, c, SHAPE, 8).unwrap();
    let shape = GeneratorShape {
        batch: 2,
        capacity: SHAPE.tgt_len,
        prefill_chunk: 2,
        src_len: 0,
    };
    let layout = CacheLayout::Paged {
        page: 2,
        pool_blocks: 10,
    };
    let generator = Generator::with_layout(&ctx, &model, shape, layout).unwrap();
    let mut server = Server::new(generator).unwrap();
    for prompt in sequences(4, &[3, 2, 4], SHAPE.tgt_len) {
        server.submit(Request::new(prompt, 5)).unwrap();
    }
    let mut streamed = 0;
    for _ in 0..2 {
        server.step(&ctx, |_| streamed += 1).unwrap();
    }
    assert!(streamed > 0);
    let (in_flight, queued) = (server.in_flight(), server.queued());
    assert_eq!((in_flight, queued), (2, 1));
    device.destroy();
    let _ = device.poll(wgpu::PollType::wait_indefinitely());
    for _ in 0..2 {
        let err = server
            .step(&ctx, |t| panic!("token {t:?} streamed by a failed step"))
            .unwrap_err();
        assert!(matches!(err, Error::DeviceLost(_)), "{err}");
        assert_eq!((server.in_flight(), server.queued()), (in_flight, queued));
    }
}

/// Speculative decoding: drafts verified in one pass each (trees whose kept path is not their first
/// rows, so the cache's rows move; chains all right and all wrong; two sequences with different
/// drafts in one pass) give exactly the tokens of plain greedy decoding with the same cache, for
/// every score function that decodes with tree masks (RoPE, ALiBi and windows at depth positions,
/// learned positions, relative buckets, cosine scores, key clipping, encoder-decoder), through
/// contiguous, paged and int8 caches. Additive scores are refused.
#[test]
fn verified_drafts_give_the_tokens_of_plain_greedy_decoding() {
    const NEW: usize = 8;
    let model_shape = BatchShape {
        batch: 2,
        src_len: 7,
        tgt_len: 24,
    };
    for_each_backend(|name, ctx| {
        for (n, (label, c)) in configs().into_iter().enumerate() {
            let mut model = Transformer::new(ctx, c, model_shape, 70 + n as u64).unwrap();
            let prompts = vec![vec![3, 5, 7], vec![2, 9]];
            let sources = vec![vec![1, 4, 6, 8], vec![2, 2, 5]];
            let srcs = c.has_encoder().then_some(sources.as_slice());
            let shape = GeneratorShape {
                batch: 2,
                capacity: 24,
                prefill_chunk: 8,
                src_len: 7,
            };
            if c.additive_attention.is_some() {
                let mut g = Generator::new(ctx, &model, shape).unwrap();
                g.prefill(ctx, &prompts, srcs).unwrap();
                let drafts = [Some(Draft::chain(1, &[2])), None];
                assert!(g.verify(ctx, &drafts).is_err(), "[{name}] {label}");
                continue;
            }
            let mut caches: Vec<CacheConfig> =
                layouts(&c).into_iter().map(CacheConfig::from).collect();
            caches.push(CacheConfig::default().with_format(KvFormat::Int8));
            for cache in caches {
                let what = format!("[{name}] {label} {cache:?}");
                let options = GenerateOptions::default().max_new_tokens(NEW);
                let plain = Generator::with_layout(ctx, &model, shape, cache)
                    .unwrap()
                    .generate(ctx, &prompts, srcs, &options)
                    .unwrap()
                    .tokens;
                let mut g = Generator::with_layout(ctx, &model, shape, cache).unwrap();
                g.prefill(ctx, &prompts, srcs).unwrap();
                let first = g.sample(ctx, &Sampling::greedy()).unwrap();
                let mut out: Vec<Vec<u32>> = first.iter().map(|&t| vec![t]).collect();
                let mut round = 0;
                while out.iter().any(|o| o.len() < NEW) {
                    let drafts: Vec<Option<Draft>> = (0..2)
                        .map(|b| {
                            if out[b].len() >= NEW {
                                return None;
                            }
                            let k = out[b].len() - 1;
                            let next = out[b][k];
                            // The plain tokens after the pending one, and a wrong guess for each.
                            let t = |i: usize| plain[b].get(k + i).copied().unwrap_or(1);
                            let wrong = |x: u32| (x + 1) % VOCAB as u32;
                            Some(match (round + b) % 3 {
                                // Kept path: rows 0, 2, 3 (rows 2 and 3 move to 1 and 2).
                                0 => Draft::tree(
                                    vec![next, wrong(t(1)), t(1), t(2), t(2), wrong(t(3))],
                                    vec![None, Some(0), Some(0), Some(2), Some(1), Some(3)],
                                )
                                .unwrap(),
                                1 => Draft::chain(next, &[wrong(t(1)), t(2)]),
                                _ => Draft::chain(next, &[t(1), t(2), t(3)]),
                            })
                        })
                        .collect();
                    let before: Vec<u32> = g.lens().to_vec();
                    let got = g.verify(ctx, &drafts).unwrap();
                    for b in 0..2 {
                        if drafts[b].is_none() {
                            assert_eq!(g.lens()[b], before[b], "{what}: an idle sequence");
                            continue;
                        }
                        // The root and the kept guesses are cached; the last token is pending.
                        assert_eq!(
                            g.lens()[b] as usize,
                            before[b] as usize + got[b].len(),
                            "{what}"
                        );
                        out[b].extend(&got[b]);
                    }
                    // Each kept path end's logits are the full forward's at its position.
                    if cache.format == KvFormat::F32 {
                        let fed: Vec<Vec<u32>> = (0..2)
                            .map(|b| {
                                let mut fed = prompts[b].clone();
                                fed.extend(&out[b][..out[b].len() - 1]);
                                fed
                            })
                            .collect();
                        let full = full_logits(ctx, &mut model, &fed, &sources);
                        let logits = g.logits().to_vec(ctx).unwrap();
                        for b in 0..2 {
                            assert_eq!(g.lens()[b] as usize, fed[b].len(), "{what}");
                            let at = (b * model_shape.tgt_len + fed[b].len() - 1) * VOCAB;
                            let expected: Vec<f64> =
                                full[at..at + VOCAB].iter().map(|&x| x as f64).collect();
                            assert_close(
                                &format!("{what} round {round} sequence {b}"),
                                &logits[b * VOCAB..][..VOCAB],
                                &expected,
                                FORWARD_ATOL,
                                FORWARD_RTOL,
                            );
                        }
                    }
                    round += 1;
                }
                for b in 0..2 {
                    assert_eq!(out[b][..NEW], plain[b][..], "{what}: sequence {b}");
                }
                // The pending token's logits are the generator's: greedy sampling repeats it.
                let again = g.sample(ctx, &Sampling::greedy()).unwrap();
                for b in 0..2 {
                    assert_eq!(again[b], *out[b].last().unwrap(), "{what}: sequence {b}");
                }
            }
        }
        // Drafts are validated before anything runs: the cache is unchanged.
        let model = Transformer::new(ctx, configs()[0].1, model_shape, 5).unwrap();
        let shape = GeneratorShape {
            batch: 2,
            capacity: 24,
            prefill_chunk: 4,
            src_len: 0,
        };
        let mut g = Generator::new(ctx, &model, shape).unwrap();
        g.prefill(ctx, &[vec![1, 2], vec![3]], None).unwrap();
        for drafts in [
            vec![Some(Draft::chain(1, &[2; 32])), None],
            vec![Some(Draft::chain(VOCAB as u32, &[])), None],
            vec![None],
        ] {
            assert!(g.verify(ctx, &drafts).is_err(), "[{name}] {drafts:?}");
            assert_eq!(g.lens(), &[2, 1]);
        }
        assert!(Draft::tree(vec![1, 2], vec![None, None]).is_err());
        assert!(Draft::tree(vec![1, 2], vec![Some(1), None]).is_err());
    });
}
