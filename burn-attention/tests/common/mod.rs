//! What the tests share: the registered devices, random inputs, burn's own attention as the
//! reference (built from burn ops, differentiated by burn's autodiff), and the comparison.
#![allow(dead_code)]

use std::sync::{Mutex, MutexGuard, OnceLock};

use burn::tensor::wgpu::WgpuBackend;
use burn::tensor::{Bool, Device, Distribution, Int, Tensor, TensorData};
use wgpu_attention::ContextOptions;

/// The Vulkan device (lavapipe here), registered once per test process.
pub fn vulkan() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    registered(&DEVICE, WgpuBackend::Vulkan)
}

/// The GL device (llvmpipe here), registered once per test process.
pub fn gl() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    registered(&DEVICE, WgpuBackend::Gl)
}

/// burn's device on `api`, registered with burn-attention the first time.
fn registered(slot: &OnceLock<Device>, api: WgpuBackend) -> Device {
    slot.get_or_init(|| {
        wgpu_attention::quiet_headless_start_up();
        let options = Device::wgpu_options().graphics_api(api);
        burn_attention::init(options, &ContextOptions::new())
            .unwrap_or_else(|e| panic!("a {api:?} adapter: {e}"))
    })
    .clone()
}

/// The back ends the tests run on: `WGPU_ATTENTION_TEST_BACKENDS` (comma list of `vulkan`, `gl`),
/// default both, as the library's tests (a GPU machine may have Vulkan only). Each comes with the
/// lock of its back end, taken when the iteration reaches it: wgpu's GL back end panics when a thread
/// waits more than 6 s for its context, which another test thread holds through a pipeline compile
/// on llvmpipe (the library's tests serialise each back end for the same reason). Bind it to a named
/// variable (`for (name, device, _serial) in devices()`) so that it is held through the loop's body.
pub fn devices() -> impl Iterator<Item = (&'static str, Device, MutexGuard<'static, ()>)> {
    static LOCKS: [Mutex<()>; 2] = [const { Mutex::new(()) }; 2];
    let lock = |i: usize| LOCKS[i].lock().unwrap_or_else(|e| e.into_inner());
    let listed = std::env::var("WGPU_ATTENTION_TEST_BACKENDS").unwrap_or("vulkan,gl".into());
    let names: Vec<String> = listed.split(',').map(|s| s.trim().to_string()).collect();
    names.into_iter().map(move |name| match name.as_str() {
        "vulkan" => ("vulkan", vulkan(), lock(0)),
        "gl" => ("gl", gl(), lock(1)),
        other => panic!("WGPU_ATTENTION_TEST_BACKENDS: '{other}' is not vulkan or gl"),
    })
}

/// A random normal tensor, tracked on an autodiff device.
pub fn input<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    let t = Tensor::<D>::random(shape, Distribution::Normal(0.0, 1.0), device);
    match device.is_autodiff() {
        true => t.require_grad(),
        false => t,
    }
}

pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec()
        .expect("f32 data")
}

/// Asserts `|got - want| <= atol * max|want| + rtol * |want|` elementwise; returns the worst
/// absolute error (printed for the closing notes).
pub fn assert_close(name: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{name}: lengths");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= atol * scale + rtol * w.abs(),
            "{name}[{i}]: got {g}, burn {w} (|err| {err}, max|burn| {scale})"
        );
        worst = worst.max(err);
    }
    println!("{name}: worst |err| {worst:.3e} (max|burn| {scale:.3e})");
    worst
}

/// Forward tolerance of the numerical contract (SPEC: rtol 1e-4, atol scaled to the data).
pub const FORWARD: (f32, f32) = (1e-4, 1e-5);
/// Backward tolerance (SPEC: rtol 1e-3).
pub const BACKWARD: (f32, f32) = (1e-3, 1e-4);

/// What burn's unfused reference takes besides Q, K, V.
#[derive(Clone, Default)]
pub struct Reference {
    pub scale: Option<f32>,
    pub softcap: Option<f32>,
    pub causal: bool,
    /// `true` masks the pair.
    pub mask: Option<Tensor<4, Bool>>,
    pub bias: Option<Tensor<4>>,
    pub sinks: Option<Tensor<1>>,
    /// Rows whose output (and gradient) is zero: `[B, 1, Lq, 1]` of 1 and 0.
    pub row_keep: Option<Tensor<4>>,
}

/// burn's attention made of burn's ops (what `burn::tensor::module::attention` runs under
/// autodiff, plus sinks and GQA): `softmax(softcap(Q K^T s) + bias, masked) V`.
pub fn reference(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, r: &Reference) -> Tensor<4> {
    let [b, h, lq, dk] = q.dims();
    let device = q.device();
    let [_, hkv, lk, dv] = v.dims();
    let group = h / hkv;
    let repeat = |t: Tensor<4>, d: usize| {
        t.reshape([b, hkv, 1, lk, d])
            .expand([b, hkv, group, lk, d])
            .reshape([b, h, lk, d])
    };
    let (k, v) = (repeat(k, dk), repeat(v, dv));
    let scale = r.scale.unwrap_or(1.0 / (dk as f32).sqrt());
    let mut scores = q.matmul(k.swap_dims(2, 3)) * scale;
    if let Some(cap) = r.softcap {
        scores = (scores / cap).tanh() * cap;
    }
    if let Some(bias) = &r.bias {
        scores = scores + bias.clone();
    }
    let mut mask = r.mask.clone();
    if r.causal {
        let causal = Tensor::<4, Bool>::from_data(
            TensorData::new(
                (0..lq * lk)
                    .map(|x| x % lk > x / lk + lk - lq)
                    .collect::<Vec<_>>(),
                [1, 1, lq, lk],
            ),
            &device,
        )
        .expand([b, h, lq, lk]);
        mask = Some(match mask {
            Some(m) => m.bool_or(causal),
            None => causal,
        });
    }
    if let Some(mask) = mask {
        scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    }
    if let Some(sinks) = &r.sinks {
        let column = sinks.clone().reshape([1, h, 1, 1]).expand([b, h, lq, 1]);
        scores = Tensor::cat(vec![scores, column], 3);
    }
    let max = scores.clone().max_dim(3).detach();
    let p = (scores - max).exp();
    let p = p.clone() / p.sum_dim(3);
    let p = match r.sinks {
        Some(_) => p.narrow(3, 0, lk),
        None => p,
    };
    let out = p.matmul(v);
    match &r.row_keep {
        Some(keep) => out * keep.clone(),
        None => out,
    }
}

/// A `[B, H, Lq, Lk]` bool mask from a per-pair rule `masked(b, i, j)`.
pub fn mask(
    [b, h, lq, lk]: [usize; 4],
    device: &Device,
    masked: impl Fn(usize, usize, usize) -> bool,
) -> Tensor<4, Bool> {
    let data: Vec<bool> = (0..b * lq * lk)
        .map(|x| masked(x / (lq * lk), x / lk % lq, x % lk))
        .collect();
    Tensor::<4, Bool>::from_data(TensorData::new(data, [b, 1, lq, lk]), device)
        .expand([b, h, lq, lk])
}

/// Integer indices on `device`.
pub fn indices(data: Vec<i64>, device: &Device) -> Tensor<1, Int> {
    let n = data.len();
    Tensor::<1, Int>::from_data(TensorData::new(data, [n]), device)
}
