//! The API boundary (issue 26): mistakes a user embedding the library can make get a typed error
//! before anything is recorded (never `Ok` and then a wgpu error in the user's `queue.submit`), and
//! wrapping a user's device has no side effect on it.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use common::*;
use wgpu_attention::device::{BindingCache, LLVMPIPE_LOOP_BUDGET};
use wgpu_attention::kernels::embedding::embedding_forward;
use wgpu_attention::{
    attention_backward_into, attention_backward_workspace, attention_forward,
    attention_forward_into, AttentionOptions, AttentionShape, BackwardViews, Context, DType, Error,
    ForwardViews, GpuTensor, GpuTensorF16, GpuTokens, HeadsView,
};

fn encoder(ctx: &Context) -> wgpu::CommandEncoder {
    ctx.device().create_command_encoder(&Default::default())
}

/// A storage buffer of `bytes` the application created itself.
fn user_buffer(ctx: &Context, bytes: u64) -> wgpu::Buffer {
    ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("user buffer"),
        size: bytes,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    })
}

/// An output in the buffer of an input, at a disjoint range: wgpu tracks usage per buffer, so this
/// used to return `Ok` and fail at submit ("conflicting usages"). Now a typed error naming both.
#[test]
fn an_output_in_the_buffer_of_an_input_is_refused() {
    for_each_backend(|_, ctx| {
        let (b, l, h, d) = (1, 4, 2, 8);
        let n = b * l * h * d;
        // Q, K, V and then O, side by side in one packed buffer [B, L, 4 * H * D].
        let packed = GpuTensor::zeros(ctx, &[b, l, 4 * h * d]).unwrap();
        let [q, k, v, out] = [0, 1, 2, 3].map(|i| packed.split_heads(i * h * d, h, d).unwrap());
        let lse = GpuTensor::zeros(ctx, &[b, h, l]).unwrap();
        let mut enc = encoder(ctx);
        let err = attention_forward_into(
            ctx,
            &mut enc,
            &ForwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &lse,
            },
            &AttentionOptions::new(),
        )
        .expect_err("out shares the buffer of q");
        assert!(
            matches!(
                err,
                Error::Aliasing {
                    arg: "out",
                    other: "q",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("per buffer"), "{err}");
        // The same with a buffer the application owns, wrapped at two aligned ranges.
        let buffer = user_buffer(ctx, 2 * 256 * (n as u64 * 4).div_ceil(256));
        let stride = (n * 4).div_ceil(256) * 64;
        let x = GpuTensor::from_buffer_at(buffer.clone(), 0, &[b, l, h, d]).unwrap();
        let y = GpuTensor::from_buffer_at(buffer, stride, &[b, l, h, d]).unwrap();
        let err = attention_forward_into(
            ctx,
            &mut enc,
            &ForwardViews {
                q: &x.heads().unwrap(),
                k: &x.heads().unwrap(),
                v: &x.heads().unwrap(),
                out: &y.heads().unwrap(),
                lse: &lse,
            },
            &AttentionOptions::new(),
        )
        .expect_err("out shares the buffer of q");
        assert!(matches!(err, Error::Aliasing { arg: "out", .. }), "{err}");
        // Nothing was recorded: the encoder finishes and submits cleanly.
        ctx.queue().submit([enc.finish()]);
        ctx.synchronize().unwrap();
    });
}

/// Gradients written over each other (the same tensor as dk and dv) used to be `Ok`; packed
/// gradients at interleaved columns of one buffer (a dQKV projection) stay allowed.
#[test]
fn overlapping_gradient_outputs_are_refused_and_packed_ones_run() {
    for_each_backend(|_, ctx| {
        let (b, l, h, d) = (1, 4, 2, 8);
        let make = || {
            GpuTensor::zeros(ctx, &[b, l, h, d])
                .unwrap()
                .heads()
                .unwrap()
        };
        let (q, k, v, d_out) = (make(), make(), make(), make());
        let opts = AttentionOptions::new();
        let fwd = attention_forward(ctx, &q, &k, &v, &opts).unwrap();
        let shape = AttentionShape::of(&q, &k, &v).unwrap();
        let workspace = attention_backward_workspace(ctx, &shape).unwrap();
        let (dq, dkv) = (make(), make());
        let out = fwd.out.heads().unwrap();
        let mut enc = encoder(ctx);
        let err = attention_backward_into(
            ctx,
            &mut enc,
            &BackwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &fwd.lse,
                d_out: &d_out,
                dq: &dq,
                dk: &dkv,
                dv: &dkv,
                workspace: &workspace,
            },
            &opts,
        )
        .expect_err("dk and dv are one tensor");
        assert!(
            matches!(
                err,
                Error::Aliasing {
                    arg: "dv",
                    other: "dk",
                    ..
                }
            ),
            "{err}"
        );
        let err = attention_backward_into(
            ctx,
            &mut enc,
            &BackwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &fwd.lse,
                d_out: &d_out,
                dq: &dq,
                dk: &dq,
                dv: &dq,
                workspace: &workspace,
            },
            &opts,
        )
        .expect_err("dq, dk and dv are one tensor");
        assert!(matches!(err, Error::Aliasing { arg: "dk", .. }), "{err}");
        // The packed layout: dQ, dK and dV at columns 0, HD and 2HD of [B, L, 3HD].
        let packed = GpuTensor::zeros(ctx, &[b, l, 3 * h * d]).unwrap();
        let [dq, dk, dv] = [0, 1, 2].map(|i| packed.split_heads(i * h * d, h, d).unwrap());
        attention_backward_into(
            ctx,
            &mut enc,
            &BackwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &fwd.lse,
                d_out: &d_out,
                dq: &dq,
                dk: &dk,
                dv: &dv,
                workspace: &workspace,
            },
            &opts,
        )
        .unwrap();
        ctx.queue().submit([enc.finish()]);
        ctx.synchronize().unwrap();
    });
}

