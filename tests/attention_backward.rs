//! Fused (and unfused) attention backward on the GPU vs the CPU reference on every back end under
//! test, plus determinism (bitwise identical reruns), exact zeros for fully masked rows, and gradients
//! written into strided views of one packed dQKV buffer.

mod common;

use common::*;
use wgpu_attention::reference::attention as reference;
use wgpu_attention::{
    attention_backward, attention_backward_into, attention_backward_unfused,
    attention_backward_workspace, attention_forward, AttentionOptions, AttentionShape, Context,
    GpuTensor,
};

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Fused,
    Unfused,
}

struct GpuGrads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

fn run(ctx: &Context, case: &Case, path: Path) -> GpuGrads {
    let (q, k, v, d_out) = case.data();
    let qv = upload(ctx, &q, [case.b, case.lq, case.h, case.dk]);
    let kv = upload(ctx, &k, [case.b, case.lk, case.hkv, case.dk]);
    let vv = upload(ctx, &v, [case.b, case.lk, case.hkv, case.dv]);
    let dov = upload(ctx, &d_out, [case.b, case.lq, case.h, case.dv]);
    let lens = case.seq_lens(ctx);
    let mut opts = AttentionOptions::new().causal(case.causal);
    if let Some(t) = case.temperature {
        opts = opts.temperature(t);
    }
    if let Some(l) = &lens {
        opts = opts.seq_lens(l);
    }
    let grads = match path {
        Path::Fused => {
            let fwd = attention_forward(ctx, &qv, &kv, &vv, &opts).unwrap();
            attention_backward(ctx, &qv, &kv, &vv, &fwd, &dov, &opts)
        }
        Path::Unfused => attention_backward_unfused(ctx, &qv, &kv, &vv, &dov, &opts),
    }
    .unwrap_or_else(|e| panic!("{}: {e}", case.label()));
    GpuGrads {
        dq: grads.dq.to_vec(ctx).unwrap(),
        dk: grads.dk.to_vec(ctx).unwrap(),
        dv: grads.dv.to_vec(ctx).unwrap(),
    }
}

