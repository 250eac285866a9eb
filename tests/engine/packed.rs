//! Packed variable-length batches (`SeqLens::packed`, `HeadsView::packed`): the fused forward and
//! backward over `[total, heads, head_dim]` tensors against the CPU reference of the same padded
//! problem, bitwise equal to the padded kernels, nothing written outside the sequences' rows, NaN in
//! the rows after them kept out; and the typed errors of every misuse.

use crate::common;

use common::*;
use wgpu_attention::kernels::attention::attention_decode;
use wgpu_attention::{
    attention_backward, attention_backward_into, attention_backward_workspace, attention_forward,
    attention_forward_into, attention_forward_plan, AttentionOptions, BackwardViews, Context,
    ForwardViews, GpuTensor, HeadsView, KernelFamily, PackedSide, SeqLens,
};

/// Rows after the packed sequences in every tensor: inputs hold NaN there, outputs a sentinel that
/// must survive.
const MARGIN: usize = 3;
const SENTINEL: f32 = 12345.0;

/// The valid rows of padded `[B, seq, width]` data, one sequence after another, then `margin` rows
/// of `fill`.
fn pack(
    data: &[f32],
    lens: &[u32],
    seq: usize,
    width: usize,
    margin: usize,
    fill: f32,
) -> Vec<f32> {
    let mut out = Vec::new();
    for (b, &len) in lens.iter().enumerate() {
        out.extend_from_slice(&data[b * seq * width..][..len as usize * width]);
    }
    out.extend(std::iter::repeat_n(fill, margin * width));
    out
}

/// [`pack`] of f64 reference data, no margin.
fn pack_ref(data: &[f64], lens: &[u32], seq: usize, width: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for (b, &len) in lens.iter().enumerate() {
        out.extend_from_slice(&data[b * seq * width..][..len as usize * width]);
    }
    out
}

/// A packed `[rows, heads, dim]` tensor of `data` and its packed view.
fn packed_tensor(
    ctx: &Context,
    data: &[f32],
    heads: usize,
    dim: usize,
    lens: &SeqLens,
    side: PackedSide,
) -> (GpuTensor, HeadsView) {
    let rows = data.len() / (heads * dim);
    let t = GpuTensor::from_slice(ctx, data, &[rows, heads, dim]).unwrap();
    let view = t.packed_heads(lens, side).unwrap();
    (t, view)
}