/// A tensor of another context: a typed error that says so (it used to read "shares a buffer
/// with an input", or fail in wgpu with "device doesn't match").
#[test]
fn tensors_of_another_context_are_refused_by_name() {
    for_each_backend(|name, ctx| {
        let other = fresh_context(name, ctx);
        let mine = GpuTensor::zeros(ctx, &[1, 4, 2, 8])
            .unwrap()
            .heads()
            .unwrap();
        let theirs = GpuTensor::zeros(&other, &[1, 4, 2, 8])
            .unwrap()
            .heads()
            .unwrap();
        let err = attention_forward(ctx, &mine, &theirs, &mine, &AttentionOptions::new())
            .expect_err("k belongs to another context");
        assert!(
            matches!(err, Error::ForeignTensor { arg: "k", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("another Context"), "{err}");
        let tokens = GpuTokens::from_slice(&other, &[0, 1], &[2]).unwrap();
        let table = GpuTensor::zeros(ctx, &[4, 8]).unwrap();
        let err = embedding_forward(ctx, &tokens, &table).expect_err("tokens of another context");
        assert!(
            matches!(err, Error::ForeignTensor { arg: "tokens", .. }),
            "{err}"
        );
        // Writes through the wrong context are refused too, not handed to its queue.
        let mut tokens = tokens;
        let err = tokens
            .write(ctx, &[1, 0])
            .expect_err("another context's tokens");
        assert!(
            matches!(err, Error::ForeignTensor { arg: "tokens", .. }),
            "{err}"
        );
        let theirs = GpuTensor::zeros(&other, &[2]).unwrap();
        let err = theirs
            .write(ctx, &[1.0, 2.0])
            .expect_err("another context's tensor");
        assert!(
            matches!(err, Error::ForeignTensor { arg: "tensor", .. }),
            "{err}"
        );
        let theirs = GpuTensorF16::zeros(&other, &[2]).unwrap();
        let halves = [half::f16::ONE; 2];
        let err = theirs
            .write(ctx, &halves)
            .expect_err("another context's f16 tensor");
        assert!(
            matches!(err, Error::ForeignTensor { arg: "tensor", .. }),
            "{err}"
        );
        // Through its own context each write is fine.
        tokens.write(&other, &[1, 0]).unwrap();
        theirs.write(&other, &halves).unwrap();
    });
}

/// Views whose arithmetic overflows, and f16 views whose whole-word binding would pass the
/// buffer's end, are refused when they are made (both used to be accepted).
#[test]
fn views_are_checked_without_wrapping_and_in_whole_words() {
    for_each_backend(|_, ctx| {
        let buffer = user_buffer(ctx, 4096);
        let err = HeadsView::new(buffer.clone(), usize::MAX - 10, [1, 1, 1, 16], [16, 16, 16])
            .expect_err("offset past usize");
        assert!(err.to_string().contains("overflow"), "{err}");
        let err = HeadsView::new(buffer.clone(), 0, [3, 1, 1, 4], [usize::MAX / 2, 4, 4])
            .expect_err("stride past usize");
        assert!(err.to_string().contains("overflow"), "{err}");
        // Three f16 values are 6 bytes; a binding of them is 8.
        let six = user_buffer(ctx, 6);
        let err = HeadsView::new_typed(six.clone(), DType::F16, 0, [1, 1, 1, 3], [3, 3, 3])
            .expect_err("binding of 8 bytes over a 6-byte buffer");
        assert!(err.to_string().contains("4-byte words"), "{err}");
        assert!(wgpu_attention::GpuTensorF16::from_buffer(six, &[3]).is_err());
        let eight = user_buffer(ctx, 8);
        HeadsView::new_typed(eight, DType::F16, 0, [1, 1, 1, 3], [3, 3, 3]).unwrap();
    });
}

/// Clones of a token tensor share their host copy: ids written through one are the ones every
/// clone validates (a clone used to keep validating the ids it was made with).
#[test]
fn token_clones_validate_what_the_kernels_read() {
    for_each_backend(|_, ctx| {
        let mut tokens = GpuTokens::from_slice(ctx, &[0, 1], &[2]).unwrap();
        let clone = tokens.clone();
        let table = GpuTensor::zeros(ctx, &[4, 8]).unwrap();
        embedding_forward(ctx, &clone, &table).unwrap();
        tokens.write(ctx, &[1000, 1]).unwrap();
        let err = embedding_forward(ctx, &clone, &table).expect_err("id 1000 of a vocabulary of 4");
        assert!(err.to_string().contains("1000"), "{err}");
        ctx.synchronize().unwrap();
    });
}

/// A user's Vulkan device (lavapipe where CI runs), as an application creates it.
fn user_device() -> Option<(wgpu::Device, wgpu::Queue, wgpu::AdapterInfo)> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let adapter = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN))
        .into_iter()
        .next()?;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .ok()?;
    Some((device, queue, adapter.get_info()))
}

