//! Published-checkpoint loading against Hugging Face `transformers` (fixtures made by
//! `scripts/hf_fixtures.py`: small random GPT-2 and LLaMA models saved with `save_pretrained`, the
//! logits `transformers` computed for fixed ids and its greedy continuation of a prompt). Both back
//! ends: the full forward's logits, the cached path's logits and greedy tokens, the tokenizer, a
//! fine-tuning run saved back and reloaded, and the refusals.

use crate::common;

use std::path::{Path, PathBuf};

use common::for_each_backend;
use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::{Context, Error, PretrainedProblem};
use wgpu_attention_serve::{
    CacheConfig, CacheLayout, GenerateOptions, Generator, GeneratorShape, KvFormat,
};
use wgpu_attention_transformer::model::pretrained::{Architecture, Pretrained};
use wgpu_attention_transformer::model::{Batch, BatchShape};
use wgpu_attention_transformer::training::Trainer;

/// Logits within this of `transformers`' (f32 on both sides, the same weights; about 1e-5 seen):
/// the engine's f32 kernels sum in other orders than PyTorch's CPU kernels.
const LOGIT_ATOL: f32 = 1e-4;
/// The bound stated for logits decoded from an int8 key/value cache, relative to the largest
/// |logit| (each cached value moves by at most max |row| / 254; measured on these random-weight
/// fixtures: 1.3% (gpt2-tied) to 2.4% (llama-gqa)).
const INT8_LOGIT_RTOL: f32 = 4e-2;

/// The bound stated for logits decoded from an f16 key/value cache, relative to the largest
/// |logit| (each cached value rounded to f16's 11 bits; measured on these random-weight
/// fixtures: 0.09% (gpt2-tied) to 0.16% (llama-gqa), the argmax kept at every row).
const F16_LOGIT_RTOL: f32 = 5e-3;

const FIXTURES: [&str; 3] = ["gpt2-tied", "llama-gqa", "llama-tied"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

struct Expected {
    ids: Vec<u32>,
    /// `[2, 16, vocab]`.
    logits: Vec<f32>,
    prompt: String,
    prompt_ids: Vec<u32>,
    greedy: Vec<u32>,
    /// The smallest gap between the top two logits along transformers' greedy continuation.
    greedy_min_margin: f64,
}

fn expected(name: &str) -> Expected {
    let bytes = std::fs::read(fixture(name).join("expected.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<i32> = bytemuck::pod_collect_to_vec(file.tensor("input_ids").unwrap().data());
    let logits: Vec<f32> = bytemuck::pod_collect_to_vec(file.tensor("logits").unwrap().data());
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("expected.json")).unwrap(),
    )
    .unwrap();
    let list = |key: &str| -> Vec<u32> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    Expected {
        ids: ids.into_iter().map(|i| i as u32).collect(),
        logits,
        prompt: json["prompt"].as_str().unwrap().to_string(),
        prompt_ids: list("prompt_ids"),
        greedy: list("greedy"),
        greedy_min_margin: json["greedy_min_margin"].as_f64().unwrap(),
    }
}

const SEQ: usize = 16;

/// The full forward over the fixture's two sequences of 16 ids.
fn forward_logits(ctx: &Context, checkpoint: &Pretrained, ids: &[u32]) -> Vec<f32> {
    let shape = BatchShape {
        batch: 2,
        src_len: 0,
        tgt_len: SEQ,
    };
    let mut model = checkpoint.model(ctx, shape).unwrap();
    let batch = Batch {
        tgt_in: ids.to_vec(),
        tgt_out: ids.to_vec(),
        tgt_lens: vec![SEQ as u32; 2],
        ..Default::default()
    };
    model.set_batch(ctx, &batch).unwrap();
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    model.forward(ctx, &mut encoder).unwrap();
    ctx.queue().submit([encoder.finish()]);
    model.logits().to_vec(ctx).unwrap()
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |best, i| if x[i] > x[best] { i } else { best })
}

/// The gap between the largest and second largest of `x`.
fn margin(x: &[f32]) -> f32 {
    let top = argmax(x);
    let second = x
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != top)
        .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
    x[top] - second
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn logits_match_transformers() {
    for_each_backend(|backend, ctx| {
        for name in FIXTURES {
            let e = expected(name);
            let checkpoint = Pretrained::open(fixture(name)).unwrap();
            let logits = forward_logits(ctx, &checkpoint, &e.ids);
            let err = max_diff(&logits, &e.logits);
            eprintln!("[{backend}] {name}: full forward, max |logit - transformers| {err:.2e}");
            assert!(err <= LOGIT_ATOL, "[{backend}] {name}: {err}");
        }
    });
}

