//! One Transformer layer on the GPU (`EncoderLayer`, as the benchmark's layer case runs it: fused
//! attention on packed QKV views, causal or not, pre- or post-LN) vs the f64 reference layer:
//! output, input gradient and every parameter gradient; the reference's gradients against finite
//! differences.

use crate::common;

use common::*;
use wgpu_attention_transformer::layer_case::LayerCase;
use wgpu_attention_transformer::reference::transformer_layer::{
    self as reference, init_params, param_shapes, TransformerLayerConfig,
};

#[test]
fn gpu_layer_matches_reference_forward_and_every_gradient() {
    for_each_backend(|backend, ctx| {
        for (causal, pre_ln) in [(false, true), (true, true), (true, false), (false, false)] {
            let config = TransformerLayerConfig::default()
                .d_model(32)
                .heads(4)
                .d_ff(64)
                .causal(causal)
                .pre_ln(pre_ln);
            let (b, l) = (2, 7);
            let mut rng = rng(17);
            let x = random(&mut rng, b * l * 32, 1.0);
            let dy = random(&mut rng, b * l * 32, 1.0);
            let layer = LayerCase::new(ctx, config, b, l, &x, &dy, 3).unwrap();
            layer.run(ctx).unwrap();
            let got = layer.results(ctx).unwrap();

            let p64 = layer.reference_params(ctx).unwrap();
            let ry = reference::forward(&config, &p64, &to_f64(&x), b, l);
            let (rdx, rgrads) = reference::backward(&config, &p64, &to_f64(&x), &to_f64(&dy), b, l);
            let tag = format!("[{backend}] layer causal {causal} pre_ln {pre_ln}");
            assert_close(
                &format!("{tag} y"),
                &got.y,
                &ry,
                FORWARD_ATOL,
                FORWARD_RTOL * 10.0,
            );
            assert_close(
                &format!("{tag} dx"),
                &got.dx,
                &rdx,
                BACKWARD_ATOL,
                BACKWARD_RTOL,
            );
            for ((name, _), (g, r)) in param_shapes(&config)
                .iter()
                .zip(got.grads.iter().zip(&rgrads))
            {
                assert_close(
                    &format!("{tag} d {name}"),
                    g,
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
    let config = TransformerLayerConfig::default()
        .d_model(8)
        .heads(2)
        .d_ff(12)
        .causal(true)
        .pre_ln(pre_ln);
    let (b, l) = (1, 3);
    let params = init_params(&config, 5);
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
