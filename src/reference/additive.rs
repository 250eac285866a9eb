//! CPU reference for additive (Bahdanau) attention, in f64: scores
//! `e_ij = scale * sum_c w[h, c] tanh(a[i, h, c] + b[j, h, c] + bias[h, c])` from query and key
//! projections `a [B, Lq, H, Da]`, `b [B, Lk, H, Da]` (contiguous), then the softmax over the
//! visible keys and `O = P V` (`v [B, Lk, H, Dv]`). Masks as in dot-product attention
//! ([`Masks::visible`]: causal, per-batch lengths, windows); `masks.scale` is `scale`.
//! GPU counterpart: [`crate::kernels::additive::additive_forward`] and `additive_backward`.

use crate::reference::attention::Masks;
use crate::spec::AttentionShape;

/// The score's parameters, per head: `w [H, Da]` and `bias [H, Da]`.
#[derive(Clone, Copy, Debug)]
pub struct ScoreParams<'a> {
    /// The score vector `w`.
    pub w: &'a [f64],
    /// The bias inside the tanh.
    pub bias: &'a [f64],
}

fn idx(seq: usize, heads: usize, dim: usize, b: usize, t: usize, h: usize) -> usize {
    ((b * seq + t) * heads + h) * dim
}

/// `tanh(a_i + b_j + bias)` per score dim, and the score `scale * w . t`.
fn score(
    s: &AttentionShape,
    a: &[f64],
    b: &[f64],
    ScoreParams { w, bias }: ScoreParams<'_>,
    scale: f64,
    (bi, h, i, j): (usize, usize, usize, usize),
) -> (Vec<f64>, f64) {
    let da = s.head_dim_qk;
    let ai = &a[idx(s.q_seq, s.heads, da, bi, i, h)..][..da];
    let bj = &b[idx(s.kv_seq, s.heads, da, bi, j, h)..][..da];
    let t: Vec<f64> = (0..da)
        .map(|c| (ai[c] + bj[c] + bias[h * da + c]).tanh())
        .collect();
    let e = scale * (0..da).map(|c| w[h * da + c] * t[c]).sum::<f64>();
    (t, e)
}

