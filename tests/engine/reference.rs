//! The CPU reference checked on its own: its backward against central finite differences of its
//! forward in f64, and its forward against cases with known answers. No GPU needed.

use crate::common;

use common::*;
use wgpu_attention::reference::attention as reference;

/// Largest |analytic - numeric| / max(1, |numeric|) over every input element.
fn finite_difference_error(case: &Case) -> f64 {
    let s = case.shape();
    let masks = case.masks();
    let (q, k, v, d_out) = case.data();
    let (q, k, v, d_out) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&d_out));
    let grads = reference::attention_backward(&s, &q, &k, &v, &d_out, &masks);
    // Scalar loss L = <dO, O>, whose gradient is what the backward computes.
    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        let (out, _) = reference::attention_forward(&s, q, k, v, &masks);
        out.iter().zip(&d_out).map(|(o, d)| o * d).sum()
    };
    let eps = 1e-6;
    let mut worst = 0.0f64;
    for which in 0..3 {
        let analytic = [&grads.dq, &grads.dk, &grads.dv][which];
        let n = [q.len(), k.len(), v.len()][which];
        for i in 0..n {
            let (mut qp, mut kp, mut vp) = (q.clone(), k.clone(), v.clone());
            let (mut qm, mut km, mut vm) = (q.clone(), k.clone(), v.clone());
            match which {
                0 => {
                    qp[i] += eps;
                    qm[i] -= eps;
                }
                1 => {
                    kp[i] += eps;
                    km[i] -= eps;
                }
                _ => {
                    vp[i] += eps;
                    vm[i] -= eps;
                }
            }
            let numeric = (loss(&qp, &kp, &vp) - loss(&qm, &km, &vm)) / (2.0 * eps);
            let err = (analytic[i] - numeric).abs() / numeric.abs().max(1.0);
            worst = worst.max(err);
        }
    }
    worst
}

#[test]
fn backward_matches_finite_differences() {
    let cases = [
        Case::new(1, 5, 7, 2, 2, 4, 3),
        Case::new(2, 6, 6, 4, 2, 5, 4).causal(),
        Case::new(2, 7, 4, 2, 1, 3, 6).causal().kv_lens(&[4, 2]),
        Case::new(2, 5, 6, 2, 2, 4, 4)
            .q_lens(&[3, 5])
            .kv_lens(&[6, 0]),
        Case::new(1, 4, 5, 2, 1, 4, 4)
            .magnitude(4.0)
            .temperature(0.5),
        // Score modifiers: softcap where it bends (|s| ~ cap), ALiBi with 3 heads (not a power
        // of two), and both under masks.
        Case::new(1, 5, 7, 2, 2, 4, 3).magnitude(3.0).softcap(1.5),
        Case::new(2, 6, 5, 3, 3, 4, 4).alibi(),
        Case::new(2, 6, 5, 3, 3, 4, 4).alibi_slopes(&[0.7, -0.2, 0.0]),
        Case::new(2, 6, 6, 4, 2, 5, 4)
            .magnitude(3.0)
            .softcap(2.0)
            .alibi()
            .causal()
            .kv_lens(&[6, 3]),
        // Sliding windows: causal, two-sided across Lq != Lk, with ALiBi.
        Case::new(2, 6, 6, 2, 1, 4, 4).causal().window(2, 0),
        Case::new(1, 4, 7, 2, 2, 3, 3).window(1, 2).alibi(),
        // Sinks, with padding (a batch with one key) and causal.
        Case::new(2, 5, 6, 2, 1, 4, 3)
            .causal()
            .kv_lens(&[6, 1])
            .sinks(&[0.5, 2.0]),
        // Cosine scores and key clipping (a clip that binds on some keys only), together.
        Case::new(1, 5, 7, 2, 2, 4, 3).cosine(5.0),
        Case::new(2, 5, 6, 2, 1, 4, 4).magnitude(1.5).key_clip(2.0),
        Case::new(1, 6, 6, 2, 2, 5, 4)
            .cosine(6.0)
            .key_clip(0.7)
            .causal(),
        Case::new(2, 5, 6, 2, 1, 4, 3).cosine_learned(&[5.0, -1.5]),
        // Additive terms: a bias broadcast over the batch with -inf entries and softcap; T5
        // relative buckets, both directions, with ALiBi.
        Case::new(2, 5, 6, 2, 1, 4, 3)
            .magnitude(2.0)
            .softcap(2.0)
            .bias(bias_case(1, 2)),
        Case::new(2, 6, 7, 2, 2, 4, 4)
            .causal()
            .alibi()
            .relative(8, 6, true),
    ];
    for case in &cases {
        let err = finite_difference_error(case);
        println!(
            "reference backward vs finite differences, {}: worst relative error {err:.3e}",
            case.label()
        );
        assert!(err < 1e-7, "{}: {err}", case.label());
    }
}

