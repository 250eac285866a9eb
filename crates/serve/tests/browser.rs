//! The engine in a browser: WebGPU through wgpu, WGSL compiled by the browser's own compiler (Tint in
//! Chromium), every result checked in the page against the CPU reference compiled to wasm. Only the
//! async API is used: a page's thread must never block.
//!
//! Run (headless Chromium through chromedriver, configured by `webdriver.json`):
//! `scripts/browser-tests` (see the README, "In a browser").
#![cfg(target_arch = "wasm32")]

#[path = "../../../tests/common/mod.rs"]
mod common;

use common::*;
use wasm_bindgen_test::{console_log, wasm_bindgen_test, wasm_bindgen_test_configure};
use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::kernels::sampling::Sampling;
use wgpu_attention::reference::additive as additive_reference;
use wgpu_attention::reference::attention::{self as reference, Masks};
use wgpu_attention::{
    additive_backward, additive_forward, attention_backward, attention_decode, attention_forward,
    AdditiveScores, AttentionOptions, Context, ContextOptions, Error, ForwardViews, GpuTensor,
    KernelFamily,
};
use wgpu_attention_serve::{GenerateOptions, Generator, GeneratorShape};
use wgpu_attention_transformer::model::{Batch, BatchShape, Transformer, TransformerConfig};
use wgpu_attention_transformer::reference::transformer as transformer_reference;
use wgpu_attention_transformer::training::Trainer;

wasm_bindgen_test_configure!(run_in_browser);

/// The kernel families a browser runs: the one for CPU drivers (SwiftShader) and the GPU one.
const FAMILIES: [KernelFamily; 2] = [KernelFamily::CpuDriver, KernelFamily::Gpu];

async fn context() -> Context {
    let ctx = Context::new_async(&ContextOptions::new())
        .await
        .expect("a WebGPU adapter (Chromium needs --enable-unsafe-webgpu)");
    let report = ctx.report();
    console_log!(
        "adapter {} ({:?}, {:?}); storage buffers per stage {}, workgroup storage {} B, \
         invocations {}, shader-f16 {}",
        report.name,
        report.backend,
        report.device_type,
        report.limits.max_storage_buffers_per_shader_stage,
        report.limits.max_compute_workgroup_storage_size,
        report.limits.max_compute_invocations_per_workgroup,
        report.features.contains(wgpu::Features::SHADER_F16),
    );
    ctx
}

/// Compares and logs the worst error (a browser has no stdout for `assert_close`'s report).
fn check(what: &str, gpu: &[f32], reference: &[f64], atol: f64, rtol: f64) {
    let worst = assert_close(what, gpu, reference, atol, rtol);
    console_log!(
        "{what}: worst |err| {:.2e} ({:.1}% of tolerance)",
        worst.abs,
        100.0 * worst.ratio
    );
}

/// Masks, GQA and Dk != Dv, padding, windows, sinks and every score modifier, on small shapes.
fn cases() -> Vec<Case> {
    vec![
        Case::new(2, 33, 47, 4, 2, 40, 24)
            .causal()
            .kv_lens(&[47, 20]),
        Case::new(2, 17, 17, 4, 1, 24, 40)
            .q_lens(&[17, 5])
            .window(4, 2),
        Case::new(1, 9, 33, 6, 3, 16, 16).softcap(3.0).alibi(),
        Case::new(2, 7, 33, 4, 2, 16, 32).sinks(&[0.5, 1.0, -1.0, 2.0]),
        Case::new(2, 17, 29, 2, 2, 24, 24)
            .magnitude(2.0)
            .cosine(8.0)
            .key_clip(3.0)
            .causal(),
        Case::new(2, 13, 21, 4, 2, 24, 16).bias(BiasCase {
            batch: 2,
            heads: 4,
            learnable: true,
            masked_every: 4,
            strided: false,
        }),
        Case::new(2, 13, 21, 4, 2, 24, 24).relative(8, 16, true),
    ]
}

