//! The pieces of decoding from a cache, each against its f64 reference on every back end: the
//! key/value cache append (from a strided view inside a packed projection, sequences of different
//! lengths), rotary embeddings and additive positions at per-sequence positions after the cache,
//! and typed errors.

mod common;

use common::*;
use wgpu_attention::kernels::embedding::{positional_forward_cached_into, sinusoidal_table};
use wgpu_attention::kernels::kv_cache::kv_cache_append_into;
use wgpu_attention::kernels::rope::{rope_forward_cached_into, RopeLayout, RopeTable};
use wgpu_attention::reference::{embedding, kv_cache, rope};
use wgpu_attention::{Context, GpuTensor, HeadsView, SeqLens};

/// New tokens per sequence and cached tokens including them, for a batch of three.
const Q_LENS: [u32; 3] = [2, 0, 3];
const KV_LENS: [u32; 3] = [9, 4, 3];

fn submit(ctx: &Context, record: impl FnOnce(&mut wgpu::CommandEncoder)) {
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    record(&mut encoder);
    ctx.queue().submit([encoder.finish()]);
}

#[test]
fn append_copies_new_rows_after_each_sequence() {
    let ([b, l, h, d], max_len) = ([3, 3, 2, 5], 10);
    for_each_backend(|name, ctx| {
        let mut r = rng(3);
        // The V columns of a packed [B, L, 3 * H * D] projection: a strided view.
        let proj = random(&mut r, b * l * 3 * h * d, 1.0);
        let proj_t = GpuTensor::from_slice(ctx, &proj, &[b, l, 3 * h * d]).unwrap();
        let view = proj_t.split_heads(2 * h * d, h, d).unwrap();
        let before = random(&mut r, b * max_len * h * d, 1.0);
        let cache = GpuTensor::from_slice(ctx, &before, &[b, max_len, h, d]).unwrap();
        let lens = SeqLens::new(ctx, Some(&Q_LENS), Some(&KV_LENS)).unwrap();
        submit(ctx, |e| {
            kv_cache_append_into(ctx, e, &view, &cache, &lens).unwrap()
        });
        let new = view.to_vec(ctx).unwrap();
        let mut expected = to_f64(&before);
        kv_cache::kv_cache_append(
            &mut expected,
            max_len,
            &to_f64(&new),
            [b, l, h, d],
            &Q_LENS,
            &KV_LENS,
        );
        // A copy: exact.
        let got = cache.to_vec(ctx).unwrap();
        let wrong = got.iter().zip(&expected).position(|(&g, &e)| g as f64 != e);
        assert_eq!(wrong, None, "[{name}] kv cache differs at {wrong:?}");

        // Bad lengths are typed errors and record nothing.
        for (q, kv, needle) in [
            ([2, 0, 4], [9, 4, 3], "q_lens"),
            ([2, 0, 3], [11, 4, 3], "capacity"),
            ([4, 0, 3], [9, 4, 4], "slots"),
        ] {
            let bad = SeqLens::new(ctx, Some(&q), Some(&kv)).unwrap();
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            let e = kv_cache_append_into(ctx, &mut encoder, &view, &cache, &bad).unwrap_err();
            assert!(e.to_string().contains(needle), "[{name}] {e}");
        }
        let only_new = SeqLens::new(ctx, Some(&Q_LENS), None).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let e = kv_cache_append_into(ctx, &mut encoder, &view, &cache, &only_new).unwrap_err();
        assert!(e.to_string().contains("kv_lens"), "[{name}] {e}");
        let wrong = GpuTensor::zeros(ctx, &[b, max_len, h, d + 1]).unwrap();
        let e = kv_cache_append_into(ctx, &mut encoder, &view, &wrong, &lens).unwrap_err();
        assert!(e.to_string().contains("cache"), "[{name}] {e}");
    });
}

#[test]
fn rope_and_positions_follow_each_sequence_after_its_cache() {
    let ([b, l, h, d], max_len) = ([3, 3, 2, 8], 12);
    for_each_backend(|name, ctx| {
        let mut r = rng(5);
        let x = random(&mut r, b * l * h * d, 1.0);
        let lens = SeqLens::new(ctx, Some(&Q_LENS), Some(&KV_LENS)).unwrap();
        let table = RopeTable::new(ctx, 10000.0, d, RopeLayout::Half, max_len).unwrap();
        let view: HeadsView = upload(ctx, &x, [b, l, h, d]);
        submit(ctx, |e| {
            rope_forward_cached_into(ctx, e, &view, &table, &lens).unwrap()
        });
        let got = view.to_vec(ctx).unwrap();
        // Each sequence is a reference rotation from its own offset; only its new rows are compared
        // (the rest are padding).
        for bi in 0..b {
            let n = Q_LENS[bi] as usize;
            if n == 0 {
                continue;
            }
            let rows = &x[bi * l * h * d..][..n * h * d];
            let offset = (KV_LENS[bi] - Q_LENS[bi]) as usize;
            let expected = rope::rope(
                &to_f64(rows),
                [1, n, h, d],
                10000.0,
                d,
                RopeLayout::Half,
                offset,
                1.0,
            );
            let got_rows = &got[bi * l * h * d..][..n * h * d];
            assert_close(
                &format!("[{name}] rope seq {bi}"),
                got_rows,
                &expected,
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
        }

        let dim = h * d;
        let xt = GpuTensor::from_slice(ctx, &x, &[b, l, dim]).unwrap();
        let pos = sinusoidal_table(max_len, dim);
        let pos_t = GpuTensor::from_slice(ctx, &pos, &[max_len, dim]).unwrap();
        let y = GpuTensor::zeros(ctx, &[b, l, dim]).unwrap();
        submit(ctx, |e| {
            positional_forward_cached_into(ctx, e, &xt, &pos_t, &y, &lens).unwrap()
        });
        let expected = embedding::positional_forward_cached(
            &to_f64(&x),
            &to_f64(&pos),
            [b, l, dim],
            &Q_LENS,
            &KV_LENS,
        );
        assert_close(
            &format!("[{name}] positions"),
            &y.to_vec(ctx).unwrap(),
            &expected,
            FORWARD_ATOL,
            FORWARD_RTOL,
        );

        // Positions past the tables are typed errors.
        let far = SeqLens::new(ctx, Some(&Q_LENS), Some(&[13, 4, 3])).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let e = rope_forward_cached_into(ctx, &mut encoder, &view, &table, &far).unwrap_err();
        assert!(e.to_string().contains("capacity 12"), "[{name}] {e}");
        let e =
            positional_forward_cached_into(ctx, &mut encoder, &xt, &pos_t, &y, &far).unwrap_err();
        assert!(e.to_string().contains("capacity 12"), "[{name}] {e}");
    });
}
