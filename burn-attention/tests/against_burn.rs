//! The fused op against burn's own unfused attention under burn's autodiff: values and gradients
//! of every input, each mask and modifier, GQA, Dk != Dv, strided inputs; on Vulkan and GL.

mod common;

use burn::tensor::{module::attention, ops::AttentionModuleOptions, Device, Tensor};
use burn_attention::{fused_attention, FusedAttentionOptions, RelativeBuckets};
use common::*;

/// Runs the fused op and `reference` on the same tracked inputs with the same upstream gradient
/// and compares the output and the gradient of each tensor in `tracked` (name, tensor).
fn compare(
    label: &str,
    device: &Device,
    (q, k, v): (Tensor<4>, Tensor<4>, Tensor<4>),
    options: &FusedAttentionOptions,
    reference: impl Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
    extra: &[(&str, Param)],
) {
    let out = fused_attention(q.clone(), k.clone(), v.clone(), options).expect("fused attention");
    let want = reference(q.clone(), k.clone(), v.clone());
    assert_eq!(out.dims(), want.dims(), "{label}: output shape");
    let upstream = input(out.dims(), device).detach();
    let (rf, af) = FORWARD;
    assert_close(
        &format!("{label} out"),
        &values(out.clone()),
        &values(want.clone()),
        rf,
        af,
    );
    let grads = (out * upstream.clone()).sum().backward();
    let grads_ref = (want * upstream).sum().backward();
    let (rb, ab) = BACKWARD;
    for (name, t) in [("dq", &q), ("dk", &k), ("dv", &v)] {
        let got = t
            .grad(&grads)
            .unwrap_or_else(|| panic!("{label}: no {name}"));
        let want = t.grad(&grads_ref).expect("burn's gradient");
        assert_close(
            &format!("{label} {name}"),
            &values(got),
            &values(want),
            rb,
            ab,
        );
    }
    for (name, t) in extra {
        let (got, want) = match t {
            Param::Vector(t) => (t.grad(&grads).map(values), t.grad(&grads_ref).map(values)),
            Param::Matrix(t) => (t.grad(&grads).map(values), t.grad(&grads_ref).map(values)),
        };
        let got = got.unwrap_or_else(|| panic!("{label}: no {name}"));
        assert_close(
            &format!("{label} {name}"),
            &got,
            &want.expect("burn's gradient"),
            rb,
            ab,
        );
    }
}

/// A learnable score term whose gradient is compared too.
enum Param {
    Vector(Tensor<1>),
    Matrix(Tensor<2>),
}

fn qkv(
    device: &Device,
    [b, h, hkv, lq, lk, dk, dv]: [usize; 7],
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    (
        input([b, h, lq, dk], device),
        input([b, hkv, lk, dk], device),
        input([b, hkv, lk, dv], device),
    )
}

#[test]
fn matches_burn_attention_op() {
    for (name, device, _serial) in devices() {
        let device = device.autodiff();
        let options = AttentionModuleOptions {
            is_causal: true,
            softcap: Some(20.0),
            scale: Some(0.3),
        };
        compare(
            &format!("{name} burn::attention causal softcap scale"),
            &device,
            qkv(&device, [2, 3, 3, 37, 37, 16, 16]),
            &FusedAttentionOptions::new()
                .causal(true)
                .softcap(20.0)
                .scale(0.3),
            |q, k, v| attention(q, k, v, None, None, options),
            &[],
        );
    }
}

#[test]
fn cross_attention_gqa_and_value_width() {
    for (name, device, _serial) in devices() {
        let device = device.autodiff();
        // Lq < Lk with a bottom-right causal mask, 4 query heads on 2 kv heads, Dv != Dk.
        compare(
            &format!("{name} gqa causal cross"),
            &device,
            qkv(&device, [2, 4, 2, 19, 45, 16, 8]),
            &FusedAttentionOptions::new().causal(true),
            |q, k, v| {
                let r = Reference {
                    causal: true,
                    ..Default::default()
                };
                reference(q, k, v, &r)
            },
            &[],
        );
    }
}

