//! NaN reaches exactly what depends on it, as in the f64 reference (README, "NaN and infinity"): a
//! NaN in a query row makes that row's O and lse NaN (never "fully masked"), a NaN in a visible key
//! or value reaches the rows that see it and only those, and masked or padded positions never
//! contaminate. Forward, backward, decode and additive attention, both kernel families, both back
//! ends.

use crate::common;

use common::*;
use wgpu_attention::reference::additive as additive_reference;
use wgpu_attention::reference::attention::{self as reference, Masks};
use wgpu_attention::{
    additive_backward, additive_forward, attention_backward, attention_decode, attention_forward,
    AdditiveScores, Context, ForwardViews, GpuTensor, KernelFamily,
};

/// The GPU result has NaN exactly where the reference has, and is close to it elsewhere;
/// `expect_nan` (where given) says whether the reference itself must hold a NaN, so the case tests
/// something.
fn check(what: &str, gpu: &[f32], reference: &[f64], expect_nan: Option<bool>, atol: f64) {
    assert_eq!(gpu.len(), reference.len(), "{what}: length");
    if let Some(expected) = expect_nan {
        assert_eq!(
            reference.iter().any(|x| x.is_nan()),
            expected,
            "{what}: the reference's NaNs"
        );
    }
    for (n, (&g, &r)) in gpu.iter().zip(reference).enumerate() {
        assert_eq!(
            g.is_nan(),
            r.is_nan(),
            "{what}[{n}]: gpu {g}, reference {r}"
        );
        if r.is_finite() {
            assert!(
                (f64::from(g) - r).abs() <= atol + 1e-3 * r.abs(),
                "{what}[{n}]: gpu {g}, reference {r}"
            );
        } else if !r.is_nan() {
            assert_eq!(f64::from(g), r, "{what}[{n}]");
        }
    }
}

/// Where a NaN goes into a case's data: (tensor, batch, position, head, dim).
#[derive(Clone, Copy, Debug)]
enum Poison {
    Q(usize, usize, usize),
    K(usize, usize, usize),
    V(usize, usize, usize),
    DOut(usize, usize, usize),
    /// Every key and value of a batch entry at positions `from..` (padding past kv_lens).
    KvFrom(usize, usize),
    /// Every query of a batch entry at positions `from..` (padding past q_lens).
    QFrom(usize, usize),
}

fn poisoned(case: &Case, poison: &[Poison]) -> [Vec<f32>; 4] {
    let (mut q, mut k, mut v, mut d_out) = case.data();
    // Batch entry 0 unless the poison names one.
    let at = |h: usize, d: usize, pos: usize, head: usize, dim: usize| (pos * h + head) * d + dim;
    for &p in poison {
        match p {
            Poison::Q(i, h, d) => q[at(case.h, case.dk, i, h, d)] = f32::NAN,
            Poison::K(j, h, d) => k[at(case.hkv, case.dk, j, h, d)] = f32::NAN,
            Poison::V(j, h, d) => v[at(case.hkv, case.dv, j, h, d)] = f32::NAN,
            Poison::DOut(i, h, d) => d_out[at(case.h, case.dv, i, h, d)] = f32::NAN,
            Poison::KvFrom(b, from) => {
                let (kr, vr) = (case.hkv * case.dk, case.hkv * case.dv);
                k[(b * case.lk + from) * kr..(b + 1) * case.lk * kr].fill(f32::NAN);
                v[(b * case.lk + from) * vr..(b + 1) * case.lk * vr].fill(f32::NAN);
            }
            Poison::QFrom(b, from) => {
                let r = case.h * case.dk;
                q[(b * case.lq + from) * r..(b + 1) * case.lq * r].fill(f32::NAN)
            }
        }
    }
    [q, k, v, d_out]
}

