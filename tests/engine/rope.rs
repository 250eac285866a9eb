//! Rotary position embeddings on the GPU vs the f64 reference (both layouts, partial rotary, a
//! strided view inside a packed QKV buffer, position offsets, a long-position table), the backward
//! (in place, the inverse rotation) likewise, frequency scaling (linear, LLaMA 3), the reference
//! against finite differences, and typed errors.

use crate::common;

use common::*;
use wgpu_attention::kernels::rope::{
    rope_backward_into, rope_forward_into, RopeLayout, RopeScaling, RopeTable,
};
use wgpu_attention::reference::rope as reference;
use wgpu_attention::{Context, Error, GpuTensor, HeadsView};

struct Case {
    shape: [usize; 4],
    rotary_dim: usize,
    layout: RopeLayout,
    offset: usize,
    max_positions: usize,
}

fn run(ctx: &Context, c: &Case, view: &HeadsView, backward: bool) -> Vec<f32> {
    let table = RopeTable::new(ctx, 10000.0, c.rotary_dim, c.layout, c.max_positions).unwrap();
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    match backward {
        false => rope_forward_into(ctx, &mut encoder, view, &table, c.offset),
        true => rope_backward_into(ctx, &mut encoder, view, &table, c.offset),
    }
    .unwrap();
    ctx.queue().submit([encoder.finish()]);
    view.to_vec(ctx).unwrap()
}

#[test]
fn rotation_and_its_backward_match_reference() {
    let cases = [
        // Half layout (LLaMA), full rotary, odd sizes.
        Case {
            shape: [2, 7, 3, 8],
            rotary_dim: 8,
            layout: RopeLayout::Half,
            offset: 0,
            max_positions: 7,
        },
        // Interleaved (GPT-J), partial rotary (6 of 10 dims), an offset (decoding).
        Case {
            shape: [1, 5, 2, 10],
            rotary_dim: 6,
            layout: RopeLayout::Interleaved,
            offset: 11,
            max_positions: 16,
        },
        // Positions near 100000: the f64 table keeps the angles exact where an f32 p * theta would
        // be off by 1e-2 rad.
        Case {
            shape: [1, 4, 2, 64],
            rotary_dim: 64,
            layout: RopeLayout::Half,
            offset: 99_990,
            max_positions: 100_000,
        },
    ];
    for_each_backend(|backend, ctx| {
        for (n, c) in cases.iter().enumerate() {
            let [b, l, h, d] = c.shape;
            let mut r = rng(40 + n as u64);
            let x = random(&mut r, b * l * h * d, 1.0);
            let x64 = to_f64(&x);
            for backward in [false, true] {
                let sign = if backward { -1.0 } else { 1.0 };
                let expected = reference::rope(
                    &x64,
                    c.shape,
                    10000.0,
                    c.rotary_dim,
                    c.layout,
                    c.offset,
                    sign,
                );
                let view = upload(ctx, &x, c.shape);
                let got = run(ctx, c, &view, backward);
                let what = format!(
                    "[{backend}] rope {} {:?} rotary {} offset {}",
                    if backward { "backward" } else { "forward" },
                    c.shape,
                    c.rotary_dim,
                    c.offset
                );
                assert_close(&what, &got, &expected, FORWARD_ATOL, FORWARD_RTOL);
                // Dims past rotary_dim are untouched, bit for bit.
                for (i, (g, x)) in got.iter().zip(&x).enumerate() {
                    if i % d >= c.rotary_dim {
                        assert_eq!(g, x, "{what}: dim {} changed", i % d);
                    }
                }
            }
        }
        // Q and K rotated where they lie in a packed [B, L, 3 * H * D] projection; V untouched.
        let (b, l, h, d) = (2, 5, 2, 8);
        let mut r = rng(77);
        let packed = random(&mut r, b * l * 3 * h * d, 1.0);
        let t = GpuTensor::from_slice(ctx, &packed, &[b, l, 3 * h * d]).unwrap();
        let c = Case {
            shape: [b, l, h, d],
            rotary_dim: d,
            layout: RopeLayout::Half,
            offset: 3,
            max_positions: 8,
        };
        let table = RopeTable::new(ctx, 10000.0, d, c.layout, c.max_positions).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        for column in [0, h * d] {
            let view = t.split_heads(column, h, d).unwrap();
            rope_forward_into(ctx, &mut encoder, &view, &table, c.offset).unwrap();
        }
        ctx.queue().submit([encoder.finish()]);
        let got = t.to_vec(ctx).unwrap();
        for (part, column) in [(0, 0), (1, h * d), (2, 2 * h * d)] {
            let slice = |v: &[f32]| -> Vec<f32> {
                v.chunks(3 * h * d)
                    .flat_map(|row| row[column..column + h * d].to_vec())
                    .collect()
            };
            let input = to_f64(&slice(&packed));
            let expected = match part {
                2 => input,
                _ => reference::rope(&input, c.shape, 10000.0, d, c.layout, c.offset, 1.0),
            };
            assert_close(
                &format!("[{backend}] packed part {part}"),
                &slice(&got),
                &expected,
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
        }
    });
}

#[test]
fn reference_backward_matches_finite_differences() {
    // L = <dy, rope(x)>: its gradient is rope's backward applied to dy.
    let shape = [1, 4, 2, 6];
    let n: usize = shape.iter().product();
    let mut r = rng(5);
    let x = to_f64(&random(&mut r, n, 1.0));
    let dy = to_f64(&random(&mut r, n, 1.0));
    for layout in [RopeLayout::Interleaved, RopeLayout::Half] {
        let loss = |x: &[f64]| -> f64 {
            let y = reference::rope(x, shape, 100.0, 4, layout, 2, 1.0);
            y.iter().zip(&dy).map(|(a, b)| a * b).sum()
        };
        let analytic = reference::rope(&dy, shape, 100.0, 4, layout, 2, -1.0);
        let mut worst = 0.0f64;
        for i in 0..n {
            let (mut plus, mut minus) = (x.clone(), x.clone());
            plus[i] += 1e-6;
            minus[i] -= 1e-6;
            let numeric = (loss(&plus) - loss(&minus)) / 2e-6;
            worst = worst.max((analytic[i] - numeric).abs() / numeric.abs().max(1.0));
        }
        println!(
            "rope {layout:?} backward vs finite differences: worst relative error {worst:.3e}"
        );
        assert!(worst < 1e-8, "{layout:?}: {worst}");
    }
}

#[test]
fn bad_rope_arguments_are_typed_errors() {
    for_each_backend(|_, ctx| {
        let message = |r: Result<RopeTable, Error>| r.unwrap_err().to_string();
        let m = message(RopeTable::new(ctx, 10000.0, 5, RopeLayout::Half, 8));
        assert!(m.contains("rotary_dim") && m.contains("even"), "{m}");
        let m = message(RopeTable::new(ctx, 1.0, 4, RopeLayout::Half, 8));
        assert!(m.contains("rope base"), "{m}");
        let table = RopeTable::new(ctx, 10000.0, 8, RopeLayout::Half, 4).unwrap();
        let x = upload(ctx, &[0.0; 2 * 3 * 2 * 4], [2, 3, 2, 4]);
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let m = rope_forward_into(ctx, &mut encoder, &x, &table, 0)
            .unwrap_err()
            .to_string();
        assert!(m.contains("rotary_dim") && m.contains("head dim"), "{m}");
        let table = RopeTable::new(ctx, 10000.0, 4, RopeLayout::Half, 4).unwrap();
        let m = rope_forward_into(ctx, &mut encoder, &x, &table, 2)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("offset 2 + length 3 exceeds") && m.contains("4 positions"),
            "{m}"
        );
    });
}