/// A small Q, attention over it run on `ctx` and waited for: the wrapped-device tests' work before
/// they destroy the device.
fn forward_and_wait(ctx: &Context) -> HeadsView {
    let q = GpuTensor::zeros(ctx, &[1, 4, 2, 8])
        .unwrap()
        .heads()
        .unwrap();
    attention_forward(ctx, &q, &q, &q, &AttentionOptions::new()).unwrap();
    ctx.synchronize().unwrap();
    q
}

/// Wrapping a device leaves the application's device-lost callback in place (the library used to
/// replace it), and the context learns of a loss through the handler the application chains.
/// What the kernels need of the adapter comes from the device itself: the llvmpipe loop budget
/// (silently wrong results without it) no longer depends on an `adapter_info` argument.
#[test]
fn wrapping_a_device_has_no_side_effect() {
    let Some((device, queue, info)) = user_device() else {
        eprintln!("no Vulkan adapter: skipped");
        return;
    };
    let app_saw_loss = Arc::new(AtomicBool::new(false));
    let ctx = Arc::new(Context::from_device(device.clone(), queue).unwrap());
    assert_eq!(ctx.report().name, info.name);
    if info.name.to_lowercase().contains("llvmpipe") {
        assert_eq!(ctx.loop_budget(), Some(LLVMPIPE_LOOP_BUDGET));
    }
    // Runtime checks stay on for a device the library does not own.
    assert!(!ctx.trusted_shaders());
    assert!(!ctx.owns_device());
    {
        // The application installs its callback after wrapping and chains the context's handler.
        let (seen, chained) = (app_saw_loss.clone(), ctx.device_lost_handler());
        device.set_device_lost_callback(move |reason, message| {
            seen.store(true, Ordering::SeqCst);
            chained(reason, message);
        });
    }
    forward_and_wait(&ctx);
    device.destroy();
    let _ = device.poll(wgpu::PollType::wait_indefinitely());
    assert!(
        app_saw_loss.load(Ordering::SeqCst),
        "the app's callback ran"
    );
    assert!(matches!(ctx.check_lost(), Err(Error::DeviceLost(_))));
}

