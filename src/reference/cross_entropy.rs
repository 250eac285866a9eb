//! Mean softmax cross-entropy with an ignore index (SPEC.md), f64: ground truth of
//! `shaders/cross_entropy_*.wgsl`.

/// (mean loss over counted rows, counted rows, d loss / d logits).
pub fn cross_entropy(
    logits: &[f64],
    targets: &[u32],
    classes: usize,
    ignore_index: Option<u32>,
) -> (f64, usize, Vec<f64>) {
    let counted = targets.iter().filter(|&&t| Some(t) != ignore_index).count();
    let mut loss = 0.0;
    let mut grad = vec![0.0; logits.len()];
    for (r, &t) in targets.iter().enumerate() {
        if Some(t) == ignore_index {
            continue;
        }
        let row = &logits[r * classes..(r + 1) * classes];
        let top = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = top + row.iter().map(|v| (v - top).exp()).sum::<f64>().ln();
        loss += lse - row[t as usize];
        for v in 0..classes {
            let p = (row[v] - lse).exp();
            grad[r * classes + v] = (p - if v == t as usize { 1.0 } else { 0.0 }) / counted as f64;
        }
    }
    let mean = if counted > 0 {
        loss / counted as f64
    } else {
        0.0
    };
    (mean, counted, grad)
}
