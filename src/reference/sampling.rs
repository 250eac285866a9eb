//! CPU reference for token sampling, in f64. GPU counterpart: [`crate::kernels::sampling`].

use crate::spec::Sampling;

/// PCG hash (Jarzynski and Olano 2020), as the shader computes it.
pub fn pcg(v: u32) -> u32 {
    let state = v.wrapping_mul(747796405).wrapping_add(2891336453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277803737);
    (word >> 22) ^ word
}

/// The uniform number in `[0, 1)` of draw `draw`, row `row` (24 bits, as the shader).
pub fn uniform01(seed: u64, draw: u64, row: u32) -> f64 {
    let h = pcg(seed as u32
        ^ pcg((seed >> 32) as u32 ^ pcg(draw as u32 ^ pcg((draw >> 32) as u32 ^ pcg(row)))));
    (h >> 8) as f64 / 16777216.0
}

/// The distribution a row's token is drawn from: softmax(logits / temperature) restricted to the
/// ids whose probability is at least the k-th largest (top-k, ties kept), then to the shortest
/// most-probable head whose mass reaches `top_p` of what is left (ties kept), renormalised.
/// Greedy: one-hot at the arg max (lowest id among ties).
pub fn sampling_distribution(logits: &[f64], s: &Sampling) -> Vec<f64> {
    let top = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if s.is_greedy() {
        let arg = logits.iter().position(|&x| x == top).unwrap_or(0);
        let mut p = vec![0.0; logits.len()];
        p[arg] = 1.0;
        return p;
    }
    let mut p: Vec<f64> = logits
        .iter()
        .map(|&x| ((x - top) / s.temperature as f64).exp())
        .collect();
    let mut sorted = p.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut threshold = 0.0;
    if let Some(k) = s.top_k.filter(|&k| k < p.len()) {
        threshold = sorted[k - 1];
    }
    if let Some(top_p) = s.top_p.filter(|&x| x < 1.0) {
        let kept: Vec<f64> = sorted.iter().copied().filter(|&x| x >= threshold).collect();
        let goal = top_p as f64 * kept.iter().sum::<f64>();
        let mut mass = 0.0;
        for &x in &kept {
            mass += x;
            if mass >= goal {
                threshold = x;
                break;
            }
        }
    }
    for x in &mut p {
        if *x < threshold || *x == 0.0 {
            *x = 0.0;
        }
    }
    let total: f64 = p.iter().sum();
    p.iter().map(|x| x / total).collect()
}

/// The id of row `row`'s draw `draw`: where the running sum of the distribution in id order passes
/// the uniform number the shader uses.
pub fn sample(logits: &[f64], s: &Sampling, draw: u64, row: u32) -> u32 {
    let p = sampling_distribution(logits, s);
    let u = uniform01(s.seed, draw, row);
    let mut running = 0.0;
    let mut last = 0;
    for (j, &x) in p.iter().enumerate() {
        if x > 0.0 {
            running += x;
            last = j;
            if running > u {
                return j as u32;
            }
        }
    }
    last as u32
}
