//! Bad input gets a typed error naming the argument, the value and the limit, and nothing is
//! dispatched: outputs passed to the `_into` functions are left untouched.

use crate::common;

use common::*;
use wgpu_attention::kernels::elementwise::add;
use wgpu_attention::kernels::kv_cache::BlockTable;
use wgpu_attention::kernels::layer_norm::layer_norm_backward_into;
use wgpu_attention::kernels::linear::linear_forward;
use wgpu_attention::kernels::loss_scale::{LossScale, LossScaleState, LossScaling};
use wgpu_attention::{
    attention_backward, attention_backward_into, attention_backward_unfused,
    attention_decode_f16_into, attention_decode_int8_into, attention_decode_paged_into,
    attention_forward, attention_forward_into, attention_forward_unfused, attention_probabilities,
    AttentionOptions, AttentionOutput, BackwardViews, BiasView, Error, ForwardViews, GpuTensor,
    GpuTensorF16, GpuTensorQ8, HalfCache, HeadsView, QuantizedCache, RelativeBuckets, SeqLens,
};

fn views(
    ctx: &wgpu_attention::Context,
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
) -> (HeadsView, HeadsView, HeadsView) {
    let make = |s: [usize; 4]| GpuTensor::zeros(ctx, &s).unwrap().heads().unwrap();
    (make(q), make(k), make(v))
}

fn message(r: Result<impl std::fmt::Debug, Error>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn shape_errors_name_the_argument() {
    for_each_backend(|_, ctx| {
        let opts = AttentionOptions::new();
        let (q, k, v) = views(ctx, [1, 4, 6, 8], [1, 4, 4, 8], [1, 4, 4, 8]);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(
            m.contains("H % Hkv") && m.contains('6') && m.contains('4'),
            "{m}"
        );

        let (q, k, v) = views(ctx, [1, 4, 2, 8], [1, 4, 2, 16], [1, 4, 2, 8]);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("k head_dim") && m.contains("16"), "{m}");

        let (q, k, v) = views(ctx, [1, 4, 2, 8], [1, 5, 2, 8], [1, 4, 2, 8]);
        assert!(message(attention_forward(ctx, &q, &k, &v, &opts)).contains("v seq"));

        let (q, k, v) = views(ctx, [2, 4, 2, 8], [1, 4, 2, 8], [1, 4, 2, 8]);
        assert!(message(attention_forward(ctx, &q, &k, &v, &opts)).contains("batch"));

        let (q, k, v) = views(ctx, [1, 0, 2, 8], [1, 4, 2, 8], [1, 4, 2, 8]);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("q seq") && m.contains("is 0"), "{m}");

        let (q, k, v) = views(ctx, [1, 4, 2, 300], [1, 4, 2, 300], [1, 4, 2, 8]);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("300") && m.contains("256"), "{m}");

        let (q, k, v) = views(ctx, [1, 4, 2, 8], [1, 4, 2, 8], [1, 4, 2, 8]);
        let m = message(attention_forward(
            ctx,
            &q,
            &k,
            &v,
            &AttentionOptions::new().temperature(0.0),
        ));
        assert!(m.contains("temperature"), "{m}");
    });
}

#[test]
fn sequence_lengths_are_checked() {
    for_each_backend(|_, ctx| {
        let (q, k, v) = views(ctx, [2, 4, 2, 8], [2, 6, 2, 8], [2, 6, 2, 8]);
        let with_lens = |lens: &SeqLens| {
            message(attention_forward(
                ctx,
                &q,
                &k,
                &v,
                &AttentionOptions::new().seq_lens(lens),
            ))
        };
        let lens = SeqLens::new(ctx, None, Some(&[6, 7])).unwrap();
        let m = with_lens(&lens);
        assert!(
            m.contains("kv_lens") && m.contains("entry 1 is 7") && m.contains('6'),
            "{m}"
        );
        let lens = SeqLens::new(ctx, Some(&[5, 1]), None).unwrap();
        let m = with_lens(&lens);
        assert!(m.contains("q_lens") && m.contains("entry 0 is 5"), "{m}");
        let lens = SeqLens::new(ctx, Some(&[1, 1, 1]), None).unwrap();
        let m = with_lens(&lens);
        assert!(m.contains("seq_lens") && m.contains('3'), "{m}");
        assert!(SeqLens::new(ctx, Some(&[1]), Some(&[1, 2])).is_err());
        assert!(SeqLens::new(ctx, None, None).is_err());
    });
}

