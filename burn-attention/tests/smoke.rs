use burn::tensor::{module::attention, ops::AttentionModuleOptions, Device, Distribution, Tensor};
use burn_attention::{fused_attention, FusedAttentionOptions};
use wgpu_attention::ContextOptions;

#[test]
fn smoke() {
    let device = burn_attention::init(Device::wgpu_options(), &ContextOptions::new()).unwrap();
    let device = device.autodiff();
    let [b, h, l, d] = [2, 3, 33, 16];
    let t = || Tensor::<4>::random([b, h, l, d], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let (q, k, v) = (t(), t(), t());
    let out = fused_attention(q.clone(), k.clone(), v.clone(), &FusedAttentionOptions::new().causal(true)).unwrap();
    let reference = attention(q.clone(), k.clone(), v.clone(), None, None, AttentionModuleOptions { is_causal: true, ..Default::default() });
    let a: Vec<f32> = out.clone().into_data().into_vec().unwrap();
    let r: Vec<f32> = reference.clone().into_data().into_vec().unwrap();
    let err = a.iter().zip(&r).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    println!("forward max err {err}");
    let g = Tensor::<4>::random([b, h, l, d], Distribution::Normal(0.0, 1.0), &device);
    let grads = (out * g.clone()).sum().backward();
    let dq: Vec<f32> = q.grad(&grads).unwrap().into_data().into_vec().unwrap();
    let grads_r = (reference * g).sum().backward();
    let dq_r: Vec<f32> = q.grad(&grads_r).unwrap().into_data().into_vec().unwrap();
    let err = dq.iter().zip(&dq_r).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    println!("dq max err {err}");
    assert!(err < 1e-3);
}