/// Scaled frequencies (Hugging Face's `rope_scaling`): linear, and LLaMA 3's with a head dim whose
/// pairs fall in all three bands (kept, blended, divided), forward and backward.
#[test]
fn scaled_frequencies_match_reference() {
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_positions: 64,
    };
    let linear = RopeScaling::Linear { factor: 2.5 };
    for_each_backend(|backend, ctx| {
        for (scaling, base) in [(llama3, 10000.0), (linear, 500.0)] {
            let shape = [2, 9, 2, 16];
            let n: usize = shape.iter().product();
            let x = random(&mut rng(5), n, 1.0);
            let t = GpuTensor::from_slice(ctx, &x, &shape).unwrap();
            let view = t.heads().unwrap();
            let table =
                RopeTable::scaled(ctx, base, 16, RopeLayout::Half, Some(scaling), 40).unwrap();
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            rope_forward_into(ctx, &mut encoder, &view, &table, 30).unwrap();
            ctx.queue().submit([encoder.finish()]);
            let rotation = reference::Rotation {
                base,
                rotary_dim: 16,
                layout: RopeLayout::Half,
                scaling: Some(scaling),
            };
            let expected = reference::rope_scaled(&to_f64(&x), shape, rotation, 30, 1.0);
            let tag = format!("[{backend}] {scaling:?}");
            assert_close(
                &tag,
                &view.to_vec(ctx).unwrap(),
                &expected,
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            rope_backward_into(ctx, &mut encoder, &view, &table, 30).unwrap();
            ctx.queue().submit([encoder.finish()]);
            assert_close(
                &format!("{tag} back"),
                &view.to_vec(ctx).unwrap(),
                &to_f64(&x),
                FORWARD_ATOL,
                FORWARD_RTOL,
            );
        }
        // The three LLaMA 3 bands at head dim 16, base 10000, original length 64: pair 0's
        // wavelength 6.3 is kept, pair 2's (63) blended, pair 7's (2.0e4) divided by 8.
        let angle = |k| reference::rope_angle_scaled(1, k, 10000.0, 16, Some(llama3));
        let plain = |k| reference::rope_angle(1, k, 10000.0, 16);
        assert_eq!(angle(0), plain(0));
        assert!(angle(2) < plain(2) && angle(2) > plain(2) / 8.0);
        assert!((angle(7) - plain(7) / 8.0).abs() < 1e-15);
        let bad = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 1.0,
            original_max_positions: 64,
        };
        let err = RopeTable::scaled(ctx, 10000.0, 16, RopeLayout::Half, Some(bad), 8);
        assert!(matches!(err, Err(Error::Shape { .. })), "{err:?}");
    });
}