#[test]
fn rejected_calls_dispatch_nothing() {
    for_each_backend(|_, ctx| {
        let (q, k, v) = views(ctx, [1, 4, 2, 8], [1, 4, 2, 8], [1, 4, 2, 8]);
        let sentinel = vec![7.0f32; 4 * 2 * 8];
        let out = GpuTensor::from_slice(ctx, &sentinel, &[1, 4, 2, 8]).unwrap();
        // lse of the wrong shape: rejected before anything is recorded.
        let lse = GpuTensor::zeros(ctx, &[1, 2, 5]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let m = message(attention_forward_into(
            ctx,
            &mut encoder,
            &ForwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &out.heads().unwrap(),
                lse: &lse,
            },
            &AttentionOptions::new(),
        ));
        assert!(m.contains("lse") && m.contains("[1, 2, 4]"), "{m}");
        ctx.queue().submit([encoder.finish()]);
        assert_eq!(out.to_vec(ctx).unwrap(), sentinel);
        // Output aliasing an input.
        let lse = GpuTensor::zeros(ctx, &[1, 2, 4]).unwrap();
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let m = message(attention_forward_into(
            ctx,
            &mut encoder,
            &ForwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &q,
                lse: &lse,
            },
            &AttentionOptions::new(),
        ));
        assert!(m.contains("out shares memory with q"), "{m}");
    });
}

#[test]
fn views_are_bounds_checked() {
    for_each_backend(|_, ctx| {
        let t = GpuTensor::zeros(ctx, &[2, 3, 24]).unwrap();
        let m = message(t.split_heads(16, 2, 8));
        assert!(m.contains("32") && m.contains("24"), "{m}");
        let m = message(HeadsView::new(
            t.buffer().clone(),
            0,
            [2, 3, 4, 8],
            [72, 24, 8],
        ));
        assert!(m.contains("buffer holds 144"), "{m}");
        assert!(message(GpuTensor::from_slice(ctx, &[1.0; 5], &[2, 3])).contains("data"));
        assert!(message(t.heads()).contains("[batch, seq, heads, head_dim]"));
    });
}

#[test]
fn unfused_scores_beyond_the_binding_limit_are_reported() {
    for_each_backend(|_, ctx| {
        let limit = ctx.limits().max_storage_buffer_binding_size;
        // Scores [1, 1, L, L] with 4 * L^2 > limit while Q, K, V stay small.
        let l = ((limit / 4) as f64).sqrt() as usize + 16;
        let (q, k, v) = views(ctx, [1, l, 1, 1], [1, l, 1, 1], [1, l, 1, 1]);
        let m = message(attention_forward_unfused(
            ctx,
            &q,
            &k,
            &v,
            &AttentionOptions::new(),
        ));
        assert!(
            m.contains("scores") && m.contains(&limit.to_string()),
            "{m}"
        );
        let m = message(attention_backward_unfused(
            ctx,
            &q,
            &k,
            &v,
            &q,
            &AttentionOptions::new(),
        ));
        assert!(m.contains("scores"), "{m}");
    });
}

#[test]
fn unsupported_attention_workgroup_width_is_refused() {
    for_each_backend_with(
        |ctx| {
            let m = message(ctx.set_attention_workgroup(Some(48)));
            assert!(
                m.contains("workgroup") && m.contains("48") && m.contains("16, 32, 64 or 128"),
                "{m}"
            );
            // The refused width leaves the setting as it was.
            assert_eq!(ctx.attention_workgroup(), None);
            ctx.set_attention_workgroup(Some(32)).unwrap();
            assert_eq!(ctx.attention_workgroup(), Some(32));
        },
        |_, _| {},
    );
}

#[test]
fn allocations_beyond_the_adapter_limit_are_refused() {
    for_each_backend(|_, ctx| {
        let limit = ctx.limits().max_buffer_size;
        let elements = (limit / 4 + 1) as usize;
        let before = ctx.memory().current_bytes;
        let err = GpuTensor::zeros(ctx, &[elements]).unwrap_err();
        assert!(
            matches!(err, Error::Unsupported { limit: l, .. } if l == limit),
            "{err}"
        );
        assert!(err.to_string().contains("max_buffer_size"), "{err}");
        assert_eq!(
            ctx.memory().current_bytes,
            before,
            "a refused allocation is counted"
        );
    });
}