#[test]
fn padding_by_lengths() {
    for (name, device, _serial) in devices() {
        let device = device.autodiff();
        let [b, h, l, d] = [3, 2, 29, 16];
        let (kv_lens, q_lens) = ([29u32, 11, 1], [29u32, 20, 7]);
        let masked = mask([b, h, l, l], &device, |b, _, j| j >= kv_lens[b] as usize);
        let keep: Vec<f32> = (0..b * l)
            .map(|x| ((x % l) < q_lens[x / l] as usize) as u8 as f32)
            .collect();
        let row_keep =
            Tensor::<4>::from_data(burn::tensor::TensorData::new(keep, [b, 1, l, 1]), &device);
        compare(
            &format!("{name} kv_lens q_lens"),
            &device,
            qkv(&device, [b, h, h, l, l, d, d]),
            &FusedAttentionOptions::new().kv_lens(kv_lens).q_lens(q_lens),
            |q, k, v| {
                let r = Reference {
                    mask: Some(masked.clone()),
                    row_keep: Some(row_keep.clone()),
                    ..Default::default()
                };
                reference(q, k, v, &r)
            },
            &[],
        );
    }
}

#[test]
fn learnable_bias_and_sinks() {
    for (name, device, _serial) in devices() {
        let device = device.autodiff();
        let [b, h, l, d] = [2, 3, 21, 16];
        // A bias broadcast over the batch; its gradient is reduced over it.
        let bias = input([1, h, l, l], &device);
        let sinks = input([h], &device);
        compare(
            &format!("{name} bias sinks"),
            &device,
            qkv(&device, [b, h, h, l, l, d, d]),
            &FusedAttentionOptions::new()
                .causal(true)
                .bias(bias.clone())
                .sinks(sinks.clone()),
            |q, k, v| {
                let r = Reference {
                    causal: true,
                    bias: Some(bias.clone().expand([b, h, l, l])),
                    sinks: Some(sinks.clone()),
                    ..Default::default()
                };
                reference(q, k, v, &r)
            },
            &[("d_sinks", Param::Vector(sinks.clone()))],
        );
        // The bias's gradient, flattened to compare.
        let (q, k, v) = qkv(&device, [b, h, h, l, l, d, d]);
        let options = FusedAttentionOptions::new().bias(bias.clone());
        let out = fused_attention(q.clone(), k.clone(), v.clone(), &options).unwrap();
        let want = reference(
            q,
            k,
            v,
            &Reference {
                bias: Some(bias.clone().expand([b, h, l, l])),
                ..Default::default()
            },
        );
        let got = values(bias.grad(&out.sum().backward()).unwrap());
        let want = values(bias.grad(&want.sum().backward()).unwrap());
        let (rb, ab) = BACKWARD;
        assert_close(&format!("{name} d_bias"), &got, &want, rb, ab);
    }
}

#[test]
fn relative_table_alibi_and_window() {
    for (name, device, _serial) in devices() {
        let device = device.autodiff();
        let [b, h, lq, lk, d] = [2, 2, 17, 23, 16];
        let offset = lk as i64 - lq as i64;
        // T5 buckets: the fused op reads the table; the reference gathers it into a bias.
        let buckets = RelativeBuckets::new(8, 16, true);
        let table = input([h, buckets.buckets], &device);
        let index: Vec<i64> = (0..lq * lk)
            .map(|x| buckets.bucket((x % lk) as i64 - (x / lk) as i64 - offset) as i64)
            .collect();
        let gathered = |table: Tensor<2>| {
            table
                .select(1, indices(index.clone(), &device))
                .reshape([1, h, lq, lk])
                .expand([b, h, lq, lk])
        };
        // ALiBi's geometric slopes for 2 heads: 2^-4, 2^-8.
        let slopes = [2f32.powi(-4), 2f32.powi(-8)];
        let alibi: Vec<f32> = (0..h * lq * lk)
            .map(|x| {
                let (hh, i, j) = (x / (lq * lk), x / lk % lq, x % lk);
                -slopes[hh] * ((i as i64 + offset - j as i64).abs() as f32)
            })
            .collect();
        let alibi = Tensor::<4>::from_data(
            burn::tensor::TensorData::new(alibi, [1, h, lq, lk]),
            &device,
        )
        .expand([b, h, lq, lk]);
        let (left, right) = (5usize, 2usize);
        let outside = mask([b, h, lq, lk], &device, |_, i, j| {
            let p = i as i64 + offset;
            (j as i64) < p - left as i64 || (j as i64) > p + right as i64
        });
        compare(
            &format!("{name} relative alibi window"),
            &device,
            qkv(&device, [b, h, h, lq, lk, d, d]),
            &FusedAttentionOptions::new()
                .relative_buckets(buckets, table.clone())
                .alibi()
                .window(left, right),
            |q, k, v| {
                let r = Reference {
                    bias: Some(gathered(table.clone()) + alibi.clone()),
                    mask: Some(outside.clone()),
                    ..Default::default()
                };
                reference(q, k, v, &r)
            },
            &[("d_relative_table", Param::Matrix(table.clone()))],
        );
    }
}