#[test]
fn sink_gradient_matches_finite_differences() {
    for case in [
        Case::new(2, 5, 6, 3, 3, 4, 3).sinks(&[0.5, -1.0, 2.0]),
        Case::new(2, 6, 6, 2, 1, 4, 4)
            .causal()
            .q_lens(&[4, 6])
            .kv_lens(&[6, 2])
            .magnitude(2.0)
            .softcap(2.0)
            .sinks(&[3.0, -0.5]),
    ] {
        let s = case.shape();
        let (q, k, v, d_out) = case.data();
        let (q, k, v, d_out) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&d_out));
        let masks = case.masks();
        let grads = reference::attention_backward(&s, &q, &k, &v, &d_out, &masks);
        let loss = |sinks: Vec<f64>| -> f64 {
            let m = reference::Masks {
                sinks: Some(sinks),
                ..masks.clone()
            };
            let (out, _) = reference::attention_forward(&s, &q, &k, &v, &m);
            out.iter().zip(&d_out).map(|(o, d)| o * d).sum()
        };
        let sinks = masks.sinks.clone().unwrap();
        let eps = 1e-6;
        let mut worst = 0.0f64;
        for h in 0..sinks.len() {
            let (mut plus, mut minus) = (sinks.clone(), sinks.clone());
            plus[h] += eps;
            minus[h] -= eps;
            let numeric = (loss(plus) - loss(minus)) / (2.0 * eps);
            worst = worst.max((grads.dsinks[h] - numeric).abs() / numeric.abs().max(1.0));
        }
        println!(
            "reference dsinks vs finite differences, {}: worst relative error {worst:.3e}",
            case.label()
        );
        assert!(worst < 1e-7, "{}: {worst}", case.label());
    }
}

fn bias_case(batch: usize, heads: usize) -> BiasCase {
    BiasCase {
        batch,
        heads,
        learnable: true,
        masked_every: 4,
        strided: false,
    }
}