/// Reference forward: `(out [B, Lq, H, Dv], lse [B, H, Lq])`; rows that see no key give `o = 0`,
/// `lse = -inf`.
pub fn additive_forward(
    s: &AttentionShape,
    a: &[f64],
    b: &[f64],
    v: &[f64],
    scores: ScoreParams<'_>,
    masks: &Masks,
) -> (Vec<f64>, Vec<f64>) {
    let dv = s.head_dim_v;
    let mut out = vec![0.0; s.batch * s.q_seq * s.heads * dv];
    let mut lse = vec![f64::NEG_INFINITY; s.batch * s.heads * s.q_seq];
    for bi in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..s.q_seq {
                let e: Vec<Option<f64>> = (0..s.kv_seq)
                    .map(|j| {
                        masks
                            .visible(s, bi, i, j)
                            .then(|| score(s, a, b, scores, masks.scale, (bi, h, i, j)).1)
                    })
                    .collect();
                // NaN scores are ignored by the max but make the row seen (SPEC.md, "NaN and
                // infinity"): they reach lse and O through the sum.
                let top = e
                    .iter()
                    .flatten()
                    .copied()
                    .fold(f64::NEG_INFINITY, f64::max);
                if e.iter().flatten().all(|&x| x == f64::NEG_INFINITY) {
                    continue;
                }
                let row_lse = top
                    + e.iter()
                        .flatten()
                        .map(|x| (x - top).exp())
                        .sum::<f64>()
                        .ln();
                lse[(bi * s.heads + h) * s.q_seq + i] = row_lse;
                let o = &mut out[idx(s.q_seq, s.heads, dv, bi, i, h)..][..dv];
                for (j, ej) in e.iter().enumerate() {
                    if let Some(x) = ej {
                        let p = (x - row_lse).exp();
                        let vj = &v[idx(s.kv_seq, s.heads, dv, bi, j, h)..][..dv];
                        for (o, x) in o.iter_mut().zip(vj) {
                            *o += p * x;
                        }
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Gradients of the reference forward: `da`, `db`, `dv` shaped like their inputs, `dw` and
/// `dbias` `[H, Da]`.
#[derive(Clone, Debug)]
pub struct AdditiveGrads {
    /// Of the query projection `a`.
    pub da: Vec<f64>,
    /// Of the key projection `b`.
    pub db: Vec<f64>,
    /// Of the values.
    pub dv: Vec<f64>,
    /// Of the score vector `w`.
    pub dw: Vec<f64>,
    /// Of the bias.
    pub dbias: Vec<f64>,
}

/// Reference backward for the gradient `d_out` at `out`: with `ds_ij = p_ij (dO_i . v_j - D_i)`,
/// `D_i = dO_i . O_i`, and `g_c = scale * w_c (1 - t_c^2)`:
/// `da_i += ds_ij g`, `db_j += ds_ij g`, `dbias += ds_ij g`, `dw += ds_ij scale t`, `dv_j += p_ij dO_i`.
pub fn additive_backward(
    s: &AttentionShape,
    a: &[f64],
    b: &[f64],
    v: &[f64],
    scores: ScoreParams<'_>,
    d_out: &[f64],
    masks: &Masks,
) -> AdditiveGrads {
    let ScoreParams { w, bias } = scores;
    let (da_dim, dv_dim) = (s.head_dim_qk, s.head_dim_v);
    let (out, lse) = additive_forward(s, a, b, v, scores, masks);
    let mut g = AdditiveGrads {
        da: vec![0.0; a.len()],
        db: vec![0.0; b.len()],
        dv: vec![0.0; v.len()],
        dw: vec![0.0; w.len()],
        dbias: vec![0.0; bias.len()],
    };
    for bi in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..s.q_seq {
                let row_lse = lse[(bi * s.heads + h) * s.q_seq + i];
                if row_lse == f64::NEG_INFINITY {
                    continue;
                }
                let oi = idx(s.q_seq, s.heads, dv_dim, bi, i, h);
                let d_o = &d_out[oi..][..dv_dim];
                let d_row: f64 = d_o
                    .iter()
                    .zip(&out[oi..][..dv_dim])
                    .map(|(x, y)| x * y)
                    .sum();
                for j in 0..s.kv_seq {
                    if !masks.visible(s, bi, i, j) {
                        continue;
                    }
                    let (t, e) = score(s, a, b, scores, masks.scale, (bi, h, i, j));
                    let p = (e - row_lse).exp();
                    let vj = idx(s.kv_seq, s.heads, dv_dim, bi, j, h);
                    let dp: f64 = d_o.iter().zip(&v[vj..][..dv_dim]).map(|(x, y)| x * y).sum();
                    for (dv, x) in g.dv[vj..][..dv_dim].iter_mut().zip(d_o) {
                        *dv += p * x;
                    }
                    let ds = p * (dp - d_row);
                    let ai = idx(s.q_seq, s.heads, da_dim, bi, i, h);
                    let bj = idx(s.kv_seq, s.heads, da_dim, bi, j, h);
                    for c in 0..da_dim {
                        let gc = ds * masks.scale * w[h * da_dim + c] * (1.0 - t[c] * t[c]);
                        g.da[ai + c] += gc;
                        g.db[bj + c] += gc;
                        g.dbias[h * da_dim + c] += gc;
                        g.dw[h * da_dim + c] += ds * masks.scale * t[c];
                    }
                }
            }
        }
    }
    g
}

/// Attention probabilities `[B, H, Lq, Lk]` of the reference forward: `exp(e - lse)` where visible,
/// 0 elsewhere.
pub fn additive_probabilities(
    s: &AttentionShape,
    a: &[f64],
    b: &[f64],
    v: &[f64],
    scores: ScoreParams<'_>,
    masks: &Masks,
) -> Vec<f64> {
    let (_, lse) = additive_forward(s, a, b, v, scores, masks);
    let mut p = vec![0.0; s.batch * s.heads * s.q_seq * s.kv_seq];
    for bi in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..s.q_seq {
                let row_lse = lse[(bi * s.heads + h) * s.q_seq + i];
                for j in 0..s.kv_seq {
                    if row_lse > f64::NEG_INFINITY && masks.visible(s, bi, i, j) {
                        let e = score(s, a, b, scores, masks.scale, (bi, h, i, j)).1;
                        p[((bi * s.heads + h) * s.q_seq + i) * s.kv_seq + j] = (e - row_lse).exp();
                    }
                }
            }
        }
    }
    p
}