/// A binding cache lent on one thread holds only that thread's work: another thread recording on
/// the same context meanwhile neither uses nor fills it (it used to, growing the trainer's cache
/// with unrelated bind groups and keeping their buffers alive).
#[test]
fn a_binding_cache_holds_only_its_owners_work() {
    for_each_backend(|name, shared| {
        let ctx = fresh_context(name, shared);
        let q = GpuTensor::zeros(&ctx, &[1, 4, 2, 8])
            .unwrap()
            .heads()
            .unwrap();
        let opts = AttentionOptions::new();
        let (out, lse) = (
            GpuTensor::zeros(&ctx, &[1, 4, 2, 8]).unwrap(),
            GpuTensor::zeros(&ctx, &[1, 2, 4]).unwrap(),
        );
        // The owner records into the same outputs every step; the other thread allocates its own.
        let record = |ctx: &Context| {
            let mut enc = encoder(ctx);
            let out = out.heads().unwrap();
            attention_forward_into(
                ctx,
                &mut enc,
                &ForwardViews {
                    q: &q,
                    k: &q,
                    v: &q,
                    out: &out,
                    lse: &lse,
                },
                &opts,
            )
            .unwrap();
            ctx.queue().submit([enc.finish()]);
        };
        let other = |ctx: &Context| {
            attention_forward(ctx, &q, &q, &q, &opts).unwrap();
        };
        // What one forward creates, alone.
        let mut alone = BindingCache::default();
        ctx.with_binding_cache(&mut alone, || record(&ctx));
        let (per_call, _) = alone.counts();
        assert!(per_call > 0);

        let mut owned = BindingCache::default();
        let (lent, other_done) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|scope| {
            scope.spawn(|| {
                lent.wait();
                for _ in 0..5 {
                    other(&ctx);
                }
                other_done.wait();
            });
            ctx.with_binding_cache(&mut owned, || {
                lent.wait();
                other_done.wait();
                record(&ctx)
            });
        });
        assert_eq!(owned.counts(), (per_call, 0));
        // Reused, not grown, on the next step.
        ctx.with_binding_cache(&mut owned, || record(&ctx));
        assert_eq!(owned.counts(), (per_call, per_call));
        // A long run beside another thread: the cache stays at one bind group, and the memory the
        // context holds returns to the same figure after every round (nothing kept alive).
        ctx.synchronize().unwrap();
        let steady = ctx.memory().current_bytes;
        for round in 0..20 {
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    for _ in 0..3 {
                        other(&ctx);
                    }
                });
                for _ in 0..3 {
                    ctx.with_binding_cache(&mut owned, || record(&ctx));
                }
            });
            ctx.synchronize().unwrap();
            assert_eq!(owned.counts().0, per_call, "round {round}");
            assert_eq!(ctx.memory().current_bytes, steady, "round {round}");
        }
    });
}

