//! Linear layer `y = x W^T + b` (SPEC.md), f64: ground truth of `kernels::linear`.

/// `x [rows, in]`, `weight [out, in]` -> `y [rows, out]`.
pub fn linear_forward(x: &[f64], weight: &[f64], bias: Option<&[f64]>, in_f: usize) -> Vec<f64> {
    let out_f = weight.len() / in_f;
    let rows = x.len() / in_f;
    let mut y = vec![0.0; rows * out_f];
    for r in 0..rows {
        for o in 0..out_f {
            let mut s = bias.map_or(0.0, |b| b[o]);
            for i in 0..in_f {
                s += x[r * in_f + i] * weight[o * in_f + i];
            }
            y[r * out_f + o] = s;
        }
    }
    y
}

/// (dx, dW, db) for the upstream gradient `dy [rows, out]`.
pub fn linear_backward(
    x: &[f64],
    weight: &[f64],
    dy: &[f64],
    in_f: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let out_f = weight.len() / in_f;
    let rows = x.len() / in_f;
    let mut dx = vec![0.0; x.len()];
    let mut dw = vec![0.0; weight.len()];
    let mut db = vec![0.0; out_f];
    for r in 0..rows {
        for o in 0..out_f {
            let g = dy[r * out_f + o];
            db[o] += g;
            for i in 0..in_f {
                dx[r * in_f + i] += g * weight[o * in_f + i];
                dw[o * in_f + i] += g * x[r * in_f + i];
            }
        }
    }
    (dx, dw, db)
}
