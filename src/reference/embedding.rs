//! Token embedding and positional encoding (SPEC.md), f64: ground truth of `kernels::embedding`.

pub fn embedding_forward(tokens: &[u32], table: &[f64], dim: usize) -> Vec<f64> {
    tokens
        .iter()
        .flat_map(|&t| {
            table[t as usize * dim..(t as usize + 1) * dim]
                .iter()
                .copied()
        })
        .collect()
}

pub fn embedding_backward(tokens: &[u32], dy: &[f64], vocab: usize, dim: usize) -> Vec<f64> {
    let mut d = vec![0.0; vocab * dim];
    for (i, &t) in tokens.iter().enumerate() {
        for c in 0..dim {
            d[t as usize * dim + c] += dy[i * dim + c];
        }
    }
    d
}

/// `x [batch, seq, dim] + table[:seq]`.
pub fn positional_forward(x: &[f64], table: &[f64], seq: usize, dim: usize) -> Vec<f64> {
    x.iter()
        .enumerate()
        .map(|(i, v)| v + table[i % (seq * dim)])
        .collect()
}

/// The table gradient `[max_len, dim]`: dy summed over the batch, zero past `seq`.
pub fn positional_backward(dy: &[f64], seq: usize, dim: usize, max_len: usize) -> Vec<f64> {
    let mut d = vec![0.0; max_len * dim];
    for (i, g) in dy.iter().enumerate() {
        d[i % (seq * dim)] += g;
    }
    d
}