/// Worst relative error, |analytic - numeric| / max(1, |numeric|), of the gradient to the case's
/// bias values, relative table or learned cosine scales, against central differences of
/// L = <dO, O>.
fn learned_term_error(case: &Case) -> f64 {
    let s = case.shape();
    let (q, k, v, d_out) = case.data();
    let (q, k, v, d_out) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&d_out));
    let masks = case.masks();
    let grads = reference::attention_backward(&s, &q, &k, &v, &d_out, &masks);
    let relative = masks.relative.is_some();
    let (values, analytic) = match (&masks.bias, &masks.relative, &masks.cosine_scales) {
        (Some(bias), _, _) => (bias.values.clone(), grads.dbias.clone()),
        (None, Some((_, table)), _) => (table.clone(), grads.drelative.clone()),
        (None, None, Some(scales)) => (scales.clone(), grads.dcosine.clone()),
        _ => unreachable!(),
    };
    let loss = |values: &[f64]| -> f64 {
        let mut m = masks.clone();
        match (&mut m.bias, &mut m.relative, &mut m.cosine_scales) {
            (Some(bias), _, _) => bias.values = values.to_vec(),
            (None, Some(r), _) => r.1 = values.to_vec(),
            (None, None, Some(scales)) => *scales = values.to_vec(),
            _ => unreachable!(),
        }
        let (out, _) = reference::attention_forward(&s, &q, &k, &v, &m);
        out.iter().zip(&d_out).map(|(o, d)| o * d).sum()
    };
    let eps = 1e-6;
    let mut worst = 0.0f64;
    for i in 0..values.len() {
        if values[i] == f64::NEG_INFINITY {
            // A masked pair: no gradient.
            assert_eq!(analytic[i], 0.0);
            continue;
        }
        let (mut plus, mut minus) = (values.clone(), values.clone());
        plus[i] += eps;
        minus[i] -= eps;
        let numeric = (loss(&plus) - loss(&minus)) / (2.0 * eps);
        worst = worst.max((analytic[i] - numeric).abs() / numeric.abs().max(1.0));
    }
    assert!(relative || analytic.iter().any(|&g| g != 0.0));
    worst
}

#[test]
fn bias_and_relative_table_gradients_match_finite_differences() {
    for case in [
        Case::new(2, 5, 6, 2, 1, 4, 3).bias(bias_case(2, 2)),
        Case::new(3, 4, 6, 2, 2, 3, 3)
            .causal()
            .kv_lens(&[6, 2, 4])
            .magnitude(2.0)
            .softcap(1.5)
            .bias(bias_case(1, 1)),
        Case::new(2, 5, 5, 4, 2, 4, 4)
            .window(1, 1)
            .bias(bias_case(2, 1)),
        Case::new(2, 6, 9, 2, 1, 4, 3).relative(8, 6, true),
        Case::new(2, 7, 7, 3, 3, 4, 4)
            .causal()
            .q_lens(&[7, 4])
            .sinks(&[0.5, -1.0, 1.0])
            .relative(6, 5, false),
        // Learned cosine scales, with key clipping and padding.
        Case::new(2, 5, 6, 3, 1, 4, 3)
            .magnitude(1.5)
            .key_clip(0.6)
            .kv_lens(&[6, 3])
            .cosine_learned(&[4.0, -2.0, 7.0]),
    ] {
        let worst = learned_term_error(&case);
        println!(
            "reference bias/table gradient vs finite differences, {}: worst relative error {worst:.3e}",
            case.label()
        );
        assert!(worst < 1e-7, "{}: {worst}", case.label());
    }
}

#[test]
fn relative_bucket_known_answers() {
    // T5's defaults (Raffel et al.; Hugging Face T5Attention): 32 buckets, 128 max distance.
    let t5 = reference::RelativeConfig {
        buckets: 32,
        max_distance: 128,
        bidirectional: true,
    };
    let bucket = |delta| reference::relative_position_bucket(delta, t5);
    // Keys before the query: distances 0..8 exact, then log-spaced, the last (15) from 128 on.
    assert_eq!(
        [bucket(0), bucket(-1), bucket(-7), bucket(-8)],
        [0, 1, 7, 8]
    );
    // 8 + floor(ln(n / 8) / ln(16) * 8): n = 12 -> 9.17, 90 -> 14.98, 100 -> 15.29 (capped).
    assert_eq!([bucket(-12), bucket(-90), bucket(-100)], [9, 14, 15]);
    assert_eq!([bucket(-128), bucket(-100_000)], [15, 15]);
    // Keys after it: the upper half.
    assert_eq!(
        [bucket(1), bucket(7), bucket(12), bucket(100_000)],
        [17, 23, 25, 31]
    );
    // One direction (a causal decoder): 32 buckets for keys before the query, 16 exact; keys after
    // it share bucket 0.
    let causal = reference::RelativeConfig {
        bidirectional: false,
        ..t5
    };
    let bucket = |delta| reference::relative_position_bucket(delta, causal);
    assert_eq!(
        [bucket(3), bucket(0), bucket(-15), bucket(-16)],
        [0, 0, 15, 16]
    );
    // 16 + floor(ln(n / 16) / ln(8) * 16): n = 100 -> 30.1, 127 -> 31.9.
    assert_eq!([bucket(-100), bucket(-127), bucket(-5000)], [30, 31, 31]);
}