/// Forward and backward of `case` (batch 1) with `poison`, against the reference; `expect_nan`:
/// whether (out/lse, gradients) must hold a NaN.
fn run(ctx: &Context, name: &str, case: &Case, poison: &[Poison], expect_nan: (bool, bool)) {
    let [q, k, v, d_out] = poisoned(case, poison);
    let up = |x: &[f32], shape| upload(ctx, x, shape);
    let qv = up(&q, [case.b, case.lq, case.h, case.dk]);
    let kv = up(&k, [case.b, case.lk, case.hkv, case.dk]);
    let vv = up(&v, [case.b, case.lk, case.hkv, case.dv]);
    let dov = up(&d_out, [case.b, case.lq, case.h, case.dv]);
    let buffers = case.buffers(ctx);
    let opts = case.options(&buffers);
    let what = format!("[{name}] {} {poison:?}", case.label());
    let fwd = attention_forward(ctx, &qv, &kv, &vv, &opts).unwrap();
    let (s, m) = (case.shape(), case.masks());
    let (q, k, v, d_out) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&d_out));
    let (ref_out, ref_lse) = reference::attention_forward(&s, &q, &k, &v, &m);
    let out = fwd.out.to_vec(ctx).unwrap();
    // The tensor-core family rounds to f16 (its backward starts from that forward).
    let (forward_atol, backward_atol) = match ctx.kernel_family() {
        KernelFamily::Coop => (forward_tolerances(ctx).0, forward_tolerances(ctx).0),
        _ => (1e-4, 1e-3),
    };
    check(
        &format!("{what} out"),
        &out,
        &ref_out,
        Some(expect_nan.0),
        forward_atol,
    );
    let lse = fwd.lse.to_vec(ctx).unwrap();
    check(&format!("{what} lse"), &lse, &ref_lse, None, forward_atol);
    let grads = attention_backward(ctx, &qv, &kv, &vv, &fwd, &dov, &opts).unwrap();
    let expected = reference::attention_backward(&s, &q, &k, &v, &d_out, &m);
    let nan = expect_nan.1;
    let dq = grads.dq.to_vec(ctx).unwrap();
    let dk = grads.dk.to_vec(ctx).unwrap();
    let dv = grads.dv.to_vec(ctx).unwrap();
    // Each gradient may or may not hold one; together they must.
    let any = |x: &[f64]| x.iter().any(|v| v.is_nan());
    assert_eq!(
        any(&expected.dq) || any(&expected.dk) || any(&expected.dv),
        nan,
        "{what}: the reference gradients' NaNs"
    );
    for (grad, gpu, reference) in [
        ("dq", &dq, &expected.dq),
        ("dk", &dk, &expected.dk),
        ("dv", &dv, &expected.dv),
    ] {
        check(
            &format!("{what} {grad}"),
            gpu,
            reference,
            None,
            backward_atol,
        );
    }
}

#[test]
fn nan_reaches_exactly_the_rows_that_see_it() {
    for_each_forward_family(|name, ctx| {
        // Causal, 9 rows (odd: a partial tile), two heads; NaNs in head 0 only.
        let causal = Case::new(1, 9, 9, 2, 2, 8, 8).causal();
        // A NaN query row: that row's O and lse are NaN, never "fully masked"; its gradients and
        // those of the keys it sees, NaN.
        run(ctx, name, &causal, &[Poison::Q(3, 0, 0)], (true, true));
        // A NaN value at key 5: rows 5.. see it, rows 0..5 stay finite (they skip it).
        run(ctx, name, &causal, &[Poison::V(5, 0, 2)], (true, true));
        // A NaN key at 2: the scores of rows 2.. are NaN, rows 0 and 1 finite, in both passes.
        run(ctx, name, &causal, &[Poison::K(2, 0, 1)], (true, true));
        // A NaN output gradient at row 1: dQ of row 1 and dK, dV of keys 0 and 1 only.
        run(ctx, name, &causal, &[Poison::DOut(1, 0, 3)], (false, true));
        // Padded keys and queries full of NaN: nothing is NaN (O = 0 and lse = -inf on padded rows).
        let padded = Case::new(1, 9, 9, 2, 2, 8, 8).q_lens(&[6]).kv_lens(&[5]);
        run(
            ctx,
            name,
            &padded,
            &[Poison::KvFrom(0, 5), Poison::QFrom(0, 6)],
            (false, false),
        );
        // Softcap: a NaN score stays NaN through the cap.
        let mut capped = Case::new(1, 9, 9, 2, 2, 8, 8).causal();
        capped.softcap = Some(5.0);
        run(ctx, name, &capped, &[Poison::K(4, 1, 2)], (true, true));
        // A window: keys outside every row's window hold NaN values only they would read.
        let mut window = Case::new(1, 9, 9, 2, 2, 8, 8);
        window.window = Some((1, 0));
        run(ctx, name, &window, &[Poison::V(7, 0, 0)], (true, true));
    });
}

/// dQ added with atomics by the dK/dV kernels (`ContextOptions::atomic_gradients`, the GPU and
/// tensor-core families where the device has f32 atomics): a NaN key reaches the dQ of the rows
/// that see it and only those (the multiply-adds would spread it to every row of the tile: the
/// tensor-core build adds such a block in scalar arithmetic), as do a NaN value and output gradient.
#[test]
fn atomic_dq_reaches_exactly_the_rows_that_see_it() {
    for_each_forward_family_with_options(
        |opts| opts.atomic_gradients(true),
        |name, ctx| {
            if name.ends_with("/cpu") || !ctx.atomic_gradients() {
                return;
            }
            let causal = Case::new(1, 9, 9, 2, 2, 8, 8).causal();
            run(ctx, name, &causal, &[Poison::K(2, 0, 1)], (true, true));
            run(ctx, name, &causal, &[Poison::V(5, 0, 2)], (true, true));
            run(ctx, name, &causal, &[Poison::DOut(1, 0, 3)], (false, true));
        },
    );
}