/// f16 tensors as ranges of an application's arena (`from_buffer_at`) and split out of a packed
/// projection (`split_heads`), as f32 tensors can be.
#[test]
fn f16_tensors_in_an_arena_and_split_into_heads() {
    for_each_backend(|name, ctx| {
        if !ctx.device().features().contains(wgpu::Features::SHADER_F16) {
            eprintln!("[{name}] no SHADER_F16: skipped");
            return;
        }
        let arena = ctx.device().create_buffer(&wgpu::BufferDescriptor {
            label: Some("f16 arena"),
            size: 512 + 8,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let err = GpuTensorF16::from_buffer_at(arena.clone(), 64, &[3]).expect_err("unaligned");
        assert!(err.to_string().contains("256 bytes"), "{err}");
        let a = GpuTensorF16::from_buffer_at(arena.clone(), 0, &[5]).unwrap();
        let b = GpuTensorF16::from_buffer_at(arena.clone(), 128, &[3]).unwrap();
        let c = GpuTensorF16::from_buffer_at(arena.clone(), 256, &[3]).unwrap();
        let values = |x: &[f32]| {
            x.iter()
                .map(|&v| half::f16::from_f32(v))
                .collect::<Vec<_>>()
        };
        a.write(ctx, &values(&[1.0, 2.0, 3.0, 4.0, 5.0])).unwrap();
        b.write(ctx, &values(&[6.0, 7.0, 8.0])).unwrap();
        c.write(ctx, &values(&[9.0, 10.0, 11.0])).unwrap();
        assert_eq!(a.to_vec(ctx).unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(b.to_vec(ctx).unwrap(), [6.0, 7.0, 8.0]);
        assert_eq!(c.to_vec(ctx).unwrap(), [9.0, 10.0, 11.0]);
        // Q, K and V split out of one packed f16 projection give what separate tensors give.
        let (l, h, d) = (5, 2, 8);
        let mut r = rng(3);
        let packed_values = random(&mut r, l * 3 * h * d, 1.0);
        let packed = GpuTensorF16::from_f32(ctx, &packed_values, &[1, l, 3 * h * d]).unwrap();
        let [q, k, v] = [0, 1, 2].map(|i| packed.split_heads(i * h * d, h, d).unwrap());
        let opts = AttentionOptions::new().causal(true);
        let out = |q: &HeadsView, k: &HeadsView, v: &HeadsView| {
            let o = GpuTensorF16::zeros(ctx, &[1, l, h, d]).unwrap();
            let lse = GpuTensor::zeros(ctx, &[1, h, l]).unwrap();
            let mut enc = encoder(ctx);
            attention_forward_into(
                ctx,
                &mut enc,
                &ForwardViews {
                    q,
                    k,
                    v,
                    out: &o.heads().unwrap(),
                    lse: &lse,
                },
                &opts,
            )
            .unwrap();
            ctx.queue().submit([enc.finish()]);
            o.to_vec(ctx).unwrap()
        };
        let column = |i: usize| -> Vec<f32> {
            packed_values
                .chunks(3 * h * d)
                .flat_map(|row| row[i * h * d..(i + 1) * h * d].to_vec())
                .collect()
        };
        let separate = [0, 1, 2].map(|i| {
            GpuTensorF16::from_f32(ctx, &column(i), &[1, l, h, d])
                .unwrap()
                .heads()
                .unwrap()
        });
        assert_eq!(
            out(&q, &k, &v),
            out(&separate[0], &separate[1], &separate[2])
        );
    });
}

/// The forward without an lse of the caller's (inference) writes the same O, bitwise.
#[test]
fn the_forward_without_lse_writes_the_same_output() {
    for_each_family(|_, ctx| {
        let mut r = rng(11);
        let shape = [2, 7, 2, 8];
        let make = |r: &mut _| upload(ctx, &random(r, 2 * 7 * 2 * 8, 1.0), shape);
        let (q, k, v) = (make(&mut r), make(&mut r), make(&mut r));
        let opts = AttentionOptions::new().causal(true);
        let full = attention_forward(ctx, &q, &k, &v, &opts).unwrap();
        let out = GpuTensor::zeros(ctx, &shape).unwrap();
        let mut enc = encoder(ctx);
        wgpu_attention::attention_forward_out_into(
            ctx,
            &mut enc,
            &q,
            &k,
            &v,
            &out.heads().unwrap(),
            &opts,
        )
        .unwrap();
        ctx.queue().submit([enc.finish()]);
        let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(
            bits(out.to_vec(ctx).unwrap()),
            bits(full.out.to_vec(ctx).unwrap())
        );
    });
}

/// A wrapped device destroyed while the application forwards nothing to the context, which keeps
/// its own uncaptured-error handler: attention calls neither panic inside wgpu (the parameter
/// buffers' `create_buffer_init` did, mapping on a lost device) nor return results from it; what
/// the device reports goes to the application's handler.
#[test]
fn a_wrapped_device_lost_without_forwarding_does_not_panic() {
    let Some((device, queue, _)) = user_device() else {
        eprintln!("no Vulkan adapter: skipped");
        return;
    };
    let reported = Arc::new(AtomicBool::new(false));
    {
        let reported = reported.clone();
        device.on_uncaptured_error(Arc::new(move |_| reported.store(true, Ordering::SeqCst)));
    }
    let ctx = Context::from_device(device.clone(), queue).unwrap();
    let q = forward_and_wait(&ctx);
    assert!(!reported.load(Ordering::SeqCst));
    device.destroy();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let out = attention_forward(&ctx, &q, &q, &q, &AttentionOptions::new())?;
        out.out.to_vec(&ctx)
    }));
    let result = result.expect("attention_forward panicked on a lost device");
    assert!(result.is_err(), "a readback from a lost device: {result:?}");
    assert!(
        reported.load(Ordering::SeqCst),
        "the application's handler heard of it"
    );
}

