//! Ahead-of-time compilation of a model's steps: `Trainer::precompile` and `Generator::precompile`
//! build every pipeline the real calls then use (those compile nothing) and change no state.

use crate::common;

use common::*;
use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::kernels::sampling::Sampling;
use wgpu_attention_serve::{CacheLayout, GenerateOptions, Generator, GeneratorShape};
use wgpu_attention_transformer::model::transformer::{
    Batch, BatchShape, Transformer, TransformerConfig,
};
use wgpu_attention_transformer::training::Trainer;

fn model_config() -> TransformerConfig {
    TransformerConfig::default()
        .vocab(9)
        .d_model(16)
        .heads(2)
        .d_ff(24)
        .encoder_layers(1)
        .decoder_layers(1)
        .pre_ln(true)
        .attention_sinks(true)
}

#[test]
fn trainer_and_generator_precompile_their_steps_and_change_nothing() {
    let shape = BatchShape {
        batch: 2,
        src_len: 5,
        tgt_len: 4,
    };
    let batch = Batch {
        src: vec![3, 4, 5, 6, 7, 8, 3, 0, 0, 0],
        src_lens: vec![5, 2],
        tgt_in: vec![1, 7, 6, 5, 1, 3, 0, 0],
        tgt_out: vec![7, 6, 5, 4, 3, 8, 0, 0],
        tgt_lens: vec![4, 2],
    };
    let adam = AdamWConfig::default().lr(1e-2);
    for_each_backend(|name, shared| {
        // Two fresh contexts: one trains after precompiling, one without; the steps agree bitwise.
        let trained = [true, false].map(|precompile| {
            let ctx = fresh_context(name, shared);
            let model = Transformer::new(&ctx, model_config(), shape, 3).unwrap();
            let mut trainer = Trainer::new(&ctx, model, adam).unwrap();
            if precompile {
                let built = trainer.precompile(&ctx).unwrap();
                assert!(built > 0 && built == ctx.cached_pipelines(), "{name}");
                assert_eq!(trainer.optimizer.steps(), 0, "{name}");
            }
            let compiled = ctx.cached_pipelines();
            trainer.step(&ctx, &batch).unwrap();
            trainer.step(&ctx, &batch).unwrap();
            if precompile {
                assert_eq!(ctx.cached_pipelines(), compiled, "{name}: a step compiled");
            }
            trainer.model.loss().to_vec(&ctx).unwrap()
        });
        assert_eq!(
            trained[0], trained[1],
            "{name}: precompile changed training"
        );

        let paged = CacheLayout::Paged {
            page: 4,
            pool_blocks: 6,
        };
        for layout in [CacheLayout::Contiguous, paged] {
            let generated = [true, false].map(|precompile| {
                let ctx = fresh_context(name, shared);
                let config = model_config().encoder_layers(0).rope_base(Some(10000.0));
                let model = Transformer::new(&ctx, config, shape, 3).unwrap();
                let gen_shape = GeneratorShape {
                    batch: 2,
                    capacity: 12,
                    prefill_chunk: 3,
                    src_len: 0,
                };
                let mut generator =
                    Generator::with_layout(&ctx, &model, gen_shape, layout).unwrap();
                let sampling = Sampling::greedy();
                if precompile {
                    assert!(generator.precompile(&ctx, &sampling).unwrap() > 0, "{name}");
                }
                let compiled = ctx.cached_pipelines();
                let options = GenerateOptions::default()
                    .max_new_tokens(4)
                    .sampling(sampling)
                    .stop(None);
                let out = generator
                    .generate(&ctx, &[vec![1, 2, 3, 4], vec![5]], None, &options)
                    .unwrap();
                if precompile {
                    assert_eq!(
                        ctx.cached_pipelines(),
                        compiled,
                        "{name} {layout:?}: decoding compiled"
                    );
                }
                out.tokens
            });
            assert_eq!(
                generated[0], generated[1],
                "{name} {layout:?}: precompile changed decoding"
            );
        }
    });
}