#[test]
fn a_lost_device_gives_typed_errors_not_panics() {
    // A fresh context per back end: this test destroys its device.
    for_each_backend_with(
        |_| {},
        |backend, ctx| {
            let t = GpuTensor::from_slice(ctx, &[1.0; 8], &[8]).unwrap();
            let (q, k, v) = views(ctx, [1, 4, 2, 8], [1, 4, 2, 8], [1, 4, 2, 8]);
            let scale = LossScale::new(ctx, LossScaling::default()).unwrap();
            // A prefill-shaped decoding step (64 new rows) over a paged pool and over int8 and
            // f16 caches, and a backward: recorded after the loss below.
            let (pq, pool, out) = views(ctx, [1, 64, 2, 8], [1, 64, 2, 8], [1, 64, 2, 8]);
            let mut table = BlockTable::new(ctx, 1, 4, 16, 4).unwrap();
            table.write(ctx, &[0, 1, 2, 3]).unwrap();
            let lens = SeqLens::new(ctx, Some(&[64]), Some(&[64])).unwrap();
            let lse = GpuTensor::zeros(ctx, &[1, 2, 64]).unwrap();
            let int8 = GpuTensorQ8::zeros(ctx, &[1, 64, 2, 8]).unwrap();
            let half = GpuTensorF16::zeros(ctx, &[1, 64, 2, 8]).unwrap();
            let grads = [0, 1, 2].map(|_| GpuTensor::zeros(ctx, &[1, 4, 2, 8]).unwrap());
            let grad_views = grads.each_ref().map(|g| g.heads().unwrap());
            let fwd = attention_forward(ctx, &q, &k, &v, &AttentionOptions::new()).unwrap();
            let workspace = GpuTensor::zeros(ctx, &[1, 2, 4, 2]).unwrap();
            ctx.synchronize().unwrap();
            ctx.device().destroy();
            let lost = |what: &str, r: Result<(), Error>| match r {
                Err(Error::DeviceLost(reason)) => {
                    assert!(reason.contains("Destroyed"), "[{backend}] {what}: {reason}")
                }
                other => panic!("[{backend}] {what}: expected DeviceLost, got {other:?}"),
            };
            // The driver reports the loss to the first wait; every later call refuses up front.
            lost("synchronize", ctx.synchronize());
            lost("to_vec", t.to_vec(ctx).map(drop));
            lost("write", t.write(ctx, &[0.0; 8]));
            lost("zeros", GpuTensor::zeros(ctx, &[8]).map(drop));
            lost(
                "attention_forward",
                attention_forward(ctx, &q, &k, &v, &AttentionOptions::new()).map(drop),
            );
            lost(
                "LossScale::new",
                LossScale::new(ctx, LossScaling::default()).map(drop),
            );
            lost("LossScale::state", scale.state(ctx).map(drop));
            let state = LossScaleState {
                scale: 2.0,
                clean_steps: 0,
                skipped_steps: 0,
                last_step_skipped: false,
            };
            lost("LossScale::set_state", scale.set_state(ctx, state));
            // Recording calls allocate nothing the caller sees and submit nothing: they return
            // (Ok, or the loss) without a panic, and the submission refuses.
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            let opts = AttentionOptions::new().causal(true).seq_lens(&lens);
            let views = ForwardViews {
                q: &pq,
                k: &pool,
                v: &pool,
                out: &out,
                lse: &lse,
            };
            let recorded = [
                (
                    "attention_decode_paged_into",
                    attention_decode_paged_into(ctx, &mut encoder, &views, &table, &opts),
                ),
                (
                    "attention_decode_int8_into",
                    attention_decode_int8_into(
                        ctx,
                        &mut encoder,
                        &pq,
                        QuantizedCache {
                            k: &int8,
                            v: &int8,
                            table: None,
                        },
                        &out,
                        &lse,
                        &opts,
                    ),
                ),
                (
                    "attention_decode_f16_into",
                    attention_decode_f16_into(
                        ctx,
                        &mut encoder,
                        &pq,
                        HalfCache {
                            k: &half,
                            v: &half,
                            table: None,
                        },
                        &out,
                        &lse,
                        &opts,
                    ),
                ),
                (
                    "attention_backward_into",
                    attention_backward_into(
                        ctx,
                        &mut encoder,
                        &BackwardViews {
                            q: &q,
                            k: &k,
                            v: &v,
                            out: &fwd.out.heads().unwrap(),
                            lse: &fwd.lse,
                            d_out: &q,
                            dq: &grad_views[0],
                            dk: &grad_views[1],
                            dv: &grad_views[2],
                            workspace: &workspace,
                        },
                        &AttentionOptions::new(),
                    ),
                ),
            ];
            for (what, result) in recorded {
                assert!(
                    matches!(result, Ok(()) | Err(Error::DeviceLost(_))),
                    "[{backend}] {what}: {result:?}"
                );
            }
            lost("submit", ctx.submit(encoder));
            let text = ctx.synchronize().unwrap_err().to_string();
            assert!(text.contains("create a new Context"), "[{backend}] {text}");
        },
    );
}

