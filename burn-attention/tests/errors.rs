//! Typed errors before any work: tensors on an unregistered device, on two devices, of another
//! dtype, and shapes or options the kernels refuse.

mod common;

use burn::tensor::{DType, Device, DeviceKind, Tensor};
use burn_attention::{fused_attention, Error, FusedAttentionOptions};
use common::*;

fn qkv(device: &Device) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let t = || input([1, 2, 8, 16], device);
    (t(), t(), t())
}

#[test]
fn unregistered_device() {
    wgpu_attention::quiet_headless_start_up();
    // burn brings this runtime up lazily, without handing its wgpu device to the kernels.
    let device = Device::wgpu(DeviceKind::Cpu);
    let (q, k, v) = qkv(&device);
    match fused_attention(q, k, v, &FusedAttentionOptions::new()) {
        Err(Error::Device {
            arg: "q", message, ..
        }) => assert!(message.contains("registered")),
        other => panic!("expected a device error for q, got {other:?}"),
    }
}

#[test]
fn tensors_on_two_devices() {
    // Both back ends' locks are held for the whole test.
    let devices: Vec<_> = devices().collect();
    let [(_, first, _first_lock), (_, second, _second_lock), ..] = &devices[..] else {
        println!("one back end listed (WGPU_ATTENTION_TEST_BACKENDS): no second device to mix");
        return;
    };
    let (q, _, v) = qkv(first);
    let (_, k, _) = qkv(second);
    match fused_attention(q, k, v, &FusedAttentionOptions::new()) {
        Err(Error::Device { arg: "k", .. }) => {}
        other => panic!("expected a device error for k, got {other:?}"),
    }
    // Plain and autodiff tensors of one device mix as burn's ops mix them: the plain one is a
    // constant.
    let (q, k, _) = qkv(&vulkan().autodiff());
    let (_, _, v) = qkv(&vulkan());
    let out = fused_attention(q.clone(), k, v, &FusedAttentionOptions::new()).expect("mixed");
    assert!(q.grad(&out.sum().backward()).is_some());
}

#[test]
fn unsupported_dtype() {
    let device = vulkan();
    let (q, k, v) = qkv(&device);
    let q = q.cast(DType::BF16);
    match fused_attention(q, k, v, &FusedAttentionOptions::new()) {
        Err(Error::DType { arg: "q", .. }) => {}
        other => panic!("expected a dtype error for q, got {other:?}"),
    }
}

#[test]
fn refused_shapes_and_options_are_the_library_errors() {
    let device = vulkan();
    let (q, k, v) = qkv(&device);
    // Dk of K differs from Q's.
    let narrow_k = k.clone().narrow(3, 0, 8);
    let error = fused_attention(
        q.clone(),
        narrow_k,
        v.clone(),
        &FusedAttentionOptions::new(),
    )
    .expect_err("mismatched head_dim");
    assert!(
        matches!(error, Error::Attention(wgpu_attention::Error::Shape { .. })),
        "{error:?}"
    );
    // Lengths for 3 sequences in a batch of 1.
    let lens = FusedAttentionOptions::new().kv_lens([8u32, 8, 8]);
    let error = fused_attention(q.clone(), k.clone(), v.clone(), &lens).expect_err("lengths");
    assert!(matches!(error, Error::Attention(_)), "{error:?}");
    // The next call on the thread is not answered with the refusal of the last one.
    fused_attention(q, k, v, &FusedAttentionOptions::new()).expect("a valid call");
}

#[test]
fn runs_on_the_configured_back_end() {
    use burn::backend::{Backend, Dispatch};
    // The same tests run with burn's fusion (the default feature) and without it: check which one
    // this build dispatches through, so both configurations are what they claim.
    let name = Dispatch::name(vulkan().as_dispatch());
    assert_eq!(
        name.contains("fusion<"),
        cfg!(feature = "fusion"),
        "backend {name}"
    );
    let (q, k, v) = qkv(&vulkan());
    fused_attention(q, k, v, &FusedAttentionOptions::new()).expect("runs there");
}

#[test]
fn a_device_init_brings_up_runs_the_listed_kernels_without_runtime_checks() {
    // `init` creates the device, as `Context::new` does: the kernels listed as safe go without
    // wgpu's runtime checks, which cost the fused kernels much of their speed on GPUs.
    let ctx = burn_attention::context(&vulkan()).expect("registered");
    assert!(ctx.trusted_shaders());
}