#[test]
fn strided_inputs_are_read_in_place() {
    let device = vulkan().autodiff();
    // Projections are [B, L, H, D]; swapping to burn's [B, H, L, D] makes strided views, which the
    // kernels read without a copy.
    let [b, h, l, d] = [2, 3, 18, 16];
    let make = || input([b, l, h, d], &device);
    let (q, k, v) = (make(), make(), make());
    let heads = |t: &Tensor<4>| t.clone().swap_dims(1, 2);
    let out = fused_attention(
        heads(&q),
        heads(&k),
        heads(&v),
        &FusedAttentionOptions::new(),
    )
    .unwrap();
    let want = reference(heads(&q), heads(&k), heads(&v), &Reference::default());
    let (rf, af) = FORWARD;
    assert_close(
        "strided out",
        &values(out.clone()),
        &values(want.clone()),
        rf,
        af,
    );
    let grads = out.sum().backward();
    let grads_ref = want.sum().backward();
    let (rb, ab) = BACKWARD;
    for (name, t) in [("dq", &q), ("dk", &k), ("dv", &v)] {
        let got = values(t.grad(&grads).unwrap());
        let want = values(t.grad(&grads_ref).unwrap());
        assert_close(&format!("strided {name}"), &got, &want, rb, ab);
    }
}

#[test]
fn gradients_are_bitwise_deterministic() {
    let device = vulkan().autodiff();
    let (q, k, v) = qkv(&device, [2, 4, 2, 40, 40, 16, 16]);
    let sinks = input([4], &device);
    let options = FusedAttentionOptions::new()
        .causal(true)
        .sinks(sinks.clone());
    let run = || {
        let out = fused_attention(q.clone(), k.clone(), v.clone(), &options).unwrap();
        let grads = (out.clone() * out).sum().backward();
        [&q, &k, &v]
            .map(|t| values(t.grad(&grads).unwrap()))
            .into_iter()
            .chain([values(sinks.grad(&grads).unwrap())])
            .collect::<Vec<_>>()
    };
    let first = run();
    for _ in 0..2 {
        let again = run();
        for (a, b) in first.iter().zip(&again) {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "gradients differ between runs"
            );
        }
    }
}

#[test]
fn inference_without_autodiff() {
    let device = vulkan();
    let (q, k, v) = qkv(&device, [1, 2, 1, 9, 30, 16, 16]);
    let options = FusedAttentionOptions::new().causal(true);
    let (out, lse) =
        burn_attention::fused_attention_lse(q.clone(), k.clone(), v.clone(), &options).unwrap();
    assert_eq!(lse.dims(), [1, 2, 9]);
    let want = reference(
        q,
        k,
        v,
        &Reference {
            causal: true,
            ..Default::default()
        },
    );
    let (rf, af) = FORWARD;
    assert_close("inference out", &values(out), &values(want), rf, af);
    assert!(values(lse).iter().all(|x| x.is_finite()));
}

#[test]
fn half_precision_tensors() {
    let device = vulkan().autodiff();
    let (q, k, v) = qkv(&device, [2, 4, 2, 33, 33, 16, 16]);
    let half = |t: &Tensor<4>| t.clone().cast(burn::tensor::DType::F16);
    let options = FusedAttentionOptions::new().causal(true);
    let out = fused_attention(half(&q), half(&k), half(&v), &options).expect("f16 attention");
    assert_eq!(out.dtype(), burn::tensor::DType::F16);
    let want = reference(
        q.clone(),
        k.clone(),
        v.clone(),
        &Reference {
            causal: true,
            ..Default::default()
        },
    );
    // f16 storage, f32 arithmetic: the contract's f16 tolerance (inputs and output rounded).
    assert_close(
        "f16 out",
        &values(out.clone()),
        &values(want.clone()),
        1e-2,
        1e-2,
    );
    let grads = out.cast(burn::tensor::DType::F32).sum().backward();
    let grads_ref = want.sum().backward();
    for (name, t) in [("dq", &q), ("dk", &k), ("dv", &v)] {
        let got = values(t.grad(&grads).expect("a gradient through the casts"));
        let want = values(t.grad(&grads_ref).unwrap());
        assert_close(&format!("f16 {name}"), &got, &want, 2e-2, 2e-2);
    }
}

