//! Decode attention (a few new queries per sequence against a key/value cache) against the f64
//! reference, on every back end: GQA, sequences of different lengths in one batch, masks and score
//! modifiers aligned on each sequence's lengths (also cosine scores and key clipping, which transform
//! the cache), split-KV (forced by a small loop budget), bitwise
//! reruns, typed errors.

mod common;

use common::*;
use wgpu_attention::reference::attention::{self as reference, Masks};
use wgpu_attention::{attention_decode, AttentionOptions, BiasView, Context, GpuTensor, SeqLens};

/// A decode problem: `lq` query slots, a cache of `lk` (capacity) with per-sequence lengths.
fn decode_case(
    b: usize,
    lq: usize,
    cap: usize,
    h: usize,
    hkv: usize,
    dk: usize,
    dv: usize,
) -> Case {
    Case::new(b, lq, cap, h, hkv, dk, dv)
}

/// Runs decode attention for `case` (its q_lens/kv_lens the new and cached counts) and checks it
/// against the reference; returns the GPU output for rerun comparisons.
fn check(ctx: &Context, name: &str, case: &Case) -> Vec<f32> {
    let (q, k, v, _) = case.data();
    let [qv, kv, vv, _] = case.upload(ctx);
    let buffers = case.buffers(ctx);
    let out = attention_decode(ctx, &qv, &kv, &vv, &case.options(&buffers)).unwrap();
    let masks = Masks {
        q_lens: None,
        kv_lens: None,
        ..case.masks()
    };
    let (q_lens, kv_lens) = (case.q_lens.clone().unwrap(), case.kv_lens.clone().unwrap());
    let (ref_out, ref_lse) = reference::attention_decode(
        &case.shape(),
        &to_f64(&q),
        &to_f64(&k),
        &to_f64(&v),
        &q_lens,
        &kv_lens,
        &masks,
    );
    let what = format!("[{name}] decode {}", case.label());
    let o = out.out.to_vec(ctx).unwrap();
    assert_close(
        &format!("{what} out"),
        &o,
        &ref_out,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    let lse = out.lse.to_vec(ctx).unwrap();
    assert_lse_close(&what, &lse, &ref_lse, FORWARD_ATOL, FORWARD_RTOL);
    o
}

/// GQA (4 query heads on 2 KV heads), three sequences of different lengths (one past a 64-key tile,
/// one with fewer new queries than slots), causal.
fn gqa_case() -> Case {
    decode_case(3, 3, 70, 4, 2, 16, 16)
        .causal()
        .q_lens(&[1, 3, 2])
        .kv_lens(&[70, 5, 33])
}

#[test]
fn decode_matches_reference_with_gqa_and_ragged_lengths() {
    for_each_backend(|name, ctx| {
        check(ctx, name, &gqa_case());
        // A sequence with nothing new this step gives zero rows and -inf.
        check(
            ctx,
            name,
            &decode_case(2, 2, 40, 4, 2, 16, 16)
                .causal()
                .q_lens(&[0, 2])
                .kv_lens(&[7, 40]),
        );
        // Eight new queries per sequence (a prompt chunk): two O items per invocation.
        check(
            ctx,
            name,
            &decode_case(1, 8, 70, 4, 2, 16, 16)
                .causal()
                .q_lens(&[8])
                .kv_lens(&[70]),
        );
    });
}

#[test]
fn decode_matches_reference_with_score_modifiers() {
    for_each_backend(|name, ctx| {
        // Window, ALiBi, softcap and sinks (the decoding modifiers), Dk != Dv, MHA.
        let case = decode_case(2, 2, 90, 2, 2, 24, 16)
            .causal()
            .q_lens(&[2, 1])
            .kv_lens(&[90, 41])
            .window(20, 0)
            .alibi()
            .softcap(5.0)
            .sinks(&[0.5, -1.0])
            .magnitude(3.0);
        check(ctx, name, &case);
        // T5 relative buckets, one-directional as in a decoder, with GQA.
        let case = decode_case(2, 2, 70, 4, 2, 16, 16)
            .causal()
            .q_lens(&[2, 1])
            .kv_lens(&[70, 3])
            .relative(8, 32, false);
        check(ctx, name, &case);
        // Cosine scores (fixed and learned per-head scales) and key-norm clipping: the new
        // queries and the whole cache transformed before the kernel.
        let case = decode_case(2, 2, 50, 4, 2, 16, 16)
            .causal()
            .q_lens(&[2, 1])
            .kv_lens(&[50, 9])
            .cosine(10.0)
            .magnitude(4.0);
        check(ctx, name, &case);
        let case = decode_case(2, 2, 50, 2, 2, 12, 8)
            .causal()
            .q_lens(&[1, 2])
            .kv_lens(&[17, 50])
            .cosine_learned(&[5.0, 12.0]);
        check(ctx, name, &case);
        let case = decode_case(2, 2, 50, 4, 2, 16, 16)
            .causal()
            .q_lens(&[2, 2])
            .kv_lens(&[50, 30])
            .key_clip(4.0)
            .magnitude(3.0);
        check(ctx, name, &case);
        // Caches longer than every sequence: only the first max(kv_lens) positions are transformed
        // and read.
        let case = decode_case(2, 2, 50, 2, 2, 12, 8)
            .causal()
            .q_lens(&[1, 2])
            .kv_lens(&[17, 30])
            .cosine_learned(&[5.0, 12.0])
            .key_clip(0.5);
        check(ctx, name, &case);
    });
}

#[test]
fn decode_split_kv_merges_in_a_fixed_order() {
    // A small loop budget forces several key splits and the merge; reruns are bitwise equal.
    for_each_backend_with_loop_budget(700, |name, ctx| {
        let case = gqa_case();
        let s = case.shape();
        let plan = wgpu_attention::DecodePlan::new(ctx, &s, 70).unwrap();
        assert!(plan.splits > 1, "[{name}] {plan:?} does not split");
        let first = check(ctx, name, &case);
        let again = check(ctx, name, &case);
        assert!(
            first
                .iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "[{name}] split decode is not bitwise deterministic"
        );
    });
}

#[test]
fn decode_refuses_bad_input() {
    for_each_backend(|name, ctx| {
        let case = gqa_case();
        let [q, k, v, _] = case.upload(ctx);
        let message = |opts: &AttentionOptions<'_>| {
            attention_decode(ctx, &q, &k, &v, opts)
                .expect_err("accepted")
                .to_string()
        };
        let e = message(&AttentionOptions::new().causal(true));
        assert!(
            e.contains("q_lens") && e.contains("kv_lens"),
            "[{name}] {e}"
        );
        let lens = SeqLens::new(ctx, Some(&[1, 3, 2]), None).unwrap();
        let e = message(&AttentionOptions::new().seq_lens(&lens));
        assert!(e.contains("kv_lens"), "[{name}] {e}");
        let lens = SeqLens::new(ctx, Some(&[1, 3, 2]), Some(&[70, 2, 33])).unwrap();
        let e = message(&AttentionOptions::new().seq_lens(&lens));
        assert!(e.contains("q_lens <= kv_lens"), "[{name}] {e}");
        let lens = SeqLens::new(ctx, Some(&[1, 3, 2]), Some(&[71, 5, 33])).unwrap();
        let e = message(&AttentionOptions::new().seq_lens(&lens));
        assert!(e.contains("kv_lens") && e.contains("70"), "[{name}] {e}");
        let lens = SeqLens::new(ctx, Some(&[1, 3, 2]), Some(&[70, 5, 33])).unwrap();
        let bias = GpuTensor::zeros(ctx, &[3, 70]).unwrap();
        let bias = BiasView::of(&bias).unwrap();
        let e = message(&AttentionOptions::new().seq_lens(&lens).constant_bias(&bias));
        assert!(e.contains("bias") && e.contains("decode"), "[{name}] {e}");
    });
}