#[test]
fn score_modifier_options_are_checked() {
    for_each_backend(|_, ctx| {
        let (q, k, v) = views(ctx, [1, 4, 2, 8], [1, 4, 2, 8], [1, 4, 2, 8]);
        for cap in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let opts = AttentionOptions::new().softcap(cap);
            let m = message(attention_forward(ctx, &q, &k, &v, &opts));
            assert!(m.contains("softcap") && m.contains("positive"), "{m}");
        }
        // The unfused baseline has masks but no score modifiers: refused, naming them.
        let opts = AttentionOptions::new().alibi(true);
        let m = message(attention_forward_unfused(ctx, &q, &k, &v, &opts));
        assert!(
            m.contains("softcap/alibi/sinks") && m.contains("unfused"),
            "{m}"
        );
        // Sinks are one logit per query head.
        let sinks = GpuTensor::zeros(ctx, &[3]).unwrap();
        let opts = AttentionOptions::new().sinks(&sinks);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("sinks") && m.contains("[2]"), "{m}");
        // Cosine scores carry their own scale: both is a bad combination, named as such.
        let opts = AttentionOptions::new().cosine(10.0).scale(0.5);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("scale/cosine"), "{m}");
        let opts = AttentionOptions::new().key_norm_clip(-1.0);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("key_norm_clip") && m.contains("positive"), "{m}");
    });
}

