//! AdamW with bias correction and global-norm clipping (SPEC.md), f64: ground truth of
//! `shaders/adamw.wgsl` and `shaders/grad_norm_*.wgsl`.

use crate::spec::AdamWConfig;

/// One AdamW step over a list of tensors at step `t` (1-based); returns (global grad norm, scale).
/// A step whose gradient norm is not finite changes nothing (the GPU optimizer also skips every
/// later step, a state this per-step reference does not keep).
pub fn adamw_step(
    config: &AdamWConfig,
    t: u32,
    params: &mut [Vec<f64>],
    grads: &[Vec<f64>],
    m: &mut [Vec<f64>],
    v: &mut [Vec<f64>],
) -> (f64, f64) {
    let norm = grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
    let scale = match config.max_grad_norm {
        Some(max) => (max as f64 / (norm + 1e-6)).min(1.0),
        None => 1.0,
    };
    if !norm.is_finite() {
        return (norm, scale);
    }
    let (b1, b2) = (config.beta1 as f64, config.beta2 as f64);
    let (c1, c2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
    let (lr, wd, eps) = (
        config.lr as f64,
        config.weight_decay as f64,
        config.eps as f64,
    );
    for k in 0..params.len() {
        for i in 0..params[k].len() {
            let g = grads[k][i] * scale;
            m[k][i] = b1 * m[k][i] + (1.0 - b1) * g;
            v[k][i] = b2 * v[k][i] + (1.0 - b2) * g * g;
            let update = (m[k][i] / c1) / ((v[k][i] / c2).sqrt() + eps);
            params[k][i] = params[k][i] * (1.0 - lr * wd) - lr * update;
        }
    }
    (norm, scale)
}