#[test]
fn score_modifier_known_answers() {
    // ALiBi slopes: the geometric sequence for 8 heads, and 6 heads = the 4-head slopes then every
    // other slope of the 8-head sequence (Press et al.).
    let eight: Vec<f64> = (0..8).map(|h| reference::alibi_slope(h, 8)).collect();
    let expected: Vec<f64> = (1..=8).map(|i| 0.5f64.powi(i)).collect();
    assert_eq!(eight, expected);
    let six: Vec<f64> = (0..6).map(|h| reference::alibi_slope(h, 6)).collect();
    assert_eq!(six, [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]);

    // Softcap and ALiBi of a score: cap tanh(s / cap) - slope |i + Lk - Lq - j|, derivative
    // 1 - tanh^2.
    let case = Case::new(1, 2, 4, 2, 2, 1, 1).softcap(2.0).alibi();
    let masks = case.masks();
    let (x, grad) = masks.modify(&case.shape(), 0, 1, 0, 3, 1.0);
    let t = 0.5f64.tanh();
    assert!((x - (2.0 * t - 0.00390625)).abs() < 1e-15, "{x}");
    assert!((grad - (1.0 - t * t)).abs() < 1e-15, "{grad}");
}

#[test]
fn forward_known_answers() {
    // Identical keys: uniform attention, O is the mean of the visible values, lse = s + ln(n).
    let case = Case::new(1, 3, 4, 1, 1, 2, 2).causal();
    let s = case.shape();
    let q = vec![0.5, -1.0, 2.0, 0.0, 1.0, 1.0];
    let k = vec![1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
    let v = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
    let masks = reference::Masks {
        scale: 1.0,
        causal: true,
        q_lens: None,
        kv_lens: None,
        ..Default::default()
    };
    let (out, lse) = reference::attention_forward(&s, &q, &k, &v, &masks);
    // Bottom-right causal with Lq = 3, Lk = 4: row i sees keys 0..=i+1.
    let expected_out = [2.0, 3.0, 3.0, 4.0, 4.0, 5.0];
    for (o, e) in out.iter().zip(expected_out) {
        assert!((o - e).abs() < 1e-12, "{out:?}");
    }
    let expected_lse = [-0.5 + 2f64.ln(), 2.0 + 3f64.ln(), 2.0 + 4f64.ln()];
    for (l, e) in lse.iter().zip(expected_lse) {
        assert!((l - e).abs() < 1e-12, "{lse:?}");
    }
    // A row with no visible key: O = 0, lse = -inf.
    let masks = reference::Masks {
        kv_lens: Some(vec![0]),
        ..masks
    };
    let (out, lse) = reference::attention_forward(&s, &q, &k, &v, &masks);
    assert!(out.iter().all(|&x| x == 0.0));
    assert!(lse.iter().all(|&x| x == f64::NEG_INFINITY));
}

#[test]
fn large_logits_do_not_overflow() {
    let case = Case::new(1, 4, 4, 1, 1, 4, 4).magnitude(30.0);
    let (q, k, v, _) = case.data();
    let (out, lse) = reference::attention_forward(
        &case.shape(),
        &to_f64(&q),
        &to_f64(&k),
        &to_f64(&v),
        &case.masks(),
    );
    assert!(
        lse.iter().all(|x| x.is_finite()) && lse.iter().any(|x| x.abs() > 80.0),
        "{lse:?}"
    );
    assert!(out.iter().all(|x| x.is_finite()));
}
