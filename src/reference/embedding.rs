//! Token embedding and positional encoding (SPEC.md), f64: ground truth of `kernels::embedding`.

/// The sinusoidal positions of "Attention Is All You Need", `[max_len, dim]`:
/// `PE[l, 2i] = sin(l / 10000^(2i / dim))`, `PE[l, 2i + 1] = cos(l / 10000^(2i / dim))`, each
/// rounded to f32 as the model stores its table.
pub fn sinusoidal_positions(max_len: usize, dim: usize) -> Vec<f64> {
    (0..max_len * dim)
        .map(|n| {
            let (l, c) = (n / dim, n % dim);
            let angle = l as f64 / 10000f64.powf((c - c % 2) as f64 / dim as f64);
            let value = if c % 2 == 0 { angle.sin() } else { angle.cos() };
            f64::from(value as f32)
        })
        .collect()
}

/// `table[tokens]`, each row `dim` wide.
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

/// The table's gradient: `dy` rows summed per token id.
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

/// [`positional_forward`] for new tokens after a cache: row `l` of sequence `b` at position
/// `kv_lens[b] - q_lens[b] + l` (clamped to the table: rows past `q_lens[b]` are padding).
pub fn positional_forward_cached(
    x: &[f64],
    table: &[f64],
    [batch, seq, dim]: [usize; 3],
    q_lens: &[u32],
    kv_lens: &[u32],
) -> Vec<f64> {
    let max_len = table.len() / dim;
    let mut y = x.to_vec();
    for b in 0..batch {
        for l in 0..seq {
            let p = ((kv_lens[b] - q_lens[b]) as usize + l).min(max_len - 1);
            for c in 0..dim {
                y[(b * seq + l) * dim + c] += table[p * dim + c];
            }
        }
    }
    y
}

/// [`positional_forward`] of a packed batch: `x [rows, dim]` holds the sequences of `lens` one after
/// another, each at positions `0..len`; rows after them get no position.
pub fn positional_forward_packed(x: &[f64], table: &[f64], lens: &[u32], dim: usize) -> Vec<f64> {
    let mut y = x.to_vec();
    let mut row = 0;
    for &len in lens {
        for l in 0..len as usize {
            for c in 0..dim {
                y[(row + l) * dim + c] += table[l * dim + c];
            }
        }
        row += len as usize;
    }
    y
}

/// [`positional_forward_cached`] of a packed prefill: `x [rows, dim]` holds the `q_lens[b]` new
/// tokens of each sequence one after another, sequence `b`'s row `l` at position `kv_lens[b] -
/// q_lens[b] + l`; rows after them get no position.
pub fn positional_forward_cached_packed(
    x: &[f64],
    table: &[f64],
    dim: usize,
    q_lens: &[u32],
    kv_lens: &[u32],
) -> Vec<f64> {
    let mut y = x.to_vec();
    let mut row = 0;
    for (&new, &total) in q_lens.iter().zip(kv_lens) {
        let cached = (total - new) as usize;
        for l in 0..new as usize {
            for c in 0..dim {
                y[(row + l) * dim + c] += table[(cached + l) * dim + c];
            }
        }
        row += new as usize;
    }
    y
}

/// [`positional_backward`] of a packed batch: table row `l` sums row `l` of every sequence.
pub fn positional_backward_packed(
    dy: &[f64],
    lens: &[u32],
    dim: usize,
    max_len: usize,
) -> Vec<f64> {
    let mut d = vec![0.0; max_len * dim];
    let mut row = 0;
    for &len in lens {
        for l in 0..len as usize {
            for c in 0..dim {
                d[l * dim + c] += dy[(row + l) * dim + c];
            }
        }
        row += len as usize;
    }
    d
}