/// The cached path: every row of both sequences fed one step at a time through the generator's
/// key/value cache gives `transformers`' logits, and greedy decoding of the prompt its tokens.
#[test]
fn cached_decoding_matches_transformers() {
    for_each_backend(|backend, ctx| {
        for name in FIXTURES {
            let e = expected(name);
            let checkpoint = Pretrained::open(fixture(name)).unwrap();
            let shape = BatchShape {
                batch: 2,
                src_len: 0,
                tgt_len: SEQ,
            };
            let model = checkpoint.model(ctx, shape).unwrap();
            let vocab = checkpoint.config().vocab;
            let gen_shape = GeneratorShape {
                batch: 2,
                capacity: SEQ,
                prefill_chunk: 5,
                src_len: 0,
            };
            // The f32 cache, then an int8 one (paged, 4-token blocks) and an f16 one: the same
            // teacher-forced rows, the int8 and f16 caches' errors stated against transformers'
            // logits.
            let int8 = CacheConfig::new(CacheLayout::Paged {
                page: 4,
                pool_blocks: 2 * SEQ.div_ceil(4),
            })
            .with_format(KvFormat::Int8);
            let f16 = CacheConfig::default().with_format(KvFormat::F16);
            for cache in [CacheConfig::default(), int8, f16] {
                let mut generator = Generator::with_layout(ctx, &model, gen_shape, cache).unwrap();
                // Rows 0..5 by prefill (its last row's logits), then one step per row.
                let prompts: Vec<Vec<u32>> = (0..2)
                    .map(|b| e.ids[b * SEQ..b * SEQ + 5].to_vec())
                    .collect();
                generator.prefill(ctx, &prompts, None).unwrap();
                let mut worst = 0.0f32;
                let mut span = 0.0f32;
                // Rows whose top two logits (transformers') are further apart than twice the
                // worst error must keep their argmax; how many keep it of all rows is reported.
                let mut rows = Vec::new();
                for row in 4..SEQ {
                    if row > 4 {
                        let feed: Vec<Option<u32>> =
                            (0..2).map(|b| Some(e.ids[b * SEQ + row])).collect();
                        generator.step(ctx, &feed).unwrap();
                    }
                    let got = generator.logits().to_vec(ctx).unwrap();
                    for b in 0..2 {
                        let at = (b * SEQ + row) * vocab;
                        let (got, want) =
                            (&got[b * vocab..(b + 1) * vocab], &e.logits[at..at + vocab]);
                        worst = worst.max(max_diff(got, want));
                        span = want.iter().fold(span, |m, x| m.max(x.abs()));
                        rows.push((argmax(got) == argmax(want), margin(want)));
                    }
                }
                let format = cache.format.name();
                let agree = rows.iter().filter(|r| r.0).count();
                eprintln!(
                    "[{backend}] {name}: cached path, {format} cache, max |logit - transformers| {worst:.2e} ({:.2}% of max |logit| {span:.2}), argmax agrees at {agree}/{} rows",
                    100.0 * worst / span,
                    rows.len()
                );
                let bound = match cache.format {
                    KvFormat::F32 => LOGIT_ATOL,
                    KvFormat::F16 => F16_LOGIT_RTOL * span,
                    _ => INT8_LOGIT_RTOL * span,
                };
                assert!(worst <= bound, "[{backend}] {name} {format}: {worst}");
                for (row, &(agrees, margin)) in rows.iter().enumerate() {
                    assert!(
                        agrees || margin <= 2.0 * worst,
                        "[{backend}] {name} {format}: row {row} changed its argmax at margin {margin}"
                    );
                }
            }

            let capacity = e.prompt_ids.len() + e.greedy.len();
            let gen_shape = GeneratorShape {
                batch: 1,
                capacity,
                prefill_chunk: 4,
                src_len: 0,
            };
            // The weights alone, no training buffers: the same tokens, under half the memory of a
            // model with a generator over it.
            let before = ctx.memory().current_bytes;
            let layout = CacheLayout::Contiguous;
            let mut generator =
                Generator::from_pretrained(ctx, &checkpoint, gen_shape, layout).unwrap();
            let inference_bytes = ctx.memory().current_bytes - before;
            let model = checkpoint
                .model(
                    ctx,
                    BatchShape {
                        batch: 1,
                        src_len: 0,
                        tgt_len: 1,
                    },
                )
                .unwrap();
            let with_model = Generator::new(ctx, &model, gen_shape).unwrap();
            let training_bytes = ctx.memory().current_bytes - before - inference_bytes;
            drop(with_model);
            let params: u64 = model.params.values().iter().map(|v| v.size_bytes()).sum();
            eprintln!(
                "[{backend}] {name}: generator from the checkpoint {inference_bytes} B, model and generator {training_bytes} B (parameters {params} B)"
            );
            assert!(
                inference_bytes + params <= training_bytes,
                "[{backend}] {name}"
            );
            let options = GenerateOptions::default().max_new_tokens(e.greedy.len());
            let out = generator
                .generate(ctx, std::slice::from_ref(&e.prompt_ids), None, &options)
                .unwrap();
            assert_eq!(out.tokens[0], e.greedy, "[{backend}] {name}: greedy tokens");
            // The same through a paged cache of 4-token blocks.
            let paged = CacheLayout::Paged {
                page: 4,
                pool_blocks: capacity.div_ceil(4),
            };
            let mut generator =
                Generator::from_pretrained(ctx, &checkpoint, gen_shape, paged).unwrap();
            let out = generator
                .generate(ctx, std::slice::from_ref(&e.prompt_ids), None, &options)
                .unwrap();
            assert_eq!(
                out.tokens[0], e.greedy,
                "[{backend}] {name}: greedy tokens, paged"
            );
            // Greedy decoding from an int8 cache: the tokens it shares with the f32 cache's.
            let int8 = CacheConfig::new(CacheLayout::Contiguous).with_format(KvFormat::Int8);
            let mut generator =
                Generator::from_pretrained(ctx, &checkpoint, gen_shape, int8).unwrap();
            let out = generator
                .generate(ctx, std::slice::from_ref(&e.prompt_ids), None, &options)
                .unwrap();
            let same = out.tokens[0]
                .iter()
                .zip(&e.greedy)
                .take_while(|(a, b)| a == b)
                .count();
            eprintln!(
                "[{backend}] {name}: greedy tokens from an int8 cache: the first {same} of {} equal the f32 cache's (smallest greedy margin {:.3})",
                e.greedy.len(),
                e.greedy_min_margin
            );
        }
    });
}

