//! Attention maps of a whole model's forward (every site: encoder self, decoder self, cross), their
//! masks and normalisation, gradient-times-attention after a backward, and attention rollout on
//! hand-computed cases.

use crate::common;

use common::{for_each_backend, rng};
use rand::Rng;
use wgpu_attention_transformer::model::{
    attention_rollout, AttentionSite, Batch, BatchShape, Transformer, TransformerConfig,
};

const SHAPE: BatchShape = BatchShape {
    batch: 2,
    src_len: 6,
    tgt_len: 5,
};

fn config() -> TransformerConfig {
    TransformerConfig::default()
        .vocab(9)
        .d_model(16)
        .heads(2)
        .d_ff(24)
        .encoder_layers(2)
        .decoder_layers(2)
        .pre_ln(true)
}

#[test]
fn model_maps_are_masked_distributions() {
    let (src_lens, tgt_lens) = ([6u32, 4], [5u32, 3]);
    for_each_backend(|name, ctx| {
        let mut model = Transformer::new(ctx, config(), SHAPE, 3).unwrap();
        let mut r = rng(4);
        let mut ids = |n: usize| (0..n).map(|_| r.random_range(1..9u32)).collect::<Vec<_>>();
        let batch = Batch {
            src: ids(2 * 6),
            src_lens: src_lens.to_vec(),
            tgt_in: ids(2 * 5),
            tgt_out: ids(2 * 5),
            tgt_lens: tgt_lens.to_vec(),
        };
        model.set_batch(ctx, &batch).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        model.forward(ctx, &mut encoder).unwrap();
        model.backward(ctx, &mut encoder).unwrap();
        ctx.queue().submit([encoder.finish()]);
        for (site, q_lens, kv_lens, causal) in [
            (AttentionSite::EncoderSelf(1), src_lens, src_lens, false),
            (AttentionSite::DecoderSelf(0), tgt_lens, tgt_lens, true),
            (AttentionSite::DecoderCross(1), tgt_lens, src_lens, false),
        ] {
            let map = model.attention_map(ctx, site).unwrap();
            let [b, h, lq, lk] = map.shape().try_into().unwrap();
            assert_eq!([b, h], [2, 2]);
            let p = map.to_vec(ctx).unwrap();
            let g = model.gradient_times_attention(ctx, site).unwrap();
            for bi in 0..b {
                for hi in 0..h {
                    for i in 0..lq {
                        let row = &p[((bi * h + hi) * lq + i) * lk..][..lk];
                        let valid = i < q_lens[bi] as usize;
                        let sum: f32 = row.iter().sum();
                        assert!(
                            !valid || (sum - 1.0).abs() < 1e-5,
                            "[{name}] {site:?} row sum {sum}"
                        );
                        for (j, &x) in row.iter().enumerate() {
                            let visible = valid && j < kv_lens[bi] as usize && (!causal || j <= i);
                            assert!(
                                visible || x == 0.0,
                                "[{name}] {site:?} b{bi} h{hi} ({i}, {j}) = {x}"
                            );
                            let gx = g[((bi * h + hi) * lq + i) * lk + j];
                            assert!(
                                gx.is_finite() && (x != 0.0 || gx == 0.0),
                                "[{name}] {site:?} grad x attention ({i}, {j}) = {gx}"
                            );
                        }
                    }
                }
            }
        }
        let e = model
            .attention_map(ctx, AttentionSite::DecoderCross(2))
            .unwrap_err();
        assert!(e.to_string().contains("DecoderCross(2)"), "[{name}] {e}");
    });
}

#[test]
fn additive_layers_have_maps_too() {
    for_each_backend(|name, ctx| {
        let c = config().additive_attention(Some(3));
        let mut model = Transformer::new(ctx, c, SHAPE, 3).unwrap();
        let batch = Batch {
            src: vec![1; 12],
            src_lens: vec![6, 4],
            tgt_in: vec![2; 10],
            tgt_out: vec![3; 10],
            tgt_lens: vec![5, 3],
        };
        model.set_batch(ctx, &batch).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        model.forward(ctx, &mut encoder).unwrap();
        ctx.queue().submit([encoder.finish()]);
        let p = model
            .attention_map(ctx, AttentionSite::DecoderSelf(1))
            .unwrap()
            .to_vec(ctx)
            .unwrap();
        // Causal rows of valid queries sum to 1; padded rows are 0.
        for (row, chunk) in p.chunks(5).enumerate() {
            let (b, i) = (row / 10, row % 5);
            let sum: f32 = chunk.iter().sum();
            let valid = i < [5, 3][b];
            assert!(
                if valid {
                    (sum - 1.0).abs() < 1e-5
                } else {
                    sum == 0.0
                },
                "[{name}] row {row} sums to {sum}"
            );
            assert!(
                chunk[i + 1..].iter().all(|&x| x == 0.0),
                "[{name}] row {row} sees the future"
            );
        }
    });
}

#[test]
fn rollout_matches_hand_computation() {
    // One head, two positions: P = [[1, 0], [0.5, 0.5]] -> A = (P + I) / 2 = [[1, 0], [0.25, 0.75]].
    let p = vec![1.0f32, 0.0, 0.5, 0.5];
    let one = attention_rollout(std::slice::from_ref(&p), [1, 1, 2]).unwrap();
    assert_eq!(one, vec![1.0, 0.0, 0.25, 0.75]);
    // Two layers: A^2 = [[1, 0], [0.25 + 0.1875, 0.5625]].
    let two = attention_rollout(&[p.clone(), p.clone()], [1, 1, 2]).unwrap();
    let expected = [1.0, 0.0, 0.4375, 0.5625];
    assert!(
        two.iter().zip(expected).all(|(a, b)| (a - b).abs() < 1e-12),
        "{two:?}"
    );
    // Heads are averaged before mixing in the identity: heads [[0, 1], [1, 0]] and [[1, 0], [0, 1]]
    // average to 0.5 everywhere -> A = [[0.75, 0.25], [0.25, 0.75]].
    let heads = vec![0.0f32, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0];
    let avg = attention_rollout(&[heads], [1, 2, 2]).unwrap();
    assert_eq!(avg, vec![0.75, 0.25, 0.25, 0.75]);
    assert!(attention_rollout(&[vec![0.0; 3]], [1, 1, 2]).is_err());
}
