//! f16 attention: Q, K, V, O, dO, dQ, dK, dV stored as f16, arithmetic in f32 (the GPU kernel family
//! on every adapter), against the f64 reference of the f16-rounded inputs with the tolerances of
//! f16 rounding (`F16_*` in `reference::compare`). Masks, padding with fully masked rows, GQA,
//! Dk != Dv, score modifiers, strided views of a packed projection, split-KV and loop chunks. The GL
//! back end, which has no `SHADER_F16`, gets a typed error; so do mixed dtypes and the f32-only ops.

use crate::common;

use common::*;
use half::f16;
use wgpu_attention::kernels::attention::{attention_backward_workspace, attention_decode};
use wgpu_attention::reference::attention as reference;
use wgpu_attention::reference::compare::{
    F16_BACKWARD_ATOL, F16_FORWARD_ATOL, F16_RTOL, TENSOR_CORE_ATOL, TENSOR_CORE_RTOL,
};
use wgpu_attention::{
    attention_backward_into, attention_forward, attention_forward_into, AttentionOptions,
    BackwardViews, Context, DType, Error, ForwardViews, GpuTensor, GpuTensorF16, HeadsView,
    KernelFamily,
};

fn has_f16(ctx: &Context) -> bool {
    ctx.device().features().contains(wgpu::Features::SHADER_F16)
}

/// `x` rounded to f16, and the rounded values as f32 (what the reference sees).
fn halves(x: &[f32]) -> (Vec<f16>, Vec<f32>) {
    let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    let back = h.iter().map(|&v| f32::from(v)).collect();
    (h, back)
}

fn upload_f16(ctx: &Context, data: &[f16], shape: [usize; 4]) -> HeadsView {
    GpuTensorF16::from_slice(ctx, data, &shape)
        .unwrap()
        .heads()
        .unwrap()
}

/// Forward and backward of `case` in f16, one submission, compared with the reference.
fn check(backend: &str, ctx: &Context, case: &Case) {
    let (q, k, v, d_out) = case.data();
    let [(q16, q32), (k16, k32), (v16, v32), (do16, do32)] =
        [&q, &k, &v, &d_out].map(|x| halves(x));
    let (b, h, lq) = (case.b, case.h, case.lq);
    let qv = upload_f16(ctx, &q16, [b, lq, h, case.dk]);
    let kv = upload_f16(ctx, &k16, [b, case.lk, case.hkv, case.dk]);
    let vv = upload_f16(ctx, &v16, [b, case.lk, case.hkv, case.dv]);
    let dov = upload_f16(ctx, &do16, [b, lq, h, case.dv]);
    let buffers = case.buffers(ctx);
    let opts = case.options(&buffers);
    let out = GpuTensorF16::zeros(ctx, &[b, lq, h, case.dv]).unwrap();
    let lse = GpuTensor::zeros(ctx, &[b, h, lq]).unwrap();
    let grads = [
        [b, lq, h, case.dk],
        [b, case.lk, case.hkv, case.dk],
        [b, case.lk, case.hkv, case.dv],
    ]
    .map(|shape| GpuTensorF16::zeros(ctx, &shape).unwrap());
    let workspace = attention_backward_workspace(ctx, &case.shape()).unwrap();
    let [dq, dk, dv] = grads.each_ref().map(|g| g.heads().unwrap());
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    let out_view = out.heads().unwrap();
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
    .unwrap_or_else(|e| panic!("{}: {e}", case.label()));
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
            dq: &dq,
            dk: &dk,
            dv: &dv,
            workspace: &workspace,
        },
        &opts,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", case.label()));
    ctx.queue().submit([encoder.finish()]);

    let shape = case.shape();
    let masks = case.masks();
    let (ref_out, ref_lse) =
        reference::attention_forward(&shape, &to_f64(&q32), &to_f64(&k32), &to_f64(&v32), &masks);
    let g = reference::attention_backward(
        &shape,
        &to_f64(&q32),
        &to_f64(&k32),
        &to_f64(&v32),
        &to_f64(&do32),
        &masks,
    );
    let tag = format!("[{backend}] f16 {}", case.label());
    let read = |t: &GpuTensorF16| t.to_vec(ctx).unwrap();
    // The tensor-core family also rounds P to f16 (its backward starts from that forward).
    let coop = ctx.kernel_family() == KernelFamily::Coop;
    let (out_atol, out_rtol, lse_atol, lse_rtol, grad_atol, grad_rtol) = match coop {
        true => (
            TENSOR_CORE_ATOL,
            TENSOR_CORE_RTOL,
            TENSOR_CORE_ATOL,
            TENSOR_CORE_RTOL,
            TENSOR_CORE_ATOL.max(F16_BACKWARD_ATOL),
            TENSOR_CORE_RTOL,
        ),
        false => (
            F16_FORWARD_ATOL,
            F16_RTOL,
            FORWARD_ATOL,
            FORWARD_RTOL,
            F16_BACKWARD_ATOL,
            F16_RTOL,
        ),
    };
    assert_close(
        &format!("{tag} out"),
        &read(&out),
        &ref_out,
        out_atol,
        out_rtol,
    );
    let lse = lse.to_vec(ctx).unwrap();
    assert_close(&format!("{tag} lse"), &lse, &ref_lse, lse_atol, lse_rtol);
    for (name, gpu, r) in [
        ("dq", &grads[0], &g.dq),
        ("dk", &grads[1], &g.dk),
        ("dv", &grads[2], &g.dv),
    ] {
        assert_close(
            &format!("{tag} {name}"),
            &read(gpu),
            r,
            grad_atol,
            grad_rtol,
        );
    }
}