/// The packed problem of `case` (its q_lens and kv_lens) on `ctx`: forward and backward through the
/// `_into` forms, checked against the reference, against the padded kernels bit for bit, and for
/// the rows after the sequences.
fn check_packed(backend: &str, ctx: &Context, case: &Case, backward: bool) {
    let q_lens = case.q_lens.clone().unwrap();
    let kv_lens = case.kv_lens.clone().unwrap();
    let tag = format!("[{backend}] packed {}", case.label());
    let (q, k, v, d_out) = case.data();
    let (qw, kw, vw, ow) = (
        case.h * case.dk,
        case.hkv * case.dk,
        case.hkv * case.dv,
        case.h * case.dv,
    );
    let lens = SeqLens::packed(ctx, &q_lens, &kv_lens).unwrap();
    use PackedSide::{Keys, Queries};
    let pq = |data: &[f32], w, fill| pack(data, &q_lens, case.lq, w, MARGIN, fill);
    let pk = |data: &[f32], w, fill| pack(data, &kv_lens, case.lk, w, MARGIN, fill);
    let (_q, qv) = packed_tensor(ctx, &pq(&q, qw, f32::NAN), case.h, case.dk, &lens, Queries);
    let (_k, kv) = packed_tensor(ctx, &pk(&k, kw, f32::NAN), case.hkv, case.dk, &lens, Keys);
    let (_v, vv) = packed_tensor(ctx, &pk(&v, vw, f32::NAN), case.hkv, case.dv, &lens, Keys);
    let (_do, dov) = packed_tensor(
        ctx,
        &pq(&d_out, ow, f32::NAN),
        case.h,
        case.dv,
        &lens,
        Queries,
    );
    let zeros_q = vec![SENTINEL; (q_lens.iter().sum::<u32>() as usize + MARGIN) * ow];
    let (out, out_view) = packed_tensor(ctx, &zeros_q, case.h, case.dv, &lens, Queries);
    let s = case.shape();
    let lse = GpuTensor::zeros(ctx, &[s.batch, s.heads, s.q_seq]).unwrap();

    let mut buffers = case.buffers(ctx);
    buffers.lens = Some(lens);
    let opts = case.options(&buffers);
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    attention_forward_into(
        ctx,
        &mut encoder,
        &ForwardViews {
            q: &qv,
            k: &kv,
            v: &vv,
            out: &out_view,
            lse: &lse,
        },
        &opts,
    )
    .unwrap_or_else(|e| panic!("{tag}: {e}"));
    ctx.queue().submit([encoder.finish()]);

    // The reference, and the padded kernels with the same lengths.
    let (r_out, r_lse) = case.reference_forward();
    let padded = {
        let [pq, pk, pv, _] = case.upload(ctx);
        let padded_buffers = case.buffers(ctx);
        attention_forward(ctx, &pq, &pk, &pv, &case.options(&padded_buffers)).unwrap()
    };
    let total_q = q_lens.iter().sum::<u32>() as usize;
    let got = out.to_vec(ctx).unwrap();
    let (atol, rtol) = forward_tolerances(ctx);
    assert_close(
        &format!("{tag} out"),
        &got[..total_q * ow],
        &pack_ref(&r_out, &q_lens, case.lq, ow),
        atol,
        rtol,
    );
    assert!(
        got[total_q * ow..].iter().all(|&x| x == SENTINEL),
        "{tag}: out written past the packed rows"
    );
    let padded_out = padded.out.to_vec(ctx).unwrap();
    assert_eq!(
        bits(&got[..total_q * ow]),
        bits(&pack(&padded_out, &q_lens, case.lq, ow, 0, 0.0)),
        "{tag}: packed out differs from the padded kernel's"
    );
    let got_lse = lse.to_vec(ctx).unwrap();
    assert_lse_close(&format!("{tag} lse"), &got_lse, &r_lse, atol, rtol);
    assert_eq!(
        bits(&got_lse),
        bits(&padded.lse.to_vec(ctx).unwrap()),
        "{tag}: lse"
    );
    if !backward {
        return;
    }

    let total_kv = kv_lens.iter().sum::<u32>() as usize;
    let grad = |rows: usize, heads: usize, dim: usize, side| {
        let data = vec![SENTINEL; (rows + MARGIN) * heads * dim];
        packed_tensor(ctx, &data, heads, dim, buffers.lens.as_ref().unwrap(), side)
    };
    let (dq, dq_view) = grad(total_q, case.h, case.dk, Queries);
    let (dk, dk_view) = grad(total_kv, case.hkv, case.dk, Keys);
    let (dv, dv_view) = grad(total_kv, case.hkv, case.dv, Keys);
    let workspace = attention_backward_workspace(ctx, &s).unwrap();
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    attention_backward_into(
        ctx,
        &mut encoder,
        &BackwardViews {
            q: &qv,
            k: &kv,
            v: &vv,
            out: &out_view,
            lse: &lse,
            d_out: &dov,
            dq: &dq_view,
            dk: &dk_view,
            dv: &dv_view,
            workspace: &workspace,
        },
        &opts,
    )
    .unwrap_or_else(|e| panic!("{tag}: {e}"));
    ctx.queue().submit([encoder.finish()]);
    let r = case.reference_backward();
    let padded_grads = {
        let [pq, pk, pv, pdo] = case.upload(ctx);
        let padded_buffers = case.buffers(ctx);
        let opts = case.options(&padded_buffers);
        let fwd = attention_forward(ctx, &pq, &pk, &pv, &opts).unwrap();
        attention_backward(ctx, &pq, &pk, &pv, &fwd, &pdo, &opts).unwrap()
    };
    for (name, t, reference, padded, lens, seq, width) in [
        ("dq", &dq, &r.dq, &padded_grads.dq, &q_lens, case.lq, qw),
        ("dk", &dk, &r.dk, &padded_grads.dk, &kv_lens, case.lk, kw),
        ("dv", &dv, &r.dv, &padded_grads.dv, &kv_lens, case.lk, vw),
    ] {
        let got = t.to_vec(ctx).unwrap();
        let rows = lens.iter().sum::<u32>() as usize;
        assert_close(
            &format!("{tag} {name}"),
            &got[..rows * width],
            &pack_ref(reference, lens, seq, width),
            backward_tolerances(ctx).0,
            backward_tolerances(ctx).1,
        );
        assert!(
            got[rows * width..].iter().all(|&x| x == SENTINEL),
            "{tag}: {name} written past the packed rows"
        );
        let padded = pack(&padded.to_vec(ctx).unwrap(), lens, seq, width, 0, 0.0);
        assert_eq!(
            bits(&got[..rows * width]),
            bits(&padded),
            "{tag}: packed {name} differs from the padded kernel's"
        );
    }
}