#[test]
fn drop_in_with_mask_and_bias() {
    for (name, device, _serial) in devices() {
        let device = device.autodiff();
        let [b, h, l, d] = [2, 2, 24, 16];
        // A pseudo-random mask with some fully masked rows (both give them 0), and a learnable bias.
        let masked = mask([b, h, l, l], &device, |b, i, j| {
            (i * 7 + j * 3 + b) % 5 == 0 || i == 4
        });
        let bias = input([b, h, l, l], &device);
        let options = AttentionModuleOptions {
            scale: Some(0.2),
            ..Default::default()
        };
        let (q, k, v) = qkv(&device, [b, h, h, l, l, d, d]);
        let out = burn_attention::attention(
            q.clone(),
            k.clone(),
            v.clone(),
            Some(masked.clone()),
            Some(bias.clone()),
            options,
        )
        .expect("drop-in attention");
        let want = attention(
            q.clone(),
            k.clone(),
            v.clone(),
            Some(masked),
            Some(bias.clone()),
            options,
        );
        let (rf, af) = FORWARD;
        assert_close(
            &format!("{name} drop-in out"),
            &values(out.clone()),
            &values(want.clone()),
            rf,
            af,
        );
        let grads = (out.clone() * out).sum().backward();
        let grads_ref = (want.clone() * want).sum().backward();
        let (rb, ab) = BACKWARD;
        for (label, got, want) in [
            ("dq", q.grad(&grads), q.grad(&grads_ref)),
            ("dk", k.grad(&grads), k.grad(&grads_ref)),
            ("dv", v.grad(&grads), v.grad(&grads_ref)),
            ("d_bias", bias.grad(&grads), bias.grad(&grads_ref)),
        ] {
            let (got, want) = (values(got.unwrap()), values(want.unwrap()));
            assert_close(&format!("{name} drop-in {label}"), &got, &want, rb, ab);
        }
    }
}

/// Rows of `x` (`[.., D]`) L2-normalised (norms below 1e-6 not divided by), as the kernels do.
fn normalized(x: Tensor<4>) -> Tensor<4> {
    let norm = x.clone().powf_scalar(2.0).sum_dim(3).sqrt().clamp_min(1e-6);
    x / norm
}

/// Rows of `x` whose norm exceeds `max_norm` scaled to it.
fn clipped(x: Tensor<4>, max_norm: f32) -> Tensor<4> {
    let norm = x.clone().powf_scalar(2.0).sum_dim(3).sqrt();
    let factor = (norm.recip() * max_norm).clamp_max(1.0);
    x * factor
}

#[test]
fn cosine_clip_temperature_and_alibi_slopes() {
    for (name, device, _serial) in devices() {
        let device = device.autodiff();
        let [b, h, l, d] = [2, 2, 26, 16];
        let slopes = [0.1f32, 0.3];
        let alibi: Vec<f32> = (0..h * l * l)
            .map(|x| {
                let (hh, i, j) = (x / (l * l), x / l % l, x % l);
                -slopes[hh] * ((i as i64 - j as i64).abs() as f32)
            })
            .collect();
        let alibi =
            Tensor::<4>::from_data(burn::tensor::TensorData::new(alibi, [1, h, l, l]), &device)
                .expand([b, h, l, l]);
        // Cosine scores times 4, divided by a temperature of 2, keys clipped to 0.8 after the
        // normalisation, per-head ALiBi slopes, causal.
        compare(
            &format!("{name} cosine clip temperature alibi-slopes"),
            &device,
            qkv(&device, [b, h, h, l, l, d, d]),
            &FusedAttentionOptions::new()
                .cosine(4.0)
                .temperature(2.0)
                .key_norm_clip(0.8)
                .alibi_slopes(slopes)
                .causal(true),
            |q, k, v| {
                let r = Reference {
                    scale: Some(2.0),
                    bias: Some(alibi.clone()),
                    causal: true,
                    ..Default::default()
                };
                reference(normalized(q), clipped(normalized(k), 0.8), v, &r)
            },
            &[],
        );
        // Key clipping alone, with a scale.
        compare(
            &format!("{name} key clip scale"),
            &device,
            qkv(&device, [b, h, h, l, l, d, d]),
            &FusedAttentionOptions::new().key_norm_clip(2.5).scale(0.3),
            |q, k, v| {
                let r = Reference {
                    scale: Some(0.3),
                    ..Default::default()
                };
                reference(q, clipped(k, 2.5), v, &r)
            },
            &[],
        );
    }
}