/// `GpuTokens::write` between recording a call and submitting it (a block table's ids among
/// them): the recorded call reads the ids it validated, later calls the new ones; an id the
/// recorded call never validated (past the vocabulary) never reaches it.
#[test]
fn token_ids_written_after_recording_reach_only_later_calls() {
    use wgpu_attention::kernels::embedding::embedding_forward_into;
    for_each_backend(|name, ctx| {
        let table: Vec<f32> = (0..4 * 8).map(|x| x as f32).collect();
        let table = GpuTensor::from_slice(ctx, &table, &[4, 8]).unwrap();
        let mut tokens = GpuTokens::from_slice(ctx, &[0, 1, 2], &[3]).unwrap();
        let outputs = [0, 1, 2].map(|_| GpuTensor::zeros(ctx, &[3, 8]).unwrap());
        let mut enc = encoder(ctx);
        embedding_forward_into(ctx, &mut enc, &tokens, &table, &outputs[0]).unwrap();
        tokens.write(ctx, &[3, 3, 1]).unwrap();
        embedding_forward_into(ctx, &mut enc, &tokens, &table, &outputs[1]).unwrap();
        // Written after the last call recorded here (and past the vocabulary of 4): no call of
        // this encoder reads it.
        tokens.write(ctx, &[1000, 0, 0]).unwrap();
        tokens.write(ctx, &[2, 0, 3]).unwrap();
        ctx.queue().submit([enc.finish()]);
        let mut enc = encoder(ctx);
        embedding_forward_into(ctx, &mut enc, &tokens, &table, &outputs[2]).unwrap();
        ctx.queue().submit([enc.finish()]);
        for (out, ids) in outputs.iter().zip([[0, 1, 2], [3, 3, 1], [2, 0, 3]]) {
            let want: Vec<f32> = ids
                .iter()
                .flat_map(|&i| (0..8).map(move |d| (i * 8 + d) as f32))
                .collect();
            assert_eq!(out.to_vec(ctx).unwrap(), want, "[{name}] ids {ids:?}");
        }
    });
}

