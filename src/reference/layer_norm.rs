//! LayerNorm and RMSNorm over the last dimension (SPEC.md), f64: the ground truth of
//! `shaders/layer_norm_*.wgsl`.

/// `y` and the per-row `(mean, rstd)` of `x [rows, cols]`.
pub fn layer_norm_forward(
    x: &[f64],
    gamma: &[f64],
    beta: &[f64],
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Vec<(f64, f64)>) {
    let mut y = vec![0.0; x.len()];
    let mut stats = Vec::with_capacity(x.len() / cols.max(1));
    for (row, out) in x.chunks(cols).zip(y.chunks_mut(cols)) {
        let n = cols as f64;
        let mean = row.iter().sum::<f64>() / n;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let rstd = 1.0 / (var + eps).sqrt();
        for c in 0..cols {
            out[c] = (row[c] - mean) * rstd * gamma[c] + beta[c];
        }
        stats.push((mean, rstd));
    }
    (y, stats)
}

/// Gradients of a LayerNorm.
#[derive(Clone, Debug)]
pub struct LayerNormGrads {
    /// At the input.
    pub dx: Vec<f64>,
    /// Of the scale.
    pub d_gamma: Vec<f64>,
    /// Of the shift.
    pub d_beta: Vec<f64>,
}

/// LayerNorm's backward over rows of `dim`, from the input and `dy`.
pub fn layer_norm_backward(
    x: &[f64],
    gamma: &[f64],
    dy: &[f64],
    cols: usize,
    eps: f64,
) -> LayerNormGrads {
    let (_, stats) = layer_norm_forward(x, gamma, &vec![0.0; cols], cols, eps);
    let mut g = LayerNormGrads {
        dx: vec![0.0; x.len()],
        d_gamma: vec![0.0; cols],
        d_beta: vec![0.0; cols],
    };
    let n = cols as f64;
    for (r, &(mean, rstd)) in stats.iter().enumerate() {
        let row = &x[r * cols..(r + 1) * cols];
        let dyr = &dy[r * cols..(r + 1) * cols];
        let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
        let mean_g = (0..cols).map(|c| dyr[c] * gamma[c]).sum::<f64>() / n;
        let mean_gx = (0..cols).map(|c| dyr[c] * gamma[c] * xhat[c]).sum::<f64>() / n;
        for c in 0..cols {
            g.dx[r * cols + c] = rstd * (dyr[c] * gamma[c] - mean_g - xhat[c] * mean_gx);
            g.d_gamma[c] += dyr[c] * xhat[c];
            g.d_beta[c] += dyr[c];
        }
    }
    g
}

/// RMSNorm of `x [rows, cols]`: `x / sqrt(mean(x^2) + eps) * gamma`.
pub fn rms_norm_forward(x: &[f64], gamma: &[f64], cols: usize, eps: f64) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| {
            let rstd = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
            row.iter().zip(gamma).map(move |(v, g)| v * rstd * g)
        })
        .collect()
}

/// RMSNorm's backward: `(dx, d_gamma)`.
pub fn rms_norm_backward(
    x: &[f64],
    gamma: &[f64],
    dy: &[f64],
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut dx = vec![0.0; x.len()];
    let mut d_gamma = vec![0.0; cols];
    for (r, row) in x.chunks(cols).enumerate() {
        let dyr = &dy[r * cols..(r + 1) * cols];
        let rstd = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
        // y_c = x_c r g_c with r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / n.
        let dot = (0..cols).map(|c| dyr[c] * gamma[c] * row[c]).sum::<f64>();
        for c in 0..cols {
            dx[r * cols + c] = rstd * dyr[c] * gamma[c] - rstd.powi(3) * row[c] * dot / cols as f64;
            d_gamma[c] += dyr[c] * row[c] * rstd;
        }
    }
    (dx, d_gamma)
}
