//! The pieces of decoding from a cache, each against its f64 reference on every back end: the
//! key/value cache append (from a strided view inside a packed projection, sequences of different
//! lengths; f32, int8 and f16), rotary embeddings and additive positions at per-sequence positions
//! after the cache, and typed errors.

use crate::common;

use common::*;
use wgpu_attention::kernels::embedding::{positional_forward_cached_into, sinusoidal_table};
use wgpu_attention::kernels::kv_cache::{
    kv_cache_append_f16_into, kv_cache_append_int8_into, kv_cache_append_into,
    kv_cache_gather_f16_into,
};
use wgpu_attention::kernels::rope::{rope_forward_cached_into, RopeLayout, RopeTable};
use wgpu_attention::reference::{embedding, kv_cache, rope};
use wgpu_attention::{Context, GpuTensor, GpuTensorF16, GpuTensorQ8, HeadsView, SeqLens};

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
fn int8_append_quantises_each_new_row_after_its_cache() {
    let ([b, l, h, d], max_len) = ([3, 3, 2, 8], 10);
    let words = d / 4 + 1;
    for_each_backend(|name, ctx| {
        let mut r = rng(5);
        let mut proj = random(&mut r, b * l * 3 * h * d, 2.0);
        // Sequence 0, new row 1, head 1 of the V columns holds a NaN: its scale is stored NaN.
        proj[3 * h * d + 2 * h * d + d + 3] = f32::NAN;
        let proj_t = GpuTensor::from_slice(ctx, &proj, &[b, l, 3 * h * d]).unwrap();
        let view = proj_t.split_heads(2 * h * d, h, d).unwrap();
        let before = random(&mut r, b * max_len * h * d, 1.0);
        let cache = GpuTensorQ8::from_f32(ctx, &before, &[b, max_len, h, d]).unwrap();
        let old = cache.to_words(ctx).unwrap();
        let lens = SeqLens::new(ctx, Some(&Q_LENS), Some(&KV_LENS)).unwrap();
        submit(ctx, |e| {
            kv_cache_append_int8_into(ctx, e, &view, &cache, None, &lens).unwrap()
        });
        // The reference quantises the new rows and places their words as the f32 append places
        // values (words are exact in f64).
        let new = kv_cache::quantize_int8_rows(&to_f64(&view.to_vec(ctx).unwrap()), d);
        let as_f64 = |w: &[u32]| w.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let mut expected = as_f64(&old);
        kv_cache::kv_cache_append(
            &mut expected,
            max_len,
            &as_f64(&new),
            [b, l, h, words],
            &Q_LENS,
            &KV_LENS,
        );
        let got = cache.to_words(ctx).unwrap();
        let mut nan_rows = 0;
        for (row, (g, e)) in got.chunks(words).zip(expected.chunks(words)).enumerate() {
            let (gs, es) = (f32::from_bits(g[d / 4]), f32::from_bits(e[d / 4] as u32));
            nan_rows += gs.is_nan() as usize;
            // Scales are max |x|: exact (NaN for the row holding a NaN).
            assert!(
                gs == es || (gs.is_nan() && es.is_nan()),
                "[{name}] row {row}: scale {gs} != {es}"
            );
            // Values round x / s: a reciprocal on the GPU may move a tie by one step.
            for (gw, ew) in g[..d / 4].iter().zip(&e[..d / 4]) {
                for i in 0..4 {
                    let (gq, eq) = (
                        (gw >> (8 * i)) as u8 as i8,
                        ((*ew as u32) >> (8 * i)) as u8 as i8,
                    );
                    assert!(
                        (gq as i32 - eq as i32).abs() <= 1,
                        "[{name}] row {row}: int8 {gq} != {eq}"
                    );
                }
            }
        }
        assert_eq!(nan_rows, 1, "[{name}] the NaN row's scale");
    });
}

/// The f16 append rounds each new value to nearest even, placed as the f32 append places it (the
/// halves compared bitwise with the `half` crate's rounding; a NaN stays NaN, values beyond f16's
/// range become infinities), and the f16 gather widens exactly what the cache holds, zeros past
/// each sequence's length.
#[test]
fn f16_append_rounds_each_new_value_after_its_cache() {
    let ([b, l, h, d], max_len) = ([3, 3, 2, 8], 10);
    for_each_backend(|name, ctx| {
        let mut r = rng(7);
        let mut proj = random(&mut r, b * l * 3 * h * d, 2.0);
        proj[3 * h * d + 2 * h * d + d + 3] = f32::NAN;
        proj[3 * h * d + 2 * h * d + d + 4] = 1e6;
        let proj_t = GpuTensor::from_slice(ctx, &proj, &[b, l, 3 * h * d]).unwrap();
        let view = proj_t.split_heads(2 * h * d, h, d).unwrap();
        let before = random(&mut r, b * max_len * h * d, 1.0);
        let cache = GpuTensorF16::from_f32(ctx, &before, &[b, max_len, h, d]).unwrap();
        let lens = SeqLens::new(ctx, Some(&Q_LENS), Some(&KV_LENS)).unwrap();
        submit(ctx, |e| {
            kv_cache_append_f16_into(ctx, e, &view, &cache, None, &lens).unwrap()
        });
        let half = |x: f32| half::f16::from_f32(x).to_f64();
        let new: Vec<f64> = view.to_vec(ctx).unwrap().into_iter().map(half).collect();
        let mut expected: Vec<f64> = before.iter().map(|&x| half(x)).collect();
        kv_cache::kv_cache_append(
            &mut expected,
            max_len,
            &new,
            [b, l, h, d],
            &Q_LENS,
            &KV_LENS,
        );
        let got = cache.to_vec(ctx).unwrap();
        for (i, (&g, &e)) in got.iter().zip(&expected).enumerate() {
            assert!(
                g as f64 == e || (g.is_nan() && e.is_nan()),
                "[{name}] value {i}: {g} != {e}"
            );
        }
        assert_eq!(
            got.iter().filter(|x| x.is_nan()).count(),
            1,
            "[{name}] the NaN"
        );
        assert_eq!(
            got.iter().filter(|x| x.is_infinite()).count(),
            1,
            "[{name}] 1e6"
        );
        // The gather: each sequence's first 9 positions widened, zeros past its kv_len.
        let rows = 9;
        let out = GpuTensor::zeros(ctx, &[b, rows, h, d]).unwrap();
        submit(ctx, |e| {
            kv_cache_gather_f16_into(ctx, e, &cache, None, &lens, rows, &out).unwrap()
        });
        let gathered = out.to_vec(ctx).unwrap();
        for (i, &g) in gathered.iter().enumerate() {
            let (seq, pos) = (i / (rows * h * d), i / (h * d) % rows);
            let want = match pos < KV_LENS[seq] as usize {
                true => got[(seq * max_len + pos) * h * d + i % (h * d)],
                false => 0.0,
            };
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "[{name}] gathered {i}: {g} != {want}"
            );
        }
        // Head dims that are no multiple of 4 are refused.
        let odd = GpuTensorF16::zeros(ctx, &[b, max_len, h, 6]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let e = kv_cache_append_f16_into(ctx, &mut encoder, &view, &odd, None, &lens).unwrap_err();
        assert!(e.to_string().contains("multiple of 4"), "[{name}] {e}");
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
