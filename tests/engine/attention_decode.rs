//! Decode attention (a few new queries per sequence against a key/value cache) against the f64
//! reference, on every back end: GQA, sequences of different lengths in one batch, masks and score
//! modifiers aligned on each sequence's lengths (also cosine scores and key clipping, which transform
//! the cache), split-KV (forced by a small loop budget), f32 tiles staged (the GPU kernel
//! families) and read in place (the CPU drivers'), the staged tile's shapes, bitwise reruns, typed
//! errors.

use crate::common;

use common::*;
use wgpu_attention::reference::attention::{self as reference, Masks};
use wgpu_attention::reference::kv_cache::dequantize_int8_rows;
use wgpu_attention::{
    attention_decode, attention_decode_f16_into, attention_decode_int8_into, AttentionOptions,
    BiasView, Context, GpuTensor, GpuTensorF16, GpuTensorQ8, HalfCache, HeadsView, QuantizedCache,
    SeqLens,
};

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

/// Records decode attention for `case` with `record` (given q, out and lse views and the options),
/// submits it, and checks out and lse against the reference over keys `k` and values `v` (what
/// the cache holds) at the f32 tolerances; returns the output.
fn check_stored(
    ctx: &Context,
    what: &str,
    case: &Case,
    [k, v]: [&[f64]; 2],
    record: impl FnOnce(
        &mut wgpu::CommandEncoder,
        &HeadsView,
        &HeadsView,
        &GpuTensor,
        &AttentionOptions,
    ),
) -> Vec<f32> {
    let s = case.shape();
    let (q, ..) = case.data();
    let [qv, _, _, _] = case.upload(ctx);
    let out = GpuTensor::zeros(ctx, &[s.batch, s.q_seq, s.heads, s.head_dim_v]).unwrap();
    let lse = GpuTensor::zeros(ctx, &[s.batch, s.heads, s.q_seq]).unwrap();
    let buffers = case.buffers(ctx);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    record(
        &mut encoder,
        &qv,
        &out.heads().unwrap(),
        &lse,
        &case.options(&buffers),
    );
    ctx.queue().submit([encoder.finish()]);
    let masks = Masks {
        q_lens: None,
        kv_lens: None,
        ..case.masks()
    };
    let (q_lens, kv_lens) = (case.q_lens.clone().unwrap(), case.kv_lens.clone().unwrap());
    let (ref_out, ref_lse) =
        reference::attention_decode(&s, &to_f64(&q), k, v, &q_lens, &kv_lens, &masks);
    let o = out.to_vec(ctx).unwrap();
    assert_close(
        &format!("{what} out"),
        &o,
        &ref_out,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    assert_lse_close(
        what,
        &lse.to_vec(ctx).unwrap(),
        &ref_lse,
        FORWARD_ATOL,
        FORWARD_RTOL,
    );
    o
}

/// Decode attention for `case` over an int8 cache: against the reference over the values the cache
/// holds (the kernel's own error, at the f32 tolerances), and against the reference over the f32
/// keys and values (the quantisation's error); returns the latter's largest output error.
fn check_int8(ctx: &Context, name: &str, case: &Case) -> f64 {
    let s = case.shape();
    let (q, k, v, _) = case.data();
    let cache = |x: &[f32], d: usize| {
        GpuTensorQ8::from_f32(ctx, x, &[s.batch, s.kv_seq, s.kv_heads, d]).unwrap()
    };
    let (kq, vq) = (cache(&k, s.head_dim_qk), cache(&v, s.head_dim_v));
    let stored = |t: &GpuTensorQ8, d: usize| dequantize_int8_rows(&t.to_words(ctx).unwrap(), d);
    let (k_held, v_held) = (stored(&kq, s.head_dim_qk), stored(&vq, s.head_dim_v));
    let what = format!("[{name}] int8 decode {}", case.label());
    let o = check_stored(
        ctx,
        &what,
        case,
        [&k_held, &v_held],
        |e, q, out, lse, opts| {
            let cache = QuantizedCache {
                k: &kq,
                v: &vq,
                table: None,
            };
            attention_decode_int8_into(ctx, e, q, cache, out, lse, opts).unwrap()
        },
    );
    let masks = Masks {
        q_lens: None,
        kv_lens: None,
        ..case.masks()
    };
    let (q_lens, kv_lens) = (case.q_lens.clone().unwrap(), case.kv_lens.clone().unwrap());
    let (f32_out, _) = reference::attention_decode(
        &s,
        &to_f64(&q),
        &to_f64(&k),
        &to_f64(&v),
        &q_lens,
        &kv_lens,
        &masks,
    );
    o.iter()
        .zip(&f32_out)
        .map(|(&a, &b)| (a as f64 - b).abs())
        .fold(0.0, f64::max)
}

/// Decode attention for `case` over an f16 cache against the reference over the f16-rounded keys
/// and values, at the f32 tolerances (the kernel widens exactly what the cache holds).
fn check_f16(ctx: &Context, name: &str, case: &Case) {
    let s = case.shape();
    let (_, k, v, _) = case.data();
    let cache = |x: &[f32], d: usize| {
        GpuTensorF16::from_f32(ctx, x, &[s.batch, s.kv_seq, s.kv_heads, d]).unwrap()
    };
    let (kh, vh) = (cache(&k, s.head_dim_qk), cache(&v, s.head_dim_v));
    let rounded =
        |x: &[f32]| -> Vec<f64> { x.iter().map(|&x| half::f16::from_f32(x).to_f64()).collect() };
    let what = format!("[{name}] f16 decode {}", case.label());
    check_stored(
        ctx,
        &what,
        case,
        [&rounded(&k), &rounded(&v)],
        |e, q, out, lse, opts| {
            let cache = HalfCache {
                k: &kh,
                v: &vh,
                table: None,
            };
            attention_decode_f16_into(ctx, e, q, cache, out, lse, opts).unwrap()
        },
    );
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
    for_each_family(|name, ctx| {
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

/// Prefill-shaped steps (at least `PREFILL_FORWARD_ROWS` new rows) run on the fused forward kernels
/// of both families, aligned on each sequence's lengths: new prompts, prompts after a cached prefix,
/// sequences with no new rows, with the modifiers that follow positions (window, ALiBi, relative
/// buckets), sinks and cosine scores.
#[test]
fn prefill_steps_on_the_forward_kernels_match_reference() {
    use wgpu_attention::kernels::attention::PREFILL_FORWARD_ROWS;
    let rows = PREFILL_FORWARD_ROWS;
    for_each_family(|name, ctx| {
        check(
            ctx,
            name,
            &decode_case(3, rows, 100, 4, 2, 16, 16)
                .causal()
                .q_lens(&[rows as u32, 40, 0])
                .kv_lens(&[rows as u32, 100, 9]),
        );
        check(
            ctx,
            name,
            &decode_case(2, rows, 90, 4, 2, 16, 16)
                .causal()
                .q_lens(&[rows as u32, 17])
                .kv_lens(&[90, 17])
                .window(20, 0)
                .alibi()
                .sinks(&[0.5, -1.0, 0.25, 0.0])
                .relative(8, 32, false),
        );
        check(
            ctx,
            name,
            &decode_case(2, rows, 80, 4, 2, 16, 16)
                .causal()
                .q_lens(&[rows as u32, 5])
                .kv_lens(&[80, 70])
                .cosine(10.0)
                .magnitude(4.0),
        );
    });
}

#[test]
fn decode_matches_reference_with_score_modifiers() {
    for_each_family(|name, ctx| {
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
fn int8_cache_decode_matches_reference() {
    // Both families: the GPU family dequantises staged tiles, the CPU drivers' reads in place.
    for_each_family(|name, ctx| {
        // The kernel dequantises exactly what the cache holds; the quantisation itself moves the
        // outputs of these unit-scale problems by well under 1% (values within max|row| / 254).
        let err = check_int8(ctx, name, &gqa_case());
        assert!(err < 2e-2, "[{name}] int8 against f32 cache: {err}");
        let case = decode_case(2, 2, 90, 2, 2, 24, 16)
            .causal()
            .q_lens(&[2, 1])
            .kv_lens(&[90, 41])
            .window(20, 0)
            .alibi()
            .softcap(5.0)
            .sinks(&[0.5, -1.0])
            .magnitude(3.0);
        let err2 = check_int8(ctx, name, &case);
        assert!(err2 < 5e-2, "[{name}] int8 against f32 cache: {err2}");
        // Prefill-shaped (64 new rows or more): the fused forward, dequantising the cache as it
        // stages it.
        let prefill = decode_case(2, 70, 100, 4, 2, 16, 16)
            .causal()
            .q_lens(&[70, 40])
            .kv_lens(&[100, 61]);
        let err3 = check_int8(ctx, name, &prefill);
        assert!(
            err3 < 2e-2,
            "[{name}] int8 prefill against f32 cache: {err3}"
        );
        eprintln!("[{name}] int8 cache, largest output error against the f32 cache: {err:.2e}, {err2:.2e}, prefill {err3:.2e}");
        // Cosine scores and key clipping: the cache dequantised into scratch, then transformed.
        let cosine = check_int8(ctx, name, &gqa_case().cosine(10.0));
        let clipped = decode_case(2, 2, 50, 2, 2, 12, 8)
            .causal()
            .q_lens(&[1, 2])
            .kv_lens(&[17, 30])
            .cosine_learned(&[5.0, 12.0])
            .key_clip(0.5);
        let clipped = check_int8(ctx, name, &clipped);
        assert!(
            cosine < 5e-2 && clipped < 5e-2,
            "[{name}] int8 cosine / key clipping against f32 cache: {cosine}, {clipped}"
        );
    });
    // Split-KV over an int8 cache.
    for_each_backend_with_loop_budget(3000, |name, ctx| {
        let case = decode_case(1, 1, 300, 2, 1, 16, 16)
            .causal()
            .q_lens(&[1])
            .kv_lens(&[300]);
        check_int8(ctx, name, &case);
    });
}

/// f16 caches: read as words and widened in the kernel, staged (the GPU family) and in place (the
/// CPU drivers'), with modifiers, split-KV, and prefill-shaped steps and cosine scores (the cache
/// widened by the fused forward; cosine scores: widened into scratch first); head dims that are no
/// multiple of 4 are refused.
#[test]
fn f16_cache_decode_matches_reference() {
    for_each_family(|name, ctx| {
        check_f16(ctx, name, &gqa_case());
        let modifiers = decode_case(2, 2, 90, 2, 2, 24, 16)
            .causal()
            .q_lens(&[2, 1])
            .kv_lens(&[90, 41])
            .window(20, 0)
            .alibi()
            .softcap(5.0)
            .sinks(&[0.5, -1.0])
            .magnitude(3.0);
        check_f16(ctx, name, &modifiers);
        let prefill = decode_case(2, 70, 100, 4, 2, 16, 16)
            .causal()
            .q_lens(&[70, 40])
            .kv_lens(&[100, 61]);
        check_f16(ctx, name, &prefill);
        check_f16(ctx, name, &gqa_case().cosine(10.0));
        // Rows of 6 words (head dim 12) start off four-word boundaries: the word-per-access build
        // (the cases above read a vec4 per access where the GPU family stages them).
        check_f16(
            ctx,
            name,
            &decode_case(2, 2, 40, 4, 2, 12, 12)
                .causal()
                .q_lens(&[1, 2])
                .kv_lens(&[40, 13]),
        );
        // A head dim of 6 is refused with a typed error, before anything is recorded.
        let odd = GpuTensorF16::zeros(ctx, &[1, 8, 1, 6]).unwrap();
        let q = GpuTensor::zeros(ctx, &[1, 1, 1, 6])
            .unwrap()
            .heads()
            .unwrap();
        let out = GpuTensor::zeros(ctx, &[1, 1, 1, 6])
            .unwrap()
            .heads()
            .unwrap();
        let lse = GpuTensor::zeros(ctx, &[1, 1, 1]).unwrap();
        let lens = SeqLens::new(ctx, Some(&[1]), Some(&[8])).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let cache = HalfCache {
            k: &odd,
            v: &odd,
            table: None,
        };
        let opts = AttentionOptions::new().seq_lens(&lens);
        let err = attention_decode_f16_into(ctx, &mut encoder, &q, cache, &out, &lse, &opts);
        assert!(
            format!("{:?}", err.unwrap_err()).contains("multiple of 4"),
            "[{name}] head dim 6"
        );
    });
    for_each_backend_with_loop_budget(3000, |name, ctx| {
        let case = decode_case(1, 1, 300, 2, 1, 16, 16)
            .causal()
            .q_lens(&[1])
            .kv_lens(&[300]);
        check_f16(ctx, name, &case);
    });
}

/// The staged tile's narrower shapes (chosen on adapters with little workgroup storage, or forced
/// by `ContextOptions::decode_shape`) and head dims that are no multiple of 4 (the staged rows'
/// padding), over f32 and int8 caches (int8 rows read in place).
#[test]
fn decode_tile_shapes_match_reference() {
    for keys in [4u32, 16] {
        // The GPU family stages f32 tiles (the CPU drivers' reads in place).
        let forced = |_: &str, mut options: wgpu_attention::ContextOptions| {
            options.decode_shape = Some((keys, 8));
            options.kernel_family = Some(wgpu_attention::KernelFamily::Gpu);
            options
        };
        for_each_backend_with_options(forced, |name, ctx| {
            let case = decode_case(2, 2, 50, 4, 2, 10, 6)
                .causal()
                .q_lens(&[1, 2])
                .kv_lens(&[50, 19]);
            let plan = wgpu_attention::DecodePlan::new(ctx, &case.shape(), 50).unwrap();
            assert!(
                plan.staged && plan.tile_keys == keys as usize,
                "[{name}] {plan:?}"
            );
            check(ctx, &format!("{name}, {keys}-key tiles"), &case);
            let case = decode_case(2, 2, 50, 4, 2, 8, 8)
                .causal()
                .q_lens(&[1, 2])
                .kv_lens(&[50, 19]);
            let err = check_int8(ctx, name, &case);
            assert!(err < 5e-2, "[{name}] int8 against f32 cache: {err}");
        });
    }
}

/// f32 caches whose rows start on four-word boundaries are read four words per access (the VEC4
/// build), others a word at a time: the same cache one element into its buffer takes the word
/// build. Both match the reference and give the same bits (the reads differ, not the arithmetic),
/// staged (the GPU family) and in place (the CPU drivers'); the dump names both builds.
#[test]
fn decode_vec4_and_word_reads_agree_bitwise() {
    let dump =
        std::env::temp_dir().join(format!("wgpu-attention-decode-vec4-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dump);
    for_each_family_with_options(
        |opts| opts.dump_pipelines(&dump),
        |name, ctx| {
            let case = decode_case(2, 2, 40, 4, 2, 16, 8)
                .causal()
                .q_lens(&[1, 2])
                .kv_lens(&[40, 13]);
            let aligned = check(ctx, name, &case);
            let (_, k, v, _) = case.data();
            let shifted = |data: &[f32], d: usize| {
                let buffer =
                    GpuTensor::from_slice(ctx, &[&[0.0], data].concat(), &[1 + data.len()])
                        .unwrap();
                let (hkv, lk) = (case.hkv, case.lk);
                let strides = [lk * hkv * d, hkv * d, d];
                HeadsView::new(buffer.buffer().clone(), 1, [case.b, lk, hkv, d], strides).unwrap()
            };
            let (ks, vs) = (shifted(&k, case.dk), shifted(&v, case.dv));
            let [qv, _, _, _] = case.upload(ctx);
            let buffers = case.buffers(ctx);
            let out = attention_decode(ctx, &qv, &ks, &vs, &case.options(&buffers)).unwrap();
            let words = out.out.to_vec(ctx).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&aligned),
                bits(&words),
                "[{name}] vec4 and word reads of one cache"
            );
        },
    );
    let names: Vec<String> = std::fs::read_dir(&dump)
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("attention_decode") && n.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dump);
    let vec4 = names.iter().filter(|n| n.contains("VEC41")).count();
    assert!(
        vec4 > 0 && vec4 < names.len(),
        "decode builds of both reads expected: {names:?}"
    );
}

/// Tree steps (speculative decoding's drafts): each new row's output equals plain decoding of the
/// sequence its path spells (the cached keys, then its ancestors' keys in order, itself last), with
/// positions, and so ALiBi and windows, following depths; padding slots give zero rows.
#[test]
fn tree_decode_matches_each_path_decoded_as_a_sequence() {
    let (slots, cap, h, hkv, d) = (6, 40, 4, 2, 16);
    // Sequence 0: 20 cached tokens and a branching tree; sequence 1: 7 and a chain of 3.
    let parents: Vec<Vec<Option<usize>>> = vec![
        vec![None, Some(0), Some(0), Some(1), Some(2), Some(1)],
        vec![None, Some(0), Some(1)],
    ];
    let kv_lens = [26u32, 10];
    for_each_family(|name, ctx| {
        for case in [
            Case::new(2, slots, cap, h, hkv, d, d).causal(),
            Case::new(2, slots, cap, h, hkv, d, d)
                .causal()
                .alibi()
                .window(21, 0)
                .softcap(4.0)
                .sinks(&[0.5, -1.0, 0.0, 1.0])
                .magnitude(2.0),
        ] {
            let case = case.q_lens(&[6, 3]).kv_lens(&kv_lens);
            let (q, k, v, _) = case.data();
            let [qv, kv, vv, _] = case.upload(ctx);
            let buffers = case.buffers(ctx);
            let trees = SeqLens::with_trees(ctx, &kv_lens, slots, &parents).unwrap();
            let opts = case.options(&buffers).seq_lens(&trees);
            let out = attention_decode(ctx, &qv, &kv, &vv, &opts).unwrap();
            let (o, lse) = (out.out.to_vec(ctx).unwrap(), out.lse.to_vec(ctx).unwrap());
            let masks = Masks {
                q_lens: None,
                kv_lens: None,
                ..case.masks()
            };
            for (b, rows) in parents.iter().enumerate() {
                let prefix = kv_lens[b] as usize - rows.len();
                for i in 0..slots {
                    let (o_row, lse_row): (Vec<f32>, Vec<f32>) = (
                        o[(b * slots + i) * h * d..][..h * d].to_vec(),
                        (0..h).map(|hh| lse[(b * h + hh) * slots + i]).collect(),
                    );
                    if i >= rows.len() {
                        assert!(o_row.iter().all(|&x| x == 0.0), "[{name}] padding row");
                        continue;
                    }
                    // Row i's path, root first.
                    let mut path = vec![i];
                    while let Some(p) = rows[*path.last().unwrap()] {
                        path.push(p);
                    }
                    path.reverse();
                    let keys: Vec<usize> =
                        (0..prefix).chain(path.iter().map(|n| prefix + n)).collect();
                    let gather = |x: &[f32]| -> Vec<f64> {
                        keys.iter()
                            .flat_map(|&j| x[(b * cap + j) * hkv * d..][..hkv * d].iter())
                            .map(|&x| x as f64)
                            .collect()
                    };
                    let one = Case::new(1, 1, keys.len(), h, hkv, d, d).shape();
                    let query = to_f64(&q[(b * slots + i) * h * d..][..h * d]);
                    let len = keys.len() as u32;
                    let (ref_o, ref_lse) = reference::attention_decode(
                        &one,
                        &query,
                        &gather(&k),
                        &gather(&v),
                        &[1],
                        &[len],
                        &masks,
                    );
                    let what =
                        format!("[{name}] tree decode {} sequence {b} row {i}", case.label());
                    assert_close(
                        &format!("{what} out"),
                        &o_row,
                        &ref_o,
                        FORWARD_ATOL,
                        FORWARD_RTOL,
                    );
                    assert_lse_close(&what, &lse_row, &ref_lse, FORWARD_ATOL, FORWARD_RTOL);
                }
            }
        }
        // Trees are read by decode attention only, for as many rows as its queries have.
        let case = gqa_case();
        let [qv, kv, vv, _] = case.upload(ctx);
        let trees = SeqLens::with_trees(
            ctx,
            &[70, 5, 33],
            3,
            &[vec![None], vec![None, Some(0)], vec![]],
        )
        .unwrap();
        let opts = AttentionOptions::new().causal(true).seq_lens(&trees);
        let err = wgpu_attention::attention_forward(ctx, &qv, &kv, &vv, &opts);
        assert!(
            matches!(
                err,
                Err(wgpu_attention::Error::Shape {
                    arg: "seq_lens",
                    ..
                })
            ),
            "{err:?}"
        );
        let four =
            SeqLens::with_trees(ctx, &[70, 5, 33], 4, &[vec![None], vec![None], vec![]]).unwrap();
        let err = attention_decode(ctx, &qv, &kv, &vv, &opts.seq_lens(&four));
        assert!(
            matches!(
                err,
                Err(wgpu_attention::Error::Shape {
                    arg: "seq_lens",
                    ..
                })
            ),
            "{err:?}"
        );
        // A parent after its child is refused.
        let err = SeqLens::with_trees(ctx, &[9], 2, &[vec![Some(1), None]]);
        assert!(
            matches!(
                err,
                Err(wgpu_attention::Error::Shape { arg: "parents", .. })
            ),
            "{err:?}"
        );
    });
}

#[test]
fn decode_split_kv_merges_in_a_fixed_order() {
    // A small loop budget forces several key splits and the merge; reruns are bitwise equal.
    for_each_family_with_loop_budget(700, |name, ctx| {
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