/// A packed view (`SeqLens::packed`): each sequence's rows rotate at their own positions (offset +
/// row within the sequence), as the reference rotates the padded batch, forward and backward; the
/// rows after the last sequence (and no other) are left alone.
#[test]
fn packed_views_rotate_each_sequence_from_its_first_row() {
    use wgpu_attention::kernels::rope::{rope_backward_packed_into, rope_forward_packed_into};
    use wgpu_attention::{PackedSide, SeqLens};
    for_each_backend(|backend, ctx| {
        let (q_lens, kv_lens) = ([3u32, 0, 6], [2u32, 5, 1]);
        let (heads, dim, offset, longest) = (2, 8, 4, 6);
        let lens = SeqLens::packed(ctx, &q_lens, &kv_lens).unwrap();
        let table = RopeTable::new(ctx, 10000.0, dim, RopeLayout::Half, offset + longest).unwrap();
        for (side, seq_lens) in [(PackedSide::Queries, q_lens), (PackedSide::Keys, kv_lens)] {
            let total = seq_lens.iter().sum::<u32>() as usize;
            let width = heads * dim;
            let data = random(&mut rng(5), (total + 2) * width, 1.0);
            // The padded batch the packed rows come from, rotated by the reference.
            let mut padded = vec![0.0f64; seq_lens.len() * longest * width];
            let mut row = 0;
            for (b, &len) in seq_lens.iter().enumerate() {
                for l in 0..len as usize {
                    for c in 0..width {
                        padded[(b * longest + l) * width + c] = data[(row + l) * width + c] as f64;
                    }
                }
                row += len as usize;
            }
            let shape = [seq_lens.len(), longest, heads, dim];
            for sign in [1.0, -1.0] {
                let rotated =
                    reference::rope(&padded, shape, 10000.0, dim, RopeLayout::Half, offset, sign);
                let mut expected: Vec<f64> = Vec::new();
                for (b, &len) in seq_lens.iter().enumerate() {
                    expected.extend(&rotated[b * longest * width..][..len as usize * width]);
                }
                expected.extend(data[total * width..].iter().map(|&x| x as f64));
                let t = GpuTensor::from_slice(ctx, &data, &[total + 2, heads, dim]).unwrap();
                let view = t.packed_heads(&lens, side).unwrap();
                let mut encoder = ctx.device().create_command_encoder(&Default::default());
                match sign > 0.0 {
                    true => {
                        rope_forward_packed_into(ctx, &mut encoder, &view, &table, &lens, offset)
                    }
                    false => {
                        rope_backward_packed_into(ctx, &mut encoder, &view, &table, &lens, offset)
                    }
                }
                .unwrap();
                ctx.queue().submit([encoder.finish()]);
                let got = t.to_vec(ctx).unwrap();
                assert_close(
                    &format!("[{backend}] packed rope {side:?} sign {sign}"),
                    &got,
                    &expected,
                    1e-6,
                    1e-6,
                );
                assert_eq!(
                    got[total * width..],
                    data[total * width..],
                    "[{backend}] margin"
                );
            }
        }
        // A packed view needs its lengths; a padded one refuses them.
        let t = GpuTensor::zeros(ctx, &[9, heads, dim]).unwrap();
        let view = t.packed_heads(&lens, PackedSide::Queries).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let m = rope_forward_into(ctx, &mut encoder, &view, &table, 0)
            .unwrap_err()
            .to_string();
        assert!(m.contains("rope_forward_packed_into"), "{m}");
        let other = SeqLens::packed(ctx, &[3, 6], &[3, 6]).unwrap();
        let m = rope_forward_packed_into(ctx, &mut encoder, &view, &table, &other, 0)
            .unwrap_err()
            .to_string();
        assert!(m.contains("packed for 3 sequences"), "{m}");
        let padded = t.reshape(&[1, 9, heads, dim]).unwrap().heads().unwrap();
        let m = rope_forward_packed_into(ctx, &mut encoder, &padded, &table, &lens, 0)
            .unwrap_err()
            .to_string();
        assert!(m.contains("not packed"), "{m}");
    });
}