#[wasm_bindgen_test]
async fn attention_forward_matches_the_reference() {
    let mut ctx = context().await;
    for family in FAMILIES {
        ctx.set_kernel_family(Some(family));
        for case in cases() {
            let [q, k, v, _] = case.upload(&ctx);
            let buffers = case.buffers(&ctx);
            let fwd = attention_forward(&ctx, &q, &k, &v, &case.options(&buffers))
                .unwrap_or_else(|e| panic!("{}: {e}", case.label()));
            let (out, lse) = case.reference_forward();
            let tag = format!("[{}] forward {}", family.name(), case.label());
            let got = fwd.out.to_vec_async(&ctx).await.unwrap();
            check(
                &format!("{tag} out"),
                &got,
                &out,
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
            let got = fwd.lse.to_vec_async(&ctx).await.unwrap();
            assert_lse_close(&tag, &got, &lse, FORWARD_ATOL, FORWARD_RTOL);
        }
    }
}

#[wasm_bindgen_test]
async fn attention_backward_matches_the_reference() {
    let mut ctx = context().await;
    for family in FAMILIES {
        ctx.set_kernel_family(Some(family));
        for case in cases() {
            let [q, k, v, d_out] = case.upload(&ctx);
            let buffers = case.buffers(&ctx);
            let opts = case.options(&buffers);
            let fwd = attention_forward(&ctx, &q, &k, &v, &opts).unwrap();
            let grads = attention_backward(&ctx, &q, &k, &v, &fwd, &d_out, &opts)
                .unwrap_or_else(|e| panic!("{}: {e}", case.label()));
            let r = case.reference_backward();
            let tag = format!("[{}] backward {}", family.name(), case.label());
            let mut pairs = vec![
                ("dq", grads.dq.to_vec_async(&ctx).await.unwrap(), r.dq),
                ("dk", grads.dk.to_vec_async(&ctx).await.unwrap(), r.dk),
                ("dv", grads.dv.to_vec_async(&ctx).await.unwrap(), r.dv),
            ];
            if let Some(t) = &grads.d_sinks {
                pairs.push(("d_sinks", t.to_vec_async(&ctx).await.unwrap(), r.dsinks));
            }
            if let Some(t) = &grads.d_bias {
                pairs.push(("d_bias", t.to_vec_async(&ctx).await.unwrap(), r.dbias));
            }
            if let Some(t) = &grads.d_relative {
                pairs.push((
                    "d_relative",
                    t.to_vec_async(&ctx).await.unwrap(),
                    r.drelative,
                ));
            }
            for (name, gpu, reference) in &pairs {
                check(
                    &format!("{tag} {name}"),
                    gpu,
                    reference,
                    BACKWARD_ATOL,
                    BACKWARD_RTOL,
                );
            }
        }
    }
}

#[wasm_bindgen_test]
async fn decode_from_a_kv_cache_matches_the_reference() {
    let mut ctx = context().await;
    // Two new queries per sequence against a cache of capacity 40 holding 40 and 13 positions;
    // GQA, and a window with a causal mask aligned on each sequence's own length.
    let decode_cases = [
        Case::new(2, 2, 40, 4, 2, 32, 32)
            .q_lens(&[2, 1])
            .kv_lens(&[40, 13]),
        Case::new(2, 2, 40, 4, 1, 24, 16)
            .q_lens(&[2, 2])
            .kv_lens(&[21, 40])
            .causal()
            .window(8, 0)
            .softcap(5.0),
    ];
    for family in FAMILIES {
        ctx.set_kernel_family(Some(family));
        for case in &decode_cases {
            let (q, k, v, _) = case.data();
            let [qv, kv, vv, _] = case.upload(&ctx);
            let buffers = case.buffers(&ctx);
            let out = attention_decode(&ctx, &qv, &kv, &vv, &case.options(&buffers)).unwrap();
            let masks = Masks {
                q_lens: None,
                kv_lens: None,
                ..case.masks()
            };
            let (ref_out, _) = reference::attention_decode(
                &case.shape(),
                &to_f64(&q),
                &to_f64(&k),
                &to_f64(&v),
                case.q_lens.as_ref().unwrap(),
                case.kv_lens.as_ref().unwrap(),
                &masks,
            );
            // Query slots past a sequence's new count are not computed: compare the fed ones.
            let got = out.out.to_vec_async(&ctx).await.unwrap();
            let row = case.h * case.dv;
            let fed = |i: usize| {
                let (b, slot) = (i / row / case.lq, i / row % case.lq);
                slot < case.q_lens.as_ref().unwrap()[b] as usize
            };
            let gpu: Vec<f32> = (0..got.len()).filter(|&i| fed(i)).map(|i| got[i]).collect();
            let cpu: Vec<f64> = (0..got.len())
                .filter(|&i| fed(i))
                .map(|i| ref_out[i])
                .collect();
            check(
                &format!("[{}] decode {} out", family.name(), case.label()),
                &gpu,
                &cpu,
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
        }
    }
}

#[wasm_bindgen_test]
async fn additive_attention_matches_the_reference() {
    let mut ctx = context().await;
    let case = Case::new(2, 9, 13, 2, 2, 16, 8).causal().kv_lens(&[13, 6]);
    let (a, b, v, d_out) = case.data();
    let mut r = rng(case.seed + 100);
    let n = case.h * case.dk;
    let (w, bias) = (random(&mut r, n, 1.0), random(&mut r, n, 0.5));
    let masks = Masks {
        scale: 1.0,
        causal: case.causal,
        kv_lens: case.kv_lens.clone(),
        ..Default::default()
    };
    let shape = case.shape();
    let (a64, b64, v64) = (to_f64(&a), to_f64(&b), to_f64(&v));
    let (w64, bias64) = (to_f64(&w), to_f64(&bias));
    let scores64 = additive_reference::ScoreParams {
        w: &w64,
        bias: &bias64,
    };
    let (ref_out, _) =
        additive_reference::additive_forward(&shape, &a64, &b64, &v64, scores64, &masks);
    let g = additive_reference::additive_backward(
        &shape,
        &a64,
        &b64,
        &v64,
        scores64,
        &to_f64(&d_out),
        &masks,
    );
    for family in FAMILIES {
        ctx.set_kernel_family(Some(family));
        let [av, bv, vv, dov] = case.upload(&ctx);
        let buffers = case.buffers(&ctx);
        let wt = GpuTensor::from_slice(&ctx, &w, &[case.h, case.dk]).unwrap();
        let bt = GpuTensor::from_slice(&ctx, &bias, &[case.h, case.dk]).unwrap();
        let scores = AdditiveScores { w: &wt, bias: &bt };
        // Additive scores default to scale 1 (the score vector is learned).
        let opts = case.options(&buffers);
        let fwd = additive_forward(&ctx, &av, &bv, &vv, scores, &opts).unwrap();
        let out_heads = fwd.out.heads().unwrap();
        let grads = additive_backward(
            &ctx,
            &ForwardViews {
                q: &av,
                k: &bv,
                v: &vv,
                out: &out_heads,
                lse: &fwd.lse,
            },
            scores,
            &dov,
            &opts,
        )
        .unwrap();
        let tag = format!("[{}] additive {}", family.name(), case.label());
        let out = fwd.out.to_vec_async(&ctx).await.unwrap();
        check(
            &format!("{tag} out"),
            &out,
            &ref_out,
            FORWARD_ATOL,
            FORWARD_RTOL,
        );
        for (name, gpu, reference) in [
            ("da", grads.da.to_vec_async(&ctx).await.unwrap(), &g.da),
            ("db", grads.db.to_vec_async(&ctx).await.unwrap(), &g.db),
            ("dv", grads.dv.to_vec_async(&ctx).await.unwrap(), &g.dv),
            ("dw", grads.dw.to_vec_async(&ctx).await.unwrap(), &g.dw),
            (
                "dbias",
                grads.dbias.to_vec_async(&ctx).await.unwrap(),
                &g.dbias,
            ),
        ] {
            check(
                &format!("{tag} {name}"),
                &gpu,
                reference,
                BACKWARD_ATOL,
                BACKWARD_RTOL,
            );
        }
    }
}

const SHAPE: BatchShape = BatchShape {
    batch: 2,
    src_len: 5,
    tgt_len: 4,
};

#[wasm_bindgen_test]
async fn a_transformer_training_step_matches_the_reference() {
    let mut ctx = context().await;
    let config = TransformerConfig::default()
        .vocab(9)
        .d_model(16)
        .heads(2)
        .d_ff(24)
        .encoder_layers(1)
        .decoder_layers(1)
        .pre_ln(true);
    let batch = Batch {
        src: vec![3, 4, 5, 6, 7, 8, 3, 0, 0, 0],
        src_lens: vec![5, 2],
        tgt_in: vec![1, 7, 6, 5, 1, 3, 0, 0],
        tgt_out: vec![7, 6, 5, 4, 3, 8, 0, 0],
        tgt_lens: vec![4, 2],
    };
    let adam = AdamWConfig::default().lr(1e-2);
    for family in FAMILIES {
        ctx.set_kernel_family(Some(family));
        let model = Transformer::new(&ctx, config, SHAPE, 3).unwrap();
        let mut trainer = Trainer::new(&ctx, model, adam).unwrap();
        let names = trainer.model.params.names().to_vec();
        let mut before = Vec::new();
        for t in trainer.model.params.values() {
            before.push(to_f64(&t.to_vec_async(&ctx).await.unwrap()));
        }
        let params = names.iter().cloned().zip(before.iter().cloned()).collect();
        let cpu = transformer_reference::forward_backward(&config, &SHAPE, &params, &batch);

        trainer.step(&ctx, &batch).unwrap();
        trainer.check_finite_async(&ctx).await.unwrap();
        let tag = format!("[{}] training step", family.name());
        let loss = trainer.model.loss().to_vec_async(&ctx).await.unwrap();
        check(
            &format!("{tag} loss"),
            &loss[..1],
            &[cpu.loss],
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
        // The step's gradients against the CPU model's; the update against the reference AdamW
        // applied to the GPU's own gradients (AdamW's first step is about lr * sign(g), which a
        // rounding-level difference in a near-zero gradient would flip).
        let mut grads = Vec::new();
        for (name, t) in names.iter().zip(trainer.model.params.grads()) {
            let g = t.to_vec_async(&ctx).await.unwrap();
            check(
                &format!("{tag} d {name}"),
                &g,
                &cpu.grads[name],
                BACKWARD_ATOL,
                BACKWARD_RTOL,
            );
            grads.push(to_f64(&g));
        }
        let mut expected = before.clone();
        let (mut m, mut v): (Vec<_>, Vec<_>) = before
            .iter()
            .map(|p| (vec![0.0; p.len()], vec![0.0; p.len()]))
            .unzip();
        wgpu_attention::reference::optimizer::adamw_step(
            &adam,
            1,
            &mut expected,
            &grads,
            &mut m,
            &mut v,
        );
        for ((name, t), reference) in names
            .iter()
            .zip(trainer.model.params.values())
            .zip(&expected)
        {
            let after = t.to_vec_async(&ctx).await.unwrap();
            check(
                &format!("{tag} updated {name}"),
                &after,
                reference,
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
        }
    }
}

#[wasm_bindgen_test]
async fn greedy_generation_from_the_kv_cache_matches_the_reference_model() {
    let mut ctx = context().await;
    const VOCAB: usize = 13;
    let config = TransformerConfig::default()
        .vocab(VOCAB)
        .d_model(16)
        .heads(2)
        .d_ff(24)
        .encoder_layers(0)
        .decoder_layers(2)
        .pre_ln(true);
    let shape = BatchShape {
        batch: 2,
        src_len: 0,
        tgt_len: 8,
    };
    let prompts = vec![vec![3u32, 7, 5], vec![9u32]];
    for family in FAMILIES {
        ctx.set_kernel_family(Some(family));
        let model = Transformer::new(&ctx, config, shape, 5).unwrap();
        let generator_shape = GeneratorShape {
            batch: 2,
            capacity: 8,
            prefill_chunk: 2,
            src_len: 0,
        };
        let mut generator = Generator::new(&ctx, &model, generator_shape).unwrap();
        let options = GenerateOptions::default()
            .max_new_tokens(4)
            .sampling(Sampling::greedy())
            .stop(None);
        let out = generator
            .generate_async(&ctx, &prompts, None, &options)
            .await
            .unwrap();
        // Each token is (within rounding) the arg max of the f64 model's logits over the prompt
        // and the tokens before it.
        let mut params = std::collections::HashMap::new();
        for (name, t) in model.params.names().iter().zip(model.params.values()) {
            params.insert(name.clone(), to_f64(&t.to_vec_async(&ctx).await.unwrap()));
        }
        let mut batch = Batch::default();
        for (p, t) in prompts.iter().zip(&out.tokens) {
            let mut whole: Vec<u32> = p.iter().chain(t).copied().collect();
            batch.tgt_lens.push(whole.len() as u32);
            whole.resize(shape.tgt_len, 0);
            batch.tgt_in.extend(&whole);
        }
        batch.tgt_out = vec![0; shape.batch * shape.tgt_len];
        let (logits, _) = transformer_reference::forward(&config, &shape, &params, &batch);
        for (b, p) in prompts.iter().enumerate() {
            assert_eq!(out.tokens[b].len(), 4);
            for (k, &token) in out.tokens[b].iter().enumerate() {
                let row = &logits[(b * shape.tgt_len + p.len() - 1 + k) * VOCAB..][..VOCAB];
                let best = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                assert!(
                    best - row[token as usize] <= 1e-4,
                    "[{}] sequence {b} token {k}: {token} scores {} against the best {best}",
                    family.name(),
                    row[token as usize]
                );
            }
        }
        console_log!(
            "[{}] greedy generation: {:?}, every token the reference model's arg max",
            family.name(),
            out.tokens
        );
    }
}

#[wasm_bindgen_test]
async fn blocking_calls_are_a_typed_error_not_a_panic() {
    let ctx = context().await;
    let t = GpuTensor::from_slice(&ctx, &[1.0, 2.0], &[2]).unwrap();
    let e = t.to_vec(&ctx).unwrap_err();
    assert!(
        matches!(
            e,
            Error::WouldBlock {
                call: "GpuTensor::to_vec"
            }
        ),
        "{e}"
    );
    let e = Context::new().unwrap_err();
    assert!(
        matches!(
            e,
            Error::WouldBlock {
                call: "Context::new"
            }
        ),
        "{e}"
    );
    // A call that waits for nothing completes: recording and submitting never block.
    attention_forward(
        &ctx,
        &t.reshape(&[1, 1, 1, 2]).unwrap().heads().unwrap(),
        &t.reshape(&[1, 1, 1, 2]).unwrap().heads().unwrap(),
        &t.reshape(&[1, 1, 1, 2]).unwrap().heads().unwrap(),
        &AttentionOptions::new(),
    )
    .unwrap();
    // The async form still reads what the refused call would have.
    assert_eq!(t.to_vec_async(&ctx).await.unwrap(), [1.0, 2.0]);
}