/// `SeqLens::write` between recording a call and submitting it: the recorded call reads the
/// lengths it validated, later calls the new ones (issue 46: the kernel read lengths written after
/// it was recorded, and a causal call validated at [4, 4] ran unmasked at [1000, 1000]). In an
/// encoder of its own per call and inside one shared pass; the results bit for bit those of calls
/// made with fresh lengths.
#[test]
fn lengths_written_after_recording_reach_only_later_calls() {
    use wgpu_attention::SeqLens;
    for_each_backend(|name, ctx| {
        let mut r = rng(46);
        let shape = [2, 8, 1, 8];
        let make = |r: &mut _| upload(ctx, &random(r, 2 * 8 * 8, 1.0), shape);
        let (q, k, v) = (make(&mut r), make(&mut r), make(&mut r));
        let bits = |t: &GpuTensor| -> Vec<u32> {
            t.to_vec(ctx)
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        };
        // What a call with fresh lengths `kv` gives.
        let expected = |kv: &[u32]| {
            let lens = SeqLens::new(ctx, None, Some(kv)).unwrap();
            let opts = AttentionOptions::new().seq_lens(&lens);
            bits(&attention_forward(ctx, &q, &k, &v, &opts).unwrap().out)
        };
        let outputs = || GpuTensor::zeros(ctx, &shape).unwrap();
        let lse = GpuTensor::zeros(ctx, &[2, 1, 8]).unwrap();
        let record = |enc: &mut wgpu::CommandEncoder, lens: &SeqLens, out: &GpuTensor| {
            let views = ForwardViews {
                q: &q,
                k: &k,
                v: &v,
                out: &out.heads().unwrap(),
                lse: &lse,
            };
            attention_forward_into(ctx, enc, &views, &AttentionOptions::new().seq_lens(lens))
                .unwrap();
        };
        for shared_pass in [false, true] {
            let mut lens = SeqLens::new(ctx, None, Some(&[4, 4])).unwrap();
            let (first, second, third) = (outputs(), outputs(), outputs());
            let mut enc = encoder(ctx);
            let mut steps = |enc: &mut wgpu::CommandEncoder| {
                record(enc, &lens, &first);
                lens.write(ctx, None, Some(&[8, 3])).unwrap();
                record(enc, &lens, &second);
                // Written after the last call recorded here: no call of this encoder reads it.
                lens.write(ctx, None, Some(&[1000, 1000])).unwrap();
                lens.write(ctx, None, Some(&[2, 6])).unwrap();
            };
            match shared_pass {
                false => steps(&mut enc),
                true => ctx.with_one_pass(&mut enc, "lengths test", |enc| steps(enc)),
            }
            ctx.queue().submit([enc.finish()]);
            let mut enc = encoder(ctx);
            record(&mut enc, &lens, &third);
            ctx.queue().submit([enc.finish()]);
            let case = format!("{name}, shared pass {shared_pass}");
            assert_eq!(bits(&first), expected(&[4, 4]), "{case}: first call");
            assert_eq!(bits(&second), expected(&[8, 3]), "{case}: second call");
            assert_eq!(bits(&third), expected(&[2, 6]), "{case}: after the submit");
        }
        // Lengths are written through the context that made them.
        let other = fresh_context(name, ctx);
        let mut lens = SeqLens::new(ctx, None, Some(&[4, 4])).unwrap();
        let err = lens.write(&other, None, Some(&[1, 1])).unwrap_err();
        assert!(
            matches!(
                err,
                Error::ForeignTensor {
                    arg: "seq_lens",
                    ..
                }
            ),
            "{err}"
        );
    });
}
