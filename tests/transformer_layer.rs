//! The pre-LN Transformer encoder layer on the GPU (fused attention, packed QKV views) vs the f64
//! reference layer: output, input gradient and every parameter gradient; the reference's gradients
//! against finite differences.

mod common;

use common::*;
use wgpu_attention::layers::transformer_layer::{
    init_params, param_shapes, TransformerLayer, TransformerLayerConfig,
};
use wgpu_attention::reference::transformer_layer as reference;
use wgpu_attention::GpuTensor;

#[test]
fn gpu_layer_matches_reference_forward_and_every_gradient() {
    for_each_backend(|backend, ctx| {
        for (causal, pre_ln) in [(false, true), (true, true), (true, false), (false, false)] {
            let config = TransformerLayerConfig {
                d_model: 32,
                heads: 4,
                d_ff: 64,
                causal,
                pre_ln,
            };
            let (b, l) = (2, 7);
            let params = init_params(&config, 3);
            let layer = TransformerLayer::new(ctx, config, &params).unwrap();
            let mut rng = rng(17);
            let x = random(&mut rng, b * l * 32, 1.0);
            let dy = random(&mut rng, b * l * 32, 1.0);
            let xt = GpuTensor::from_slice(ctx, &x, &[b, l, 32]).unwrap();
            let dyt = GpuTensor::from_slice(ctx, &dy, &[b, l, 32]).unwrap();
            let cache = layer.forward(ctx, &xt).unwrap();
            let (dx, grads) = layer.backward(ctx, &cache, &dyt).unwrap();

            let p64: Vec<Vec<f64>> = params.iter().map(|p| to_f64(p)).collect();
            let ry = reference::forward(&config, &p64, &to_f64(&x), b, l);
            let (rdx, rgrads) = reference::backward(&config, &p64, &to_f64(&x), &to_f64(&dy), b, l);
            let tag = format!("[{backend}] layer causal {causal} pre_ln {pre_ln}");
            assert_close(
                &format!("{tag} y"),
                &cache.y.to_vec(ctx).unwrap(),
                &ry,
                FORWARD_ATOL,
                FORWARD_RTOL * 10.0,
            );
            assert_close(
                &format!("{tag} dx"),
                &dx.to_vec(ctx).unwrap(),
                &rdx,
                BACKWARD_ATOL,
                BACKWARD_RTOL,
            );
            for ((name, _), (g, r)) in param_shapes(&config).iter().zip(grads.iter().zip(&rgrads)) {
                assert_close(
                    &format!("{tag} d {name}"),
                    &g.to_vec(ctx).unwrap(),
                    r,
                    BACKWARD_ATOL,
                    BACKWARD_RTOL,
                );
            }
        }
    });
}

#[test]
fn reference_layer_gradients_match_finite_differences() {
    for pre_ln in [true, false] {
        reference_gradients_match_finite_differences(pre_ln);
    }
}

fn reference_gradients_match_finite_differences(pre_ln: bool) {
    let config = TransformerLayerConfig {
        d_model: 8,
        heads: 2,
        d_ff: 12,
        causal: true,
        pre_ln,
    };
    let (b, l) = (1, 3);
    let params: Vec<Vec<f64>> = init_params(&config, 5).iter().map(|p| to_f64(p)).collect();
    let x: Vec<f64> = (0..b * l * 8).map(|i| (i as f64 * 0.61).sin()).collect();
    let dy: Vec<f64> = (0..b * l * 8).map(|i| (i as f64 * 1.7).cos()).collect();
    let loss = |p: &[Vec<f64>], x: &[f64]| -> f64 {
        reference::forward(&config, p, x, b, l)
            .iter()
            .zip(&dy)
            .map(|(a, g)| a * g)
            .sum()
    };
    let (dx, grads) = reference::backward(&config, &params, &x, &dy, b, l);
    let h = 1e-6;
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        let (mut xp, mut xm) = (x.clone(), x.clone());
        xp[i] += h;
        xm[i] -= h;
        let fd = (loss(&params, &xp) - loss(&params, &xm)) / (2.0 * h);
        worst = worst.max((fd - dx[i]).abs());
    }
    for (k, g) in grads.iter().enumerate() {
        for i in (0..g.len()).step_by(3) {
            let (mut pp, mut pm) = (params.clone(), params.clone());
            pp[k][i] += h;
            pm[k][i] -= h;
            let fd = (loss(&pp, &x) - loss(&pm, &x)) / (2.0 * h);
            worst = worst.max((fd - g[i]).abs());
        }
    }
    eprintln!(
        "transformer layer (pre_ln {pre_ln}) reference vs finite differences: worst {worst:.2e}"
    );
    assert!(worst < 1e-7, "worst {worst}");
}