/// The `tokenizers` crate reads the fixtures' `tokenizer.json` as `transformers` does.
#[test]
fn tokenizer_matches_transformers() {
    for name in FIXTURES {
        let e = expected(name);
        let tokenizer =
            tokenizers::Tokenizer::from_file(fixture(name).join("tokenizer.json")).unwrap();
        let ids = tokenizer
            .encode(e.prompt.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids, e.prompt_ids, "{name}");
        let text = tokenizer.decode(&ids, false).unwrap();
        assert_eq!(text, e.prompt, "{name}");
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgpu-attention-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn refusal(dir: &Path) -> PretrainedProblem {
    match Pretrained::open(dir).err().expect("refused") {
        Error::Pretrained { problem, .. } => problem,
        other => panic!("expected Error::Pretrained, got {other}"),
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(json.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
}

/// Options the engine does not implement are refused by name, as are unknown architectures, and the
/// transformers 4 spelling of rotary settings (`rope_theta`, `rope_scaling`) maps like 5's.
#[test]
fn configurations_the_engine_cannot_compute_are_refused() {
    use serde_json::json;
    // (fixture, option set, its value, what the refusal names)
    let cases = [
        (
            "gpt2-tied",
            "activation_function",
            json!("gelu"),
            "activation_function",
        ),
        (
            "gpt2-tied",
            "scale_attn_by_inverse_layer_idx",
            json!(true),
            "scale_attn_by_inverse_layer_idx",
        ),
        ("gpt2-tied", "model_type", json!("bert"), "bert"),
        (
            "llama-tied",
            "sliding_window",
            json!(4096),
            "sliding_window",
        ),
        ("llama-tied", "head_dim", json!(8), "head_dim"),
        ("llama-tied", "mlp_bias", json!(true), "mlp_bias"),
        (
            "llama-tied",
            "rope_parameters",
            json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0}),
            "yarn",
        ),
    ];
    for (i, (name, key, value, needle)) in cases.into_iter().enumerate() {
        let dir = scratch(&format!("refuse-{i}"));
        copy_dir(&fixture(name), &dir);
        edit_config(&dir, |m| {
            m.insert(key.into(), value);
        });
        let problem = refusal(&dir);
        assert!(problem.to_string().contains(needle), "{name}: {problem}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    // transformers 4 wrote rope_theta and rope_scaling: the same configuration.
    let dir = scratch("v4-rope");
    copy_dir(&fixture("llama-gqa"), &dir);
    edit_config(&dir, |m| {
        let params = m.remove("rope_parameters").unwrap();
        m.insert("rope_theta".into(), params["rope_theta"].clone());
        let mut scaling = params.as_object().unwrap().clone();
        scaling.remove("rope_theta");
        m.insert("rope_scaling".into(), scaling.into());
    });
    let v4 = Pretrained::open(&dir).unwrap();
    let v5 = Pretrained::open(fixture("llama-gqa")).unwrap();
    assert_eq!(v4.config(), v5.config());
    assert!(v5.config().rope_scaling.is_some());
    assert_eq!(v5.architecture(), Architecture::Llama);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Weight files that do not match `config.json` are refused before anything is written.
#[test]
fn mismatched_weights_are_refused() {
    for_each_backend(|_, ctx| {
        let shape = BatchShape {
            batch: 1,
            src_len: 0,
            tgt_len: 4,
        };
        // A configuration with another width: every tensor's shape is off.
        let dir = scratch("shape");
        copy_dir(&fixture("llama-tied"), &dir);
        edit_config(&dir, |m| {
            m.insert("intermediate_size".into(), 40.into());
        });
        let err = Pretrained::open(&dir)
            .unwrap()
            .model(ctx, shape)
            .err()
            .unwrap();
        assert!(
            matches!(
                &err,
                Error::Pretrained {
                    problem: PretrainedProblem::TensorShape { .. },
                    ..
                }
            ),
            "{err}"
        );
        // An untied model needs lm_head.weight.
        edit_config(&dir, |m| {
            m.insert("intermediate_size".into(), 96.into());
            m.insert("tie_word_embeddings".into(), false.into());
        });
        let err = Pretrained::open(&dir)
            .unwrap()
            .model(ctx, shape)
            .err()
            .unwrap();
        assert!(err.to_string().contains("lm_head.weight"), "{err}");
        // One layer fewer leaves layer 1's tensors over.
        edit_config(&dir, |m| {
            m.insert("tie_word_embeddings".into(), true.into());
            m.insert("num_hidden_layers".into(), 1.into());
        });
        let err = Pretrained::open(&dir)
            .unwrap()
            .model(ctx, shape)
            .err()
            .unwrap();
        assert!(
            matches!(&err, Error::Pretrained { problem: PretrainedProblem::UnexpectedTensor(t), .. } if t.contains("layers.1")),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// A loaded model fine-tunes with the Trainer (the loss falls on a toy corpus) and saves back to
/// the Hugging Face layout; the saved directory loads again with the same logits.
#[test]
fn fine_tuned_model_saves_back_and_reloads() {
    for_each_backend(|backend, ctx| {
        for name in ["gpt2-tied", "llama-gqa"] {
            let e = expected(name);
            let checkpoint = Pretrained::open(fixture(name)).unwrap();
            let shape = BatchShape {
                batch: 2,
                src_len: 0,
                tgt_len: SEQ - 1,
            };
            let model = checkpoint.model(ctx, shape).unwrap();
            let mut trainer = Trainer::new(ctx, model, AdamWConfig::default().lr(3e-3)).unwrap();
            // Next-token prediction on the fixture's two sequences.
            let (tgt_in, tgt_out): (Vec<u32>, Vec<u32>) = (0..2)
                .flat_map(|b| (0..SEQ - 1).map(move |i| (b, i)))
                .map(|(b, i)| (e.ids[b * SEQ + i], e.ids[b * SEQ + i + 1]))
                .unzip();
            let batch = Batch {
                tgt_in,
                tgt_out,
                tgt_lens: vec![(SEQ - 1) as u32; 2],
                ..Default::default()
            };
            let loss = |t: &Trainer| t.model.loss().to_vec(ctx).unwrap()[0];
            trainer.step(ctx, &batch).unwrap();
            let first = loss(&trainer);
            for _ in 0..9 {
                trainer.step(ctx, &batch).unwrap();
            }
            trainer.check_finite(ctx).unwrap();
            let last = loss(&trainer);
            eprintln!("[{backend}] {name}: fine-tuning loss {first:.3} -> {last:.3}");
            assert!(
                last < 0.8 * first,
                "[{backend}] {name}: loss {first} -> {last}"
            );

            let dir = scratch(&format!("save-{name}-{backend}"));
            checkpoint.save(ctx, &trainer.model, &dir).unwrap();
            let reloaded = Pretrained::open(&dir).unwrap();
            assert_eq!(reloaded.config(), checkpoint.config());
            let reloaded_model = reloaded.model(ctx, shape).unwrap();
            for (a, b) in trainer
                .model
                .params
                .values()
                .iter()
                .zip(reloaded_model.params.values())
            {
                assert_eq!(
                    a.to_vec(ctx).unwrap(),
                    b.to_vec(ctx).unwrap(),
                    "{name}: saved weights"
                );
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    });
}

/// The serving loop under memory pressure, on the GPT-2 fixture through a paged pool of 4-token
/// blocks: a request that could never fit is refused at submission (naming the blocks it needs
/// and the pool's), two that each fit alone but not together are served one after the other, and
/// two admitted together that outgrow the pool are served by preempting the later one; every
/// request streams the greedy tokens it streams alone in a roomy pool, each index once.
#[test]
fn server_under_memory_pressure_loses_and_repeats_nothing() {
    use wgpu_attention_serve::{Finish, Request, Server, Token};
    for_each_backend(|backend, ctx| {
        let checkpoint = Pretrained::open(fixture("gpt2-tied")).unwrap();
        let vocab = checkpoint.config().vocab as u32;
        let prompt = |len: usize, seed: u32| -> Vec<u32> {
            (0..len as u32)
                .map(|i| (i * 7919 + seed * 104_729) % vocab)
                .collect()
        };
        let capacity = 64;
        let server = |slots: usize, pool_blocks: usize| {
            let shape = GeneratorShape {
                batch: slots,
                capacity,
                prefill_chunk: 16,
                src_len: 0,
            };
            let layout = CacheLayout::Paged {
                page: 4,
                pool_blocks,
            };
            Server::new(Generator::from_pretrained(ctx, &checkpoint, shape, layout).unwrap())
                .unwrap()
        };
        // Each request alone, in a pool that holds it twice over.
        let alone = |prompt: &[u32], new: usize| -> Vec<u32> {
            let mut s = server(1, 32);
            s.submit(Request::new(prompt.to_vec(), new)).unwrap();
            let mut ids = Vec::new();
            s.run(ctx, |t| ids.push(t.id)).unwrap();
            ids
        };
        // Serves `requests` to the end (a bounded number of rounds: no livelock), checking each
        // stream against its run alone.
        let serve = |s: &mut Server, requests: &[(Vec<u32>, usize)]| {
            let mut streamed: Vec<Vec<Token>> = vec![Vec::new(); requests.len()];
            for (prompt, new) in requests {
                s.submit(Request::new(prompt.clone(), *new)).unwrap();
            }
            // Nothing is submitted while serving: a queue that grows is a preemption.
            let (mut rounds, mut preemptions, mut queued) = (0, 0, s.queued());
            while !s.is_idle() {
                s.step(ctx, |t| streamed[t.request as usize].push(t))
                    .unwrap();
                preemptions += usize::from(s.queued() > queued);
                queued = s.queued();
                rounds += 1;
                assert!(rounds < 200, "[{backend}] the server does not finish");
            }
            for (i, (prompt, new)) in requests.iter().enumerate() {
                let ids: Vec<u32> = streamed[i].iter().map(|t| t.id).collect();
                assert_eq!(ids, alone(prompt, *new), "[{backend}] request {i}");
                let indices: Vec<usize> = streamed[i].iter().map(|t| t.index).collect();
                assert_eq!(
                    indices,
                    (0..*new).collect::<Vec<_>>(),
                    "[{backend}] request {i}"
                );
                assert_eq!(streamed[i].last().unwrap().finished, Some(Finish::Length));
            }
            assert_eq!(s.generator().paged_cache().unwrap().free_blocks(), 16);
            preemptions
        };

        // One slot, 12 blocks: a 42-token prompt with 12 new tokens needs 14.
        let mut s = server(1, 12);
        let e = s.submit(Request::new(prompt(42, 1), 12)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::RequestTooLarge {
                    needed: 14,
                    total: 12,
                    ..
                }
            ),
            "[{backend}] {e}"
        );
        assert!(s.is_idle());

        // Two slots, 16 blocks: prompts of 42 and 24 tokens fit alone (11 and 6 blocks with
        // their first new token), not together: the second waits for the first to end.
        let mut s = server(2, 16);
        let preemptions = serve(&mut s, &[(prompt(42, 2), 8), (prompt(24, 3), 8)]);
        assert_eq!(preemptions, 0, "[{backend}]");

        // Two slots, 16 blocks: prompts of 20 and 19 tokens are admitted together (6 and 5
        // blocks); with 20 new tokens each they need 10 blocks each, so the later is preempted
        // and finishes after the first, continuing its stream.
        let mut s = server(2, 16);
        let preemptions = serve(&mut s, &[(prompt(20, 4), 20), (prompt(19, 5), 20)]);
        assert!(preemptions >= 1, "[{backend}] nothing was preempted");
    });
}