#[test]
fn bias_and_relative_bucket_options_are_checked() {
    for_each_backend(|_, ctx| {
        // B 2, Lq 4, Lk 5, H 2.
        let (q, k, v) = views(ctx, [2, 4, 2, 8], [2, 5, 2, 8], [2, 5, 2, 8]);
        // A bias must be [B or 1, H or 1, Lq, Lk].
        for shape in [vec![4, 4], vec![3, 4, 5], vec![2, 2, 5, 4]] {
            let t = GpuTensor::zeros(ctx, &shape).unwrap();
            let bias = BiasView::of(&t).unwrap();
            let opts = AttentionOptions::new().bias(&bias);
            let m = message(attention_forward(ctx, &q, &k, &v, &opts));
            assert!(
                m.starts_with("bias:") && m.contains("[2 or 1, 2 or 1, 4, 5]"),
                "{m}"
            );
        }
        // A view past its buffer's end is refused when it is made.
        let t = GpuTensor::zeros(ctx, &[20]).unwrap();
        let m = message(BiasView::new(
            t.buffer().clone(),
            1,
            [1, 1, 4, 5],
            [0, 0, 5, 1],
        ));
        assert!(
            m.contains("reach element 21") && m.contains("holds 20"),
            "{m}"
        );
        // One additive term per call: both is a bad combination, named as such.
        let t = GpuTensor::zeros(ctx, &[4, 5]).unwrap();
        let bias = BiasView::of(&t).unwrap();
        let table = GpuTensor::zeros(ctx, &[2, 32]).unwrap();
        let t5 = RelativeBuckets::new(32, 128, true);
        let opts = AttentionOptions::new()
            .bias(&bias)
            .relative_buckets(t5, &table);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("bias/relative_buckets"), "{m}");
        // The table is [H, buckets]; bucket counts and distances are checked.
        let opts =
            AttentionOptions::new().relative_buckets(RelativeBuckets::new(16, 128, true), &table);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("relative table") && m.contains("[2, 16]"), "{m}");
        for (buckets, needle) in [
            (RelativeBuckets::new(7, 128, true), "even"),
            (RelativeBuckets::new(32, 8, true), "max_distance"),
            (
                RelativeBuckets::new(200, 1000, false),
                "exceeds the supported maximum 66",
            ),
        ] {
            let opts = AttentionOptions::new().relative_buckets(buckets, &table);
            let m = message(attention_forward(ctx, &q, &k, &v, &opts));
            assert!(m.contains(needle), "{buckets:?}: {m}");
        }
        // A learned cosine scale is [H], excludes a fixed one, and its gradient has its own buffer.
        let (scale, grad) = (
            GpuTensor::zeros(ctx, &[2]).unwrap(),
            GpuTensor::zeros(ctx, &[2]).unwrap(),
        );
        let opts = AttentionOptions::new()
            .cosine(4.0)
            .cosine_learned(&scale, &grad);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("cosine/cosine_learned"), "{m}");
        let opts = AttentionOptions::new().cosine_learned(&scale, &scale);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(
            m.contains("cosine scale grad") && m.contains("separate"),
            "{m}"
        );
        let wide = GpuTensor::zeros(ctx, &[3]).unwrap();
        let opts = AttentionOptions::new().cosine_learned(&wide, &grad);
        let m = message(attention_forward(ctx, &q, &k, &v, &opts));
        assert!(m.contains("cosine scale") && m.contains("[2]"), "{m}");
        // ALiBi slopes: one per query head, finite.
        for (slopes, needle) in [
            (&[0.5f32][..], "has 1 slopes for 2 query heads"),
            (&[0.5, f32::NAN][..], "every slope must be finite"),
        ] {
            let opts = AttentionOptions::new().alibi_slopes(slopes);
            let m = message(attention_forward(ctx, &q, &k, &v, &opts));
            assert!(m.starts_with("alibi_slopes") && m.contains(needle), "{m}");
        }
        // Attention maps: a non-empty range of the query rows.
        let fwd = attention_forward(ctx, &q, &k, &v, &AttentionOptions::new()).unwrap();
        for rows in [2..2, 3..5] {
            let m = message(attention_probabilities(
                ctx,
                &q,
                &k,
                &fwd.lse,
                &AttentionOptions::new(),
                rows,
            ));
            assert!(m.starts_with("rows:") && m.contains("4 query rows"), "{m}");
        }
        // The unfused baseline has neither.
        let opts = AttentionOptions::new().constant_bias(&bias);
        let m = message(attention_forward_unfused(ctx, &q, &k, &v, &opts));
        assert!(
            m.contains("bias/relative_buckets") && m.contains("unfused"),
            "{m}"
        );
    });
}

/// A device created with WebGPU's default 8 storage buffers per stage cannot run the fused backward
/// (it binds 9): a typed error that says what to request, not a wgpu validation panic. The forward
/// (7) runs.
#[test]
fn devices_with_too_few_storage_buffers_are_told_what_to_request() {
    let Some((device, queue)) = vulkan_device_with_default_limits() else {
        eprintln!("no Vulkan adapter: skipped");
        return;
    };
    assert_eq!(device.limits().max_storage_buffers_per_shader_stage, 8);
    let ctx = wgpu_attention::Context::from_device(device, queue).unwrap();
    let (q, k, v) = views(&ctx, [1, 4, 2, 8], [1, 4, 2, 8], [1, 4, 2, 8]);
    // Without a score bias the backward binds 8 (tests/engine/attention_backward.rs runs it there); with
    // one, 9: a typed error naming the limit, not a wgpu validation error.
    let bias = GpuTensor::zeros(&ctx, &[1, 2, 4, 4]).unwrap();
    let bias = BiasView::of(&bias).unwrap();
    let opts = AttentionOptions::new().bias(&bias);
    let fwd = attention_forward(&ctx, &q, &k, &v, &opts).unwrap();
    let m = message(attention_backward(&ctx, &q, &k, &v, &fwd, &q, &opts));
    assert!(
        m.contains("max_storage_buffers_per_shader_stage is 8")
            && m.contains("binds 9")
            && m.contains("score bias"),
        "{m}"
    );
    ctx.synchronize().unwrap();
}