fn cases() -> Vec<Case> {
    let mut modifiers = Case::new(1, 33, 40, 2, 2, 32, 32).causal();
    modifiers.alibi = true;
    modifiers.softcap = Some(5.0);
    modifiers.window = Some((9, 0));
    vec![
        // Odd sizes, head dims not a multiple of 4.
        Case::new(1, 7, 13, 2, 1, 5, 17),
        Case::new(1, 129, 129, 2, 2, 64, 64),
        // Padding with fully masked query rows and a single key, causal.
        Case::new(3, 33, 33, 2, 2, 40, 40)
            .causal()
            .q_lens(&[12, 33, 16])
            .kv_lens(&[33, 17, 1]),
        // GQA, Dk != Dv, cross-attention lengths.
        Case::new(2, 17, 29, 6, 3, 40, 24).kv_lens(&[29, 11]),
        modifiers,
    ]
}

#[test]
fn forward_and_backward_match_reference() {
    for_each_backend(|backend, ctx| {
        if !has_f16(ctx) {
            return;
        }
        for case in &cases() {
            check(backend, ctx, case);
        }
    });
}

#[test]
fn split_keys_and_loop_chunks() {
    // Split-KV partial results stay f32 until the merge writes f16; dQ, dK and dV accumulate chunk
    // by chunk.
    for_each_backend_with_loop_budget(SMALL_LOOP_BUDGET, |backend, ctx| {
        if !has_f16(ctx) {
            return;
        }
        check(backend, ctx, &Case::new(2, 65, 200, 4, 2, 64, 32).causal());
    });
}

/// dQ added with f32 atomics (`ContextOptions::atomic_gradients`) and stored as f16 by the store
/// pass: padded rows and a single key, causal, against the reference.
#[test]
fn atomic_dq_is_stored_as_f16() {
    for_each_backend_with_options(
        |_, opts| opts.atomic_gradients(true),
        |backend, ctx| {
            if !has_f16(ctx) || !ctx.atomic_gradients() {
                return;
            }
            let case = Case::new(3, 33, 33, 2, 2, 40, 40)
                .causal()
                .q_lens(&[12, 33, 16])
                .kv_lens(&[33, 17, 1]);
            check(backend, ctx, &case);
        },
    );
}

#[test]
fn tensor_core_family_reads_and_writes_f16() {
    // Its portable build here: f16 Q, K, V staged as f16 tiles, f16 O (f32 partials when split).
    // The cases, and the loops split into chunks, on two contexts at once.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for_each_backend_with(
                |ctx| ctx.set_kernel_family(Some(KernelFamily::Coop)),
                |backend, ctx| {
                    if !has_f16(ctx) {
                        return;
                    }
                    for case in &cases()[1..] {
                        check(backend, ctx, case);
                    }
                },
            )
        });
        for_each_backend_with(
            |ctx| {
                ctx.set_kernel_family(Some(KernelFamily::Coop));
                ctx.set_loop_budget(Some(SMALL_LOOP_BUDGET));
            },
            |backend, ctx| {
                if !has_f16(ctx) {
                    return;
                }
                check(backend, ctx, &Case::new(2, 65, 200, 4, 2, 64, 32).causal());
            },
        );
    });
}

#[test]
fn unsupported_uses_are_typed_errors() {
    for_each_backend(|backend, ctx| {
        let case = Case::new(1, 8, 8, 2, 2, 16, 16);
        let (q, _, _, _) = case.data();
        let q16 = upload_f16(ctx, &halves(&q).0, [1, 8, 2, 16]);
        let q32 = upload(ctx, &q, [1, 8, 2, 16]);
        let out = GpuTensorF16::zeros(ctx, &[1, 8, 2, 16])
            .unwrap()
            .heads()
            .unwrap();
        let lse = GpuTensor::zeros(ctx, &[1, 2, 8]).unwrap();
        let opts = AttentionOptions::new();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let mut forward = |q: &HeadsView, k: &HeadsView| {
            attention_forward_into(
                ctx,
                &mut encoder,
                &ForwardViews {
                    q,
                    k,
                    v: k,
                    out: &out,
                    lse: &lse,
                },
                &opts,
            )
        };
        if !has_f16(ctx) {
            // GL: no SHADER_F16.
            let e = forward(&q16, &q16).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::MissingFeature {
                        feature: "SHADER_F16",
                        ..
                    }
                ),
                "[{backend}] {e}"
            );
            return;
        }
        assert_eq!(q16.dtype(), DType::F16);
        // One call, one element type.
        assert!(matches!(
            forward(&q16, &q32),
            Err(Error::DType { arg: "k", .. })
        ));
        // The allocating form makes f32 outputs; decode takes f32.
        let e = attention_forward(ctx, &q16, &q16, &q16, &opts).unwrap_err();
        assert!(matches!(e, Error::DType { arg: "q", .. }), "{e}");
        let e = attention_decode(ctx, &q16, &q16, &q16, &opts).unwrap_err();
        assert!(matches!(e, Error::DType { arg: "q", .. }), "{e}");
    });
}

#[test]
fn half_tensors_round_trip() {
    for_each_backend(|_, ctx| {
        // An odd element count: the buffer is padded to whole words.
        let data: Vec<f32> = (0..7).map(|i| i as f32 * 0.1 - 0.3).collect();
        let t = GpuTensorF16::from_f32(ctx, &data, &[7]).unwrap();
        let expected: Vec<f32> = data.iter().map(|&x| f32::from(f16::from_f32(x))).collect();
        assert_eq!(t.to_vec(ctx).unwrap(), expected);
        assert!(matches!(
            GpuTensorF16::from_f32(ctx, &data, &[2, 3]),
            Err(Error::Shape { arg: "data", .. })
        ));
    });
}