#[test]
fn decode_skips_what_its_queries_do_not_see() {
    for_each_family(|name, ctx| {
        // Two new queries per sequence against a cache of 8 with 6 and 4 entries.
        let mut case = Case::new(2, 2, 8, 2, 1, 8, 8).causal();
        case.q_lens = Some(vec![2, 1]);
        case.kv_lens = Some(vec![6, 4]);
        for (poison, expect_nan) in [
            // Past every sequence's cached length: never read.
            (vec![Poison::KvFrom(0, 6), Poison::KvFrom(1, 4)], false),
            // Key 5 of sequence 0 is the last new query's own position: the first new query (at
            // position 4) does not see it, the second does.
            (vec![Poison::V(5, 0, 1)], true),
        ] {
            let [q, k, v, _] = poisoned(&case, &poison);
            let up = |x: &[f32], shape| upload(ctx, x, shape);
            let qv = up(&q, [2, 2, 2, 8]);
            let kv = up(&k, [2, 8, 1, 8]);
            let vv = up(&v, [2, 8, 1, 8]);
            let buffers = case.buffers(ctx);
            let out = attention_decode(ctx, &qv, &kv, &vv, &case.options(&buffers)).unwrap();
            let masks = Masks {
                q_lens: None,
                kv_lens: None,
                ..case.masks()
            };
            let (ref_out, ref_lse) = reference::attention_decode(
                &case.shape(),
                &to_f64(&q),
                &to_f64(&k),
                &to_f64(&v),
                &[2, 1],
                &[6, 4],
                &masks,
            );
            let what = format!("[{name}] decode {poison:?}");
            let o = out.out.to_vec(ctx).unwrap();
            check(&format!("{what} out"), &o, &ref_out, Some(expect_nan), 1e-4);
            let lse = out.lse.to_vec(ctx).unwrap();
            check(&format!("{what} lse"), &lse, &ref_lse, None, 1e-4);
        }
    });
}

#[test]
fn additive_attention_skips_what_its_rows_do_not_see() {
    // Both families; dims of 16 put each row over two lanes in the GPU family's backward.
    for_each_family(|name, ctx| {
        let case = Case::new(1, 9, 9, 2, 2, 16, 16).causal();
        let mut r = rng(5);
        let (w, bias) = (random(&mut r, 32, 1.0), random(&mut r, 32, 0.5));
        let wt = GpuTensor::from_slice(ctx, &w, &[2, 16]).unwrap();
        let bt = GpuTensor::from_slice(ctx, &bias, &[2, 16]).unwrap();
        let scores = AdditiveScores { w: &wt, bias: &bt };
        let masks = Masks {
            scale: 1.0,
            causal: true,
            ..Default::default()
        };
        for (poison, nan) in [
            (vec![Poison::V(5, 0, 2)], true),
            (vec![Poison::K(6, 1, 0)], true),
            (vec![Poison::Q(2, 0, 0)], true),
            (vec![Poison::DOut(1, 0, 3)], false),
        ] {
            let [a, b, v, d_out] = poisoned(&case, &poison);
            let up = |x: &[f32]| upload(ctx, x, [1, 9, 2, 16]);
            let (av, bv, vv, dov) = (up(&a), up(&b), up(&v), up(&d_out));
            let buffers = case.buffers(ctx);
            let opts = case.options(&buffers).scale(1.0);
            let what = format!("[{name}] additive {poison:?}");
            let fwd = additive_forward(ctx, &av, &bv, &vv, scores, &opts).unwrap();
            let s = case.shape();
            let (a, b, v) = (to_f64(&a), to_f64(&b), to_f64(&v));
            let (w64, bias64) = (to_f64(&w), to_f64(&bias));
            let scores64 = additive_reference::ScoreParams {
                w: &w64,
                bias: &bias64,
            };
            let (ref_out, ref_lse) =
                additive_reference::additive_forward(&s, &a, &b, &v, scores64, &masks);
            let out = fwd.out.to_vec(ctx).unwrap();
            check(&format!("{what} out"), &out, &ref_out, Some(nan), 1e-4);
            let lse = fwd.lse.to_vec(ctx).unwrap();
            check(&format!("{what} lse"), &lse, &ref_lse, None, 1e-4);
            let grads = additive_backward(
                ctx,
                &ForwardViews {
                    q: &av,
                    k: &bv,
                    v: &vv,
                    out: &fwd.out.heads().unwrap(),
                    lse: &fwd.lse,
                },
                scores,
                &dov,
                &opts,
            )
            .unwrap();
            let expected = additive_reference::additive_backward(
                &s,
                &a,
                &b,
                &v,
                scores64,
                &to_f64(&d_out),
                &masks,
            );
            for (grad, gpu, reference) in [
                ("da", &grads.da, &expected.da),
                ("db", &grads.db, &expected.db),
                ("dv", &grads.dv, &expected.dv),
            ] {
                let g = gpu.to_vec(ctx).unwrap();
                check(&format!("{what} {grad}"), &g, reference, None, 1e-3);
            }
            // The dO case: only the gradients of the keys row 1 sees are NaN.
            if !nan {
                let db = grads.db.to_vec(ctx).unwrap();
                assert!(
                    db[..2 * 2 * 16].iter().any(|x| x.is_nan()),
                    "{what}: db of keys 0, 1"
                );
                assert!(
                    db[2 * 2 * 16..].iter().all(|x| x.is_finite()),
                    "{what}: db of keys 2.."
                );
            }
        }
    });
}