fn check(backend: &str, ctx: &Context, case: &Case, path: Path) -> GpuGrads {
    let g = run(ctx, case, path);
    let (q, k, v, d_out) = case.data();
    let r = reference::attention_backward(
        &case.shape(),
        &to_f64(&q),
        &to_f64(&k),
        &to_f64(&v),
        &to_f64(&d_out),
        &case.masks(),
    );
    let tag = format!(
        "[{backend}] {} backward {}",
        if path == Path::Fused {
            "fused"
        } else {
            "unfused"
        },
        case.label()
    );
    for (name, gpu, reference) in [
        ("dq", &g.dq, &r.dq),
        ("dk", &g.dk, &r.dk),
        ("dv", &g.dv, &r.dv),
    ] {
        assert!(
            gpu.iter().all(|x| x.is_finite()),
            "{tag} {name}: NaN or Inf"
        );
        assert_close(
            &format!("{tag} {name}"),
            gpu,
            reference,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
    }
    g
}

#[test]
fn odd_sizes_and_head_dims() {
    for_each_backend(|backend, ctx| {
        for &d in &[8, 40, 64, 80, 128, 256] {
            for &(lq, lk) in &[(1, 1), (7, 7), (33, 33), (129, 129), (1, 129), (129, 7)] {
                let mut case = Case::new(1, lq, lk, 2, 2, d, d);
                case.seed = (d * 1000 + lq * 10 + lk) as u64;
                check(backend, ctx, &case, Path::Fused);
            }
        }
        for &d in &[1, 3, 5, 17, 33] {
            check(backend, ctx, &Case::new(2, 9, 13, 2, 1, d, d), Path::Fused);
        }
    });
}

#[test]
fn masks_and_their_combinations() {
    for_each_backend(|backend, ctx| {
        for &(lq, lk) in &[(33, 33), (7, 33), (33, 7), (129, 65)] {
            let base = Case::new(3, lq, lk, 2, 2, 40, 40);
            let kv_lens = [lk as u32, (lk / 2) as u32 + 1, 1];
            let q_lens = [(lq / 3) as u32 + 1, lq as u32, (lq / 2) as u32];
            let cases = [
                base.clone().causal(),
                base.clone().kv_lens(&kv_lens),
                base.clone().q_lens(&q_lens),
                base.clone().q_lens(&q_lens).kv_lens(&kv_lens),
                base.clone().causal().kv_lens(&kv_lens),
                base.clone().causal().q_lens(&q_lens).kv_lens(&kv_lens),
            ];
            for case in &cases {
                check(backend, ctx, case, Path::Fused);
            }
        }
    });
}

#[test]
fn grouped_and_multi_query_heads_and_distinct_value_dim() {
    for_each_backend(|backend, ctx| {
        let cases = [
            Case::new(2, 33, 33, 8, 2, 64, 64),
            Case::new(2, 33, 47, 4, 1, 64, 64).causal(),
            Case::new(1, 17, 29, 6, 3, 40, 24),
            Case::new(2, 7, 33, 4, 2, 16, 128).kv_lens(&[20, 33]),
            Case::new(1, 65, 65, 2, 1, 256, 8).causal(),
            Case::new(1, 33, 33, 2, 2, 80, 256),
            // A group of 4 query heads over 256 keys: ~1024 query iterations per key block.
            Case::new(1, 256, 256, 8, 2, 64, 64),
        ];
        for case in &cases {
            check(backend, ctx, case, Path::Fused);
        }
    });
}

#[test]
fn large_logits_and_temperature() {
    for_each_backend(|backend, ctx| {
        check(
            backend,
            ctx,
            &Case::new(1, 65, 65, 2, 2, 64, 64).magnitude(8.0),
            Path::Fused,
        );
        check(
            backend,
            ctx,
            &Case::new(1, 65, 65, 2, 2, 64, 64).magnitude(8.0).causal(),
            Path::Fused,
        );
        check(
            backend,
            ctx,
            &Case::new(1, 33, 33, 2, 1, 40, 40).temperature(0.5),
            Path::Fused,
        );
        check(
            backend,
            ctx,
            &Case::new(1, 33, 33, 2, 1, 40, 40).temperature(3.0).causal(),
            Path::Fused,
        );
    });
}

#[test]
fn fully_masked_rows_have_exactly_zero_gradients() {
    for_each_backend(|backend, ctx| {
        // Batch 1 sees no key: all of its dQ, dK, dV are exactly 0.
        let case = Case::new(2, 9, 9, 2, 2, 16, 16).kv_lens(&[9, 0]);
        let g = check(backend, ctx, &case, Path::Fused);
        let half = |x: &[f32]| x[x.len() / 2..].iter().all(|&v| v == 0.0);
        assert!(
            half(&g.dq) && half(&g.dk) && half(&g.dv),
            "[{backend}] masked batch has gradients"
        );
        // Causal with Lq > Lk: the first Lq - Lk query rows see nothing; their dQ rows are 0.
        let case = Case::new(1, 33, 9, 2, 2, 16, 16).causal();
        let g = check(backend, ctx, &case, Path::Fused);
        assert!(g.dq[..(33 - 9) * 2 * 16].iter().all(|&v| v == 0.0));
        // Padded query rows.
        let case = Case::new(2, 9, 9, 2, 2, 16, 16).q_lens(&[3, 0]);
        let g = check(backend, ctx, &case, Path::Fused);
        assert!(g.dq[3 * 2 * 16..9 * 2 * 16].iter().all(|&v| v == 0.0));
        assert!(half(&g.dq) && half(&g.dk) && half(&g.dv));
    });
}

#[test]
fn gradients_are_bitwise_reproducible() {
    for_each_backend(|backend, ctx| {
        let case = Case::new(2, 129, 97, 4, 2, 40, 24)
            .causal()
            .kv_lens(&[97, 50]);
        let a = run(ctx, &case, Path::Fused);
        let b = run(ctx, &case, Path::Fused);
        for (name, x, y) in [
            ("dq", &a.dq, &b.dq),
            ("dk", &a.dk, &b.dk),
            ("dv", &a.dv, &b.dv),
        ] {
            let same = x
                .iter()
                .zip(y.iter())
                .all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(
                same,
                "[{backend}] {name} differs between two identical runs"
            );
        }
    });
}

#[test]
fn unfused_backward_matches_reference() {
    for_each_backend(|backend, ctx| {
        let cases = [
            Case::new(1, 33, 33, 2, 2, 40, 40),
            Case::new(2, 7, 33, 4, 2, 64, 24).causal(),
            Case::new(2, 33, 33, 4, 1, 16, 16)
                .q_lens(&[5, 33])
                .kv_lens(&[33, 0]),
            Case::new(1, 129, 65, 2, 2, 80, 80).causal().magnitude(8.0),
        ];
        for case in &cases {
            check(backend, ctx, case, Path::Unfused);
        }
    });
}

#[test]
fn gradients_into_a_packed_dqkv_buffer() {
    for_each_backend(|backend, ctx| {
        let (b, l, h, d) = (2, 33, 4, 40);
        let width = 3 * h * d;
        let case = Case::new(b, l, l, h, h, d, d).causal();
        let (q, k, v, d_out) = case.data();
        // Pack q, k, v into one [B, L, 3 * H * D] projection.
        let mut packed = vec![0.0f32; b * l * width];
        for t in 0..b * l {
            let row = &mut packed[t * width..(t + 1) * width];
            row[..h * d].copy_from_slice(&q[t * h * d..(t + 1) * h * d]);
            row[h * d..2 * h * d].copy_from_slice(&k[t * h * d..(t + 1) * h * d]);
            row[2 * h * d..].copy_from_slice(&v[t * h * d..(t + 1) * h * d]);
        }
        let qkv = GpuTensor::from_slice(ctx, &packed, &[b, l, width]).unwrap();
        let (qv, kv, vv) = (
            qkv.split_heads(0, h, d).unwrap(),
            qkv.split_heads(h * d, h, d).unwrap(),
            qkv.split_heads(2 * h * d, h, d).unwrap(),
        );
        let opts = AttentionOptions::new().causal(true);
        let fwd = attention_forward(ctx, &qv, &kv, &vv, &opts).unwrap();
        let dov = upload(ctx, &d_out, [b, l, h, d]);
        let dqkv = GpuTensor::zeros(ctx, &[b, l, width]).unwrap();
        let (dq, dk, dv) = (
            dqkv.split_heads(0, h, d).unwrap(),
            dqkv.split_heads(h * d, h, d).unwrap(),
            dqkv.split_heads(2 * h * d, h, d).unwrap(),
        );
        let shape = AttentionShape::of(&qv, &kv, &vv).unwrap();
        let workspace = attention_backward_workspace(ctx, &shape).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        attention_backward_into(
            ctx,
            &mut encoder,
            &qv,
            &kv,
            &vv,
            &fwd.out.heads().unwrap(),
            &fwd.lse,
            &dov,
            &dq,
            &dk,
            &dv,
            &workspace,
            &opts,
        )
        .unwrap();
        ctx.queue().submit([encoder.finish()]);
        let r = reference::attention_backward(
            &case.shape(),
            &to_f64(&q),
            &to_f64(&k),
            &to_f64(&v),
            &to_f64(&d_out),
            &case.masks(),
        );
        let tag = format!("[{backend}] packed dqkv");
        assert_close(
            &format!("{tag} dq"),
            &dq.to_vec(ctx).unwrap(),
            &r.dq,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
        assert_close(
            &format!("{tag} dk"),
            &dk.to_vec(ctx).unwrap(),
            &r.dk,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
        assert_close(
            &format!("{tag} dv"),
            &dv.to_vec(ctx).unwrap(),
            &r.dv,
            BACKWARD_ATOL,
            BACKWARD_RTOL,
        );
    });
}