/// The message of a refusal.
fn refused<T>(backend: &str, r: Result<T, wgpu_attention::Error>) -> String {
    match r {
        Ok(_) => panic!("[{backend}] accepted"),
        Err(e) => e.to_string(),
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Self-attention (causal, GQA, an empty sequence, one longer than a query block) and
/// cross-attention (q_lens != kv_lens, no positional mask, sinks) per family, forward and backward;
/// one head dim, so that both cases share their pipelines (each is a compile on a cold cache).
fn cases() -> Vec<Case> {
    vec![
        Case::new(4, 70, 70, 4, 2, 16, 16)
            .causal()
            .q_lens(&[5, 0, 70, 9])
            .kv_lens(&[5, 0, 70, 9]),
        Case::new(3, 8, 13, 2, 2, 16, 16)
            .q_lens(&[3, 8, 1])
            .kv_lens(&[12, 13, 0])
            .sinks(&[0.5, -1.0]),
    ]
}

#[test]
fn packed_forward_and_backward_match_reference_and_padded_kernels() {
    for_each_family(|backend, ctx| {
        for case in cases() {
            check_packed(backend, ctx, &case, true);
        }
    });
}

#[test]
fn packed_tensor_core_family_and_split_keys() {
    for_each_forward_family(|backend, ctx| {
        if ctx.kernel_family() == KernelFamily::Coop {
            check_packed(backend, ctx, &cases()[0], true);
        }
    });
    // Split-KV partials stay padded in scratch; the merge writes the packed rows.
    for_each_backend(|backend, shared| {
        let mut ctx = fresh_context_with_options(backend, shared, |mut opts| {
            opts.forward_splits = Some(3);
            opts
        });
        ctx.set_kernel_family(Some(KernelFamily::Gpu));
        let plan = attention_forward_plan(&ctx, &cases()[0].shape()).unwrap();
        assert_eq!(plan.splits, 3, "[{backend}] {plan}");
        check_packed(&format!("{backend}/split 3"), &ctx, &cases()[0], false);
    });
    // Key loops in chunks (the CPU-driver family under a driver's loop cap) merge into packed O.
    for_each_family_with_loop_budget(2_000, |backend, ctx| {
        check_packed(&format!("{backend}/chunked"), ctx, &cases()[0], true);
    });
}

#[test]
fn allocating_forms_return_packed_tensors() {
    for_each_backend(|backend, ctx| {
        let (q_lens, kv_lens) = ([2u32, 5], [4u32, 1]);
        let lens = SeqLens::packed(ctx, &q_lens, &kv_lens).unwrap();
        let mut r = rng(3);
        let make = |rows: usize, heads: usize, side, r: &mut _| {
            let t =
                GpuTensor::from_slice(ctx, &random(r, rows * heads * 8, 1.0), &[rows, heads, 8])
                    .unwrap();
            let view = t.packed_heads(&lens, side).unwrap();
            (t, view)
        };
        let (_q, q) = make(7, 2, PackedSide::Queries, &mut r);
        let (_k, k) = make(5, 1, PackedSide::Keys, &mut r);
        let (_v, v) = make(5, 1, PackedSide::Keys, &mut r);
        let (_d, d_out) = make(7, 2, PackedSide::Queries, &mut r);
        assert_eq!(
            q.shape(),
            [2, 5, 2, 8],
            "[{backend}] packed view's logical shape"
        );
        let opts = AttentionOptions::new().seq_lens(&lens);
        let fwd = attention_forward(ctx, &q, &k, &v, &opts).unwrap();
        assert_eq!(fwd.out.shape(), [7, 2, 8], "[{backend}] out");
        assert_eq!(fwd.lse.shape(), [2, 2, 5], "[{backend}] lse");
        let grads = attention_backward(ctx, &q, &k, &v, &fwd, &d_out, &opts).unwrap();
        assert_eq!(grads.dq.shape(), [7, 2, 8], "[{backend}] dq");
        assert_eq!(grads.dk.shape(), [5, 1, 8], "[{backend}] dk");
        assert_eq!(grads.dv.shape(), [5, 1, 8], "[{backend}] dv");
        assert!(grads.dq.to_vec(ctx).unwrap().iter().all(|x| x.is_finite()));
    });
}

#[test]
fn misuse_is_refused_with_typed_errors() {
    for_each_backend(|backend, ctx| {
        assert!(refused(backend, SeqLens::packed(ctx, &[1, 2], &[1])).contains("kv_lens"));
        let lens = SeqLens::packed(ctx, &[2, 3], &[2, 3]).unwrap();
        let cross = SeqLens::packed(ctx, &[2, 3], &[4, 1]).unwrap();
        let padded = SeqLens::new(ctx, Some(&[2, 3]), Some(&[2, 3])).unwrap();
        let t = GpuTensor::zeros(ctx, &[5, 2, 8]).unwrap();
        let short = GpuTensor::zeros(ctx, &[4, 2, 8]).unwrap();
        assert!(refused(backend, short.packed_heads(&lens, PackedSide::Queries)).contains("rows"));
        assert!(
            refused(backend, t.packed_heads(&padded, PackedSide::Queries))
                .contains("SeqLens::packed")
        );
        let x = t.packed_heads(&lens, PackedSide::Queries).unwrap();
        assert!(refused(backend, x.first_rows(1)).contains("packed"));
        assert!(refused(backend, x.packed(&lens, PackedSide::Queries)).contains("[1, rows"));
        // Packed views with padded lengths, or none.
        let message = refused(
            backend,
            attention_forward(ctx, &x, &x, &x, &AttentionOptions::new().seq_lens(&padded)),
        );
        assert!(
            message.contains("seq_lens") && message.contains("SeqLens::packed"),
            "{message}"
        );
        let message = refused(
            backend,
            attention_forward(ctx, &x, &x, &x, &AttentionOptions::new()),
        );
        assert!(message.contains("SeqLens::packed"), "{message}");
        // Lengths whose sequences need more rows than a view holds.
        let long = SeqLens::packed(ctx, &[2, 4], &[2, 4]).unwrap();
        let message = refused(
            backend,
            attention_forward(ctx, &x, &x, &x, &AttentionOptions::new().seq_lens(&long)),
        );
        assert!(
            message.contains("beyond") || message.contains("rows"),
            "{message}"
        );
        // Positional masks need q_lens == kv_lens.
        let xq = t.packed_heads(&cross, PackedSide::Queries).unwrap();
        let xk = t.packed_heads(&cross, PackedSide::Keys).unwrap();
        let opts = AttentionOptions::new().seq_lens(&cross);
        attention_forward(ctx, &xq, &xk, &xk, &opts).unwrap();
        let message = refused(
            backend,
            attention_forward(ctx, &xq, &xk, &xk, &opts.causal(true)),
        );
        assert!(message.contains("q_lens == kv_lens"), "{message}");
        // Kernels that take padded views only.
        let message = refused(
            backend,
            attention_decode(ctx, &x, &x, &x, &AttentionOptions::new().seq_lens(&lens)),
        );
        assert!(message.contains("is packed"), "{message}");
        // A view packed on one side passed where the other is read.
        let message = refused(
            backend,
            attention_forward(ctx, &x, &x, &x, &AttentionOptions::new().seq_lens(&lens)),
        );
        assert!(
            message.contains("packed on the lengths' Queries"),
            "{message}"
        );
    });
}

/// A packed prefill through a KV cache: new tokens packed on the queries' side of
/// `SeqLens::packed(new, cached)`, rotated after the cached ones, appended (f32 and int8 caches)
/// and attended by the decode kernel, bit for bit what the padded step computes, without touching
/// the rows after the packed ones.
#[test]
fn packed_prefill_through_the_cache_equals_the_padded_step() {
    use wgpu_attention::kernels::attention::attention_decode_into;
    use wgpu_attention::kernels::attention::PREFILL_FORWARD_ROWS;
    use wgpu_attention::kernels::kv_cache::{kv_cache_append_int8_into, kv_cache_append_into};
    use wgpu_attention::kernels::rope::{rope_forward_cached_into, RopeTable};
    use wgpu_attention::spec::RopeLayout;
    use wgpu_attention::GpuTensorQ8;
    let long = PREFILL_FORWARD_ROWS as u32;
    // A few new rows (the decode kernel), and a prompt chunk long enough for the forward kernels.
    for_each_backend(|backend, ctx| {
        for (new, capacity) in [([4u32, 3, 0], 24), ([long, 20, 0], 80)] {
            let (h, hkv, d) = (4, 2, 16);
            let before = [5u32, 0, 2];
            let kv_lens: Vec<u32> = before.iter().zip(&new).map(|(a, b)| a + b).collect();
            let (b, longest) = (new.len(), new[0] as usize);
            let total = new.iter().sum::<u32>() as usize;
            let mut r = rng(11);
            let q = random(&mut r, b * longest * h * d, 1.0);
            let k = random(&mut r, b * longest * hkv * d, 1.0);
            let v = random(&mut r, b * longest * hkv * d, 1.0);
            let cached_k = random(&mut r, b * capacity * hkv * d, 1.0);
            let cached_v = random(&mut r, b * capacity * hkv * d, 1.0);
            let table = RopeTable::new(ctx, 10000.0, d, RopeLayout::Half, capacity).unwrap();

            // One prefill step, padded or packed: returns O (the sequences' rows, then the margin), the
            // caches after the append, and the int8 cache's words.
            let step = |packed: bool| {
                let lens = match packed {
                    true => SeqLens::packed(ctx, &new, &kv_lens).unwrap(),
                    false => SeqLens::new(ctx, Some(&new), Some(&kv_lens)).unwrap(),
                };
                let upload = |data: &[f32], heads: usize| match packed {
                    true => {
                        let rows = pack(data, &new, longest, heads * d, MARGIN, f32::NAN);
                        let t =
                            GpuTensor::from_slice(ctx, &rows, &[total + MARGIN, heads, d]).unwrap();
                        let view = t.packed_heads(&lens, PackedSide::Queries).unwrap();
                        (t, view)
                    }
                    false => {
                        let t = GpuTensor::from_slice(ctx, data, &[b, longest, heads, d]).unwrap();
                        let view = t.heads().unwrap();
                        (t, view)
                    }
                };
                let (_q, qv) = upload(&q, h);
                let (_k, kv) = upload(&k, hkv);
                let (_v, vv) = upload(&v, hkv);
                let (out, out_view) = match packed {
                    true => {
                        let t = GpuTensor::from_slice(
                            ctx,
                            &vec![SENTINEL; (total + MARGIN) * h * d],
                            &[total + MARGIN, h, d],
                        )
                        .unwrap();
                        let view = t.packed_heads(&lens, PackedSide::Queries).unwrap();
                        (t, view)
                    }
                    false => {
                        let t = GpuTensor::zeros(ctx, &[b, longest, h, d]).unwrap();
                        let view = t.heads().unwrap();
                        (t, view)
                    }
                };
                let cache_k =
                    GpuTensor::from_slice(ctx, &cached_k, &[b, capacity, hkv, d]).unwrap();
                let cache_v =
                    GpuTensor::from_slice(ctx, &cached_v, &[b, capacity, hkv, d]).unwrap();
                let cache_q8 = GpuTensorQ8::zeros(ctx, &[b, capacity, hkv, d]).unwrap();
                let lse = GpuTensor::zeros(ctx, &[b, h, longest]).unwrap();
                let mut encoder = ctx.device().create_command_encoder(&Default::default());
                rope_forward_cached_into(ctx, &mut encoder, &qv, &table, &lens).unwrap();
                rope_forward_cached_into(ctx, &mut encoder, &kv, &table, &lens).unwrap();
                kv_cache_append_into(ctx, &mut encoder, &kv, &cache_k, &lens).unwrap();
                kv_cache_append_into(ctx, &mut encoder, &vv, &cache_v, &lens).unwrap();
                kv_cache_append_int8_into(ctx, &mut encoder, &kv, &cache_q8, None, &lens).unwrap();
                let (kc, vc) = (cache_k.heads().unwrap(), cache_v.heads().unwrap());
                let opts = AttentionOptions::new().causal(true).seq_lens(&lens);
                attention_decode_into(
                    ctx,
                    &mut encoder,
                    &ForwardViews {
                        q: &qv,
                        k: &kc,
                        v: &vc,
                        out: &out_view,
                        lse: &lse,
                    },
                    &opts,
                )
                .unwrap_or_else(|e| panic!("[{backend}] packed {packed}: {e}"));
                ctx.queue().submit([encoder.finish()]);
                let out = out.to_vec(ctx).unwrap();
                let out = match packed {
                    true => out,
                    false => pack(&out, &new, longest, h * d, 0, 0.0),
                };
                (
                    out,
                    cache_k.to_vec(ctx).unwrap(),
                    cache_v.to_vec(ctx).unwrap(),
                    cache_q8.to_words(ctx).unwrap(),
                )
            };
            let padded = step(false);
            let packed = step(true);
            let rows = total * h * d;
            assert_eq!(
                bits(&packed.0[..rows]),
                bits(&padded.0),
                "[{backend}] prefill out"
            );
            assert!(
                packed.0[rows..].iter().all(|&x| x == SENTINEL),
                "[{backend}] out written past the packed rows"
            );
            assert_eq!(bits(&packed.1), bits(&padded.1), "[{backend}] k cache");
            assert_eq!(bits(&packed.2), bits(&padded.2), "[{backend}] v cache");
            assert_eq!(packed.3, padded.3, "[{backend}] int8 k cache");
            assert!(padded.0.iter().any(|&x| x != 0.0));
        }
    });
}