#[test]
fn grids_beyond_the_workgroups_per_dimension_are_refused() {
    // A device that allows 4 workgroups per dimension: 16 in one dispatch. Simple kernels lay
    // theirs out as rows of 4 (64 invocations each) and refuse more with a typed error, before
    // recording anything.
    for_each_backend_with_options(
        |_, opts| opts.max_workgroups_per_dimension(4),
        |backend, ctx| {
            // 7 workgroups: a grid of 4 x 2, the last row partly used; every element summed.
            let n = 64 * 7 - 3;
            let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let b: Vec<f32> = (0..n).map(|i| 0.5 - i as f32 * 0.25).collect();
            let at = GpuTensor::from_slice(ctx, &a, &[n]).unwrap();
            let bt = GpuTensor::from_slice(ctx, &b, &[n]).unwrap();
            let sum = add(ctx, &at, &bt).unwrap().to_vec(ctx).unwrap();
            let expected: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            assert_eq!(sum, expected, "[{backend}]");

            // 17 workgroups of 64 elements.
            let n = 64 * 16 + 1;
            let at = GpuTensor::zeros(ctx, &[n]).unwrap();
            let err = add(ctx, &at, &at).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Unsupported {
                        arg: "workgroups",
                        value: 17,
                        limit: 16,
                        ..
                    }
                ),
                "[{backend}] {err}"
            );

            // The LayerNorm backward's rows fit (8 rows) but its column sums do not (1100
            // columns): refused before the rows' dispatch is recorded.
            let (rows, cols) = (8, 1100);
            let x = GpuTensor::zeros(ctx, &[rows, cols]).unwrap();
            let gamma = GpuTensor::zeros(ctx, &[cols]).unwrap();
            let stats = GpuTensor::zeros(ctx, &[rows, 2]).unwrap();
            let dx = GpuTensor::zeros(ctx, &[rows, cols]).unwrap();
            let d_gamma = GpuTensor::zeros(ctx, &[cols]).unwrap();
            let d_beta = GpuTensor::zeros(ctx, &[cols]).unwrap();
            let before = ctx.recorded_counts();
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            let err = layer_norm_backward_into(
                ctx,
                &mut encoder,
                &x,
                &gamma,
                &stats,
                &x,
                [&dx, &d_gamma, &d_beta],
            )
            .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Unsupported {
                        arg: "workgroups",
                        limit: 16,
                        ..
                    }
                ),
                "[{backend}] {err}"
            );
            assert_eq!(
                ctx.recorded_counts(),
                before,
                "[{backend}] a pass was recorded"
            );

            // An attention backward whose dK/dV grid fits (one key block of one kv head) but
            // whose dQ grid does not (32 query heads): refused before its first pass.
            let (q, k, v) = views(ctx, [1, 8, 32, 8], [1, 8, 1, 8], [1, 8, 1, 8]);
            let forward = AttentionOutput {
                out: GpuTensor::zeros(ctx, &[1, 8, 32, 8]).unwrap(),
                lse: GpuTensor::zeros(ctx, &[1, 32, 8]).unwrap(),
            };
            let before = ctx.recorded_counts();
            let opts = AttentionOptions::new();
            let err = attention_backward(ctx, &q, &k, &v, &forward, &q, &opts).unwrap_err();
            assert!(
                matches!(err, Error::Unsupported { arg, limit: 16, .. } if arg.contains("workgroups")),
                "[{backend}] {err}"
            );
            assert_eq!(
                ctx.recorded_counts(),
                before,
                "[{backend}] the backward recorded a pass"
            );

            // A GEMM of more tiles of C than 16.
            let x = GpuTensor::zeros(ctx, &[64 * 17, 8]).unwrap();
            let w = GpuTensor::zeros(ctx, &[64 * 17, 8]).unwrap();
            let err = linear_forward(ctx, &x, &w, None).unwrap_err();
            assert!(
                matches!(err, Error::Unsupported { arg, limit: 16, .. } if arg.contains("workgroups")),
                "[{backend}] {err}"
            );
        },
    );
}
