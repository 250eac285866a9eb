//! CPU reference for scaled dot-product attention (SPEC.md) with its score modifiers (softcap,
//! ALiBi, additive bias, T5 relative-position buckets, sinks, cosine scores, key clipping),
//! forward and backward, in f64.
//! Tensors are contiguous BSHD: q `[B, Lq, H, Dk]`, k `[B, Lk, Hkv, Dk]`, v `[B, Lk, Hkv, Dv]`,
//! out `[B, Lq, H, Dv]`, lse `[B, H, Lq]`. GPU counterpart: [`crate::kernels::attention`].

use crate::spec::AttentionShape;

/// Masks, scale and score modifiers of a reference call (the final scale, temperature applied).
#[derive(Clone, Debug, Default)]
pub struct Masks {
    /// The score scale (already divided by the temperature).
    pub scale: f64,
    /// The causal mask.
    pub causal: bool,
    /// Valid query rows per batch entry.
    pub q_lens: Option<Vec<u32>>,
    /// Valid keys per batch entry.
    pub kv_lens: Option<Vec<u32>>,
    /// `cap * tanh(s / cap)` of the scaled score.
    pub softcap: Option<f64>,
    /// ALiBi with the geometric slopes ([`alibi_slope`]), or `alibi_slopes` when given.
    pub alibi: bool,
    /// Per-query-head ALiBi slopes.
    pub alibi_slopes: Option<Vec<f64>>,
    /// Sliding window `(left, right)` around the aligned position `i + Lk - Lq`.
    pub window: Option<(usize, usize)>,
    /// Attention sinks `[H]`: a logit per query head in every row's denominator, with no value.
    /// Rows that see no key stay `O = 0`, `lse = -inf`.
    pub sinks: Option<Vec<f64>>,
    /// Cosine scores: q and k L2-normalised (eps 1e-6) before the scores (`scale` multiplies them).
    pub normalize_qk: bool,
    /// A learned per-head cosine scale `[H]`: normalised queries of head h are multiplied by it
    /// (with `normalize_qk`; `scale` is then 1 / temperature).
    pub cosine_scales: Option<Vec<f64>>,
    /// Key-norm clipping: keys longer than this are scaled to it (after normalising, if both).
    pub key_clip: Option<f64>,
    /// Additive score bias, added after softcap and ALiBi; `-inf` masks a pair.
    pub bias: Option<Bias>,
    /// T5 relative-position bias: `(buckets, max_distance, bidirectional)` and the `[H, buckets]`
    /// table.
    pub relative: Option<(RelativeConfig, Vec<f64>)>,
}

/// A contiguous `[bb, hb, Lq, Lk]` bias, `bb` 1 or B and `hb` 1 or H (1 broadcasts).
#[derive(Clone, Debug)]
pub struct Bias {
    /// Contiguous `[bb, hb, Lq, Lk]` values.
    pub values: Vec<f64>,
    /// `bb`: 1 (broadcast) or B.
    pub batch: usize,
    /// `hb`: 1 (broadcast) or H.
    pub heads: usize,
}

impl Bias {
    fn index(&self, s: &AttentionShape, b: usize, h: usize, i: usize, j: usize) -> usize {
        let (b, h) = (b % self.batch, h % self.heads);
        ((b * self.heads + h) * s.q_seq + i) * s.kv_seq + j
    }
}

/// T5 relative-position buckets (the contract's type, [`crate::spec::RelativeBuckets`]).
pub use crate::spec::RelativeBuckets as RelativeConfig;

/// T5's bucket of the relative position `delta = j - (i + Lk - Lq)` (key minus aligned query
/// position; Raffel et al. 2020, as Hugging Face's `T5Attention._relative_position_bucket`
/// computes it, log in f32): bidirectional tables give keys after the query (`delta > 0`) the
/// upper half of the buckets; in each half, distances below half its size have a bucket each and
/// larger ones log-spaced buckets up to `max_distance`, beyond which they share the last.
pub fn relative_position_bucket(delta: i64, c: RelativeConfig) -> usize {
    let (mut half, mut offset) = (c.buckets, 0);
    let n = if c.bidirectional {
        half /= 2;
        if delta > 0 {
            offset = half;
        }
        delta.unsigned_abs()
    } else {
        (-delta).max(0) as u64
    };
    let exact = (half / 2) as u64;
    if n < exact {
        return offset + n as usize;
    }
    let ratio = ((c.max_distance as f64 / exact as f64).ln()) as f32;
    let large = (n as f32 / exact as f32).ln() / ratio * (half as f32 - exact as f32);
    offset + (exact as usize + large as usize).min(half - 1)
}

/// Norms below this are not divided by (cosine scores).
const NORM_EPS: f64 = 1e-6;

/// Rows of `dim` values transformed as the kernels' inputs: normalised, then clipped.
fn transform_rows(x: &[f64], dim: usize, normalize: bool, clip: Option<f64>) -> Vec<f64> {
    x.chunks(dim)
        .flat_map(|row| {
            let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
            let a = if normalize {
                1.0 / norm.max(NORM_EPS)
            } else {
                1.0
            };
            let c = clip.map_or(1.0, |c| (c / (norm * a)).min(1.0));
            row.iter().map(move |v| v * a * c).collect::<Vec<_>>()
        })
        .collect()
}

/// dL/dx from dL/dy of [`transform_rows`], row by row.
fn transform_rows_backward(
    x: &[f64],
    g: &[f64],
    dim: usize,
    normalize: bool,
    clip: Option<f64>,
) -> Vec<f64> {
    x.chunks(dim)
        .zip(g.chunks(dim))
        .flat_map(|(row, g)| {
            let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
            let u: Vec<f64> = row
                .iter()
                .map(|v| if norm > 0.0 { v / norm } else { 0.0 })
                .collect();
            let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
            let a = if normalize {
                1.0 / norm.max(NORM_EPS)
            } else {
                1.0
            };
            // Through the clip of y1 = a x (direction u, norm a |x|).
            let g1: Vec<f64> = match clip {
                Some(c) if norm * a > c => {
                    let ug = dot(&u, g);
                    let f = c / (norm * a);
                    g.iter()
                        .zip(&u)
                        .map(|(gi, ui)| f * (gi - ui * ug))
                        .collect()
                }
                _ => g.to_vec(),
            };
            // Through the normalisation.
            if !normalize {
                return g1;
            }
            if norm <= NORM_EPS {
                return g1.iter().map(|v| v * a).collect();
            }
            let ug1 = dot(&u, &g1);
            g1.iter()
                .zip(&u)
                .map(|(gi, ui)| (gi - ui * ug1) * a)
                .collect()
        })
        .collect()
}

/// ALiBi slope of query head `h` of `heads` (Press et al. 2022): `2^(-8 (h + 1) / n)` for
/// `n = heads` a power of two; otherwise the `n = 2^floor(log2 heads)` slopes of that sequence, then
/// every other slope of the `2n` one.
pub fn alibi_slope(h: usize, heads: usize) -> f64 {
    let n = 1usize << heads.ilog2();
    if h < n {
        (-8.0 * (h + 1) as f64 / n as f64).exp2()
    } else {
        (-4.0 * (2 * (h - n) + 1) as f64 / n as f64).exp2()
    }
}

impl Masks {
    /// The score of query `i`, key `j`, query head `h` from the scaled dot product `s`, and its
    /// derivative with respect to `s`: softcap, then ALiBi (FlashAttention 2's order).
    /// Then the bias tensor's or the relative table's term is added.
    pub fn modify(
        &self,
        s_shape: &AttentionShape,
        b: usize,
        h: usize,
        i: usize,
        j: usize,
        s: f64,
    ) -> (f64, f64) {
        let (mut x, mut grad) = (s, 1.0);
        if let Some(cap) = self.softcap {
            let t = (s / cap).tanh();
            x = cap * t;
            grad = 1.0 - t * t;
        }
        if self.alibi {
            let position = i as i64 + s_shape.kv_seq as i64 - s_shape.q_seq as i64;
            let slope = self
                .alibi_slopes
                .as_ref()
                .map_or_else(|| alibi_slope(h, s_shape.heads), |s| s[h]);
            x -= slope * (position - j as i64).abs() as f64;
        }
        if let Some(bias) = &self.bias {
            x += bias.values[bias.index(s_shape, b, h, i, j)];
        }
        if let Some((config, table)) = &self.relative {
            x += table[h * config.buckets + self.bucket(s_shape, i, j)];
        }
        (x, grad)
    }

    /// The relative-position bucket of query `i`, key `j` (positions aligned as the causal mask).
    fn bucket(&self, s: &AttentionShape, i: usize, j: usize) -> usize {
        let config = self
            .relative
            .as_ref()
            .map(|r| r.0)
            .expect("relative buckets");
        let delta = j as i64 - (i as i64 + s.kv_seq as i64 - s.q_seq as i64);
        relative_position_bucket(delta, config)
    }

    /// Whether key `j` is visible to query `i` of batch `b`.
    pub fn visible(&self, s: &AttentionShape, b: usize, i: usize, j: usize) -> bool {
        let q_len = self.q_lens.as_ref().map_or(s.q_seq, |l| l[b] as usize);
        let kv_len = self.kv_lens.as_ref().map_or(s.kv_seq, |l| l[b] as usize);
        if i >= q_len || j >= kv_len {
            return false;
        }
        // Bottom-right aligned on the tensor lengths: causal j <= p, window p - left <= j <= p + right.
        let (p, j) = (i as i64 + s.kv_seq as i64 - s.q_seq as i64, j as i64);
        let in_window = self
            .window
            .is_none_or(|(left, right)| p - left as i64 <= j && j <= p + right as i64);
        (!self.causal || j <= p) && in_window
    }
}

fn idx(seq: usize, heads: usize, dim: usize, b: usize, t: usize, h: usize) -> usize {
    ((b * seq + t) * heads + h) * dim
}

/// Reference forward: returns `(out, lse)`; rows with no visible key give `o = 0`, `lse = -inf`.
pub fn attention_forward(
    s: &AttentionShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    masks: &Masks,
) -> (Vec<f64>, Vec<f64>) {
    let dk = s.head_dim_qk;
    let q = scale_heads(&transform_rows(q, dk, masks.normalize_qk, None), dk, masks);
    let k = transform_rows(k, dk, masks.normalize_qk, masks.key_clip);
    forward_of_transformed(s, &q, &k, v, masks)
}

/// Query rows (`[.., H, dim]`) times their head's learned cosine scale, if any.
fn scale_heads(q: &[f64], dim: usize, masks: &Masks) -> Vec<f64> {
    match &masks.cosine_scales {
        Some(scales) => q
            .chunks(dim)
            .enumerate()
            .flat_map(|(row, x)| x.iter().map(move |v| v * scales[row % scales.len()]))
            .collect(),
        None => q.to_vec(),
    }
}

fn forward_of_transformed(
    s: &AttentionShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    masks: &Masks,
) -> (Vec<f64>, Vec<f64>) {
    let (dk, dv) = (s.head_dim_qk, s.head_dim_v);
    let group = s.heads / s.kv_heads;
    let mut out = vec![0.0; s.batch * s.q_seq * s.heads * dv];
    let mut lse = vec![f64::NEG_INFINITY; s.batch * s.heads * s.q_seq];
    let mut scores = vec![0.0; s.kv_seq];
    for b in 0..s.batch {
        for h in 0..s.heads {
            let hk = h / group;
            for i in 0..s.q_seq {
                let qi = &q[idx(s.q_seq, s.heads, dk, b, i, h)..][..dk];
                // The largest score ignores NaN (f64::max); a visible NaN score still makes the row
                // seen, and reaches its lse and O through the sum (SPEC.md, "NaN and infinity").
                let mut max = f64::NEG_INFINITY;
                let mut seen = false;
                for (j, score) in scores.iter_mut().enumerate() {
                    *score = if masks.visible(s, b, i, j) {
                        let kj = &k[idx(s.kv_seq, s.kv_heads, dk, b, j, hk)..][..dk];
                        let dot = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                        masks.modify(s, b, h, i, j, masks.scale * dot).0
                    } else {
                        f64::NEG_INFINITY
                    };
                    max = max.max(*score);
                    seen |= *score != f64::NEG_INFINITY;
                }
                if !seen {
                    continue;
                }
                let sink = masks.sinks.as_ref().map(|sinks| sinks[h]);
                let top = sink.map_or(max, |x| max.max(x));
                let sum: f64 = scores
                    .iter()
                    .filter(|&&x| x != f64::NEG_INFINITY)
                    .map(|&x| (x - top).exp())
                    .sum::<f64>()
                    + sink.map_or(0.0, |x| (x - top).exp());
                let row_lse = top + sum.ln();
                lse[(b * s.heads + h) * s.q_seq + i] = row_lse;
                let oi = &mut out[idx(s.q_seq, s.heads, dv, b, i, h)..][..dv];
                for (j, &score) in scores.iter().enumerate() {
                    if score == f64::NEG_INFINITY {
                        continue;
                    }
                    let p = (score - row_lse).exp();
                    let vj = &v[idx(s.kv_seq, s.kv_heads, dv, b, j, hk)..][..dv];
                    for (o, x) in oi.iter_mut().zip(vj) {
                        *o += p * x;
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Attention probabilities `[B, H, Lq, Lk]`: `exp(score - lse)` where visible, 0 elsewhere (and for
/// rows that see no key); with sinks, each row sums to 1 minus its sink's share.
pub fn attention_probabilities(
    s: &AttentionShape,
    q: &[f64],
    k: &[f64],
    masks: &Masks,
) -> Vec<f64> {
    let dk = s.head_dim_qk;
    let q = scale_heads(&transform_rows(q, dk, masks.normalize_qk, None), dk, masks);
    let k = transform_rows(k, dk, masks.normalize_qk, masks.key_clip);
    // V does not enter the probabilities: a one-column stand-in keeps the forward's shape rules.
    let v_shape = AttentionShape {
        head_dim_v: 1,
        ..*s
    };
    let v = vec![0.0; s.batch * s.kv_seq * s.kv_heads];
    let (_, lse) = forward_of_transformed(&v_shape, &q, &k, &v, masks);
    let group = s.heads / s.kv_heads;
    let mut p = vec![0.0; s.batch * s.heads * s.q_seq * s.kv_seq];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..s.q_seq {
                let row_lse = lse[(b * s.heads + h) * s.q_seq + i];
                if row_lse == f64::NEG_INFINITY {
                    continue;
                }
                let qi = &q[idx(s.q_seq, s.heads, dk, b, i, h)..][..dk];
                for j in 0..s.kv_seq {
                    if !masks.visible(s, b, i, j) {
                        continue;
                    }
                    let kj = &k[idx(s.kv_seq, s.kv_heads, dk, b, j, h / group)..][..dk];
                    let dot = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                    let score = masks.modify(s, b, h, i, j, masks.scale * dot).0;
                    p[((b * s.heads + h) * s.q_seq + i) * s.kv_seq + j] = (score - row_lse).exp();
                }
            }
        }
    }
    p
}

/// Reference decode attention (GPU: `kernels::attention::attention_decode_into`): `q [B, Lq, H, Dk]`
/// against caches `k [B, max_len, Hkv, Dk]`, `v [B, max_len, Hkv, Dv]` (`s.kv_seq` = max_len).
/// Sequence `b` is its own problem of `q_lens[b]` queries and the first `kv_lens[b]` cached keys,
/// bottom-right aligned (the new queries are the last positions). Rows past `q_lens[b]` give
/// `o = 0`, `lse = -inf`. `masks` must not carry lengths or a bias tensor (they are per problem).
pub fn attention_decode(
    s: &AttentionShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    q_lens: &[u32],
    kv_lens: &[u32],
    masks: &Masks,
) -> (Vec<f64>, Vec<f64>) {
    assert!(masks.q_lens.is_none() && masks.kv_lens.is_none() && masks.bias.is_none());
    let (dk, dv) = (s.head_dim_qk, s.head_dim_v);
    let mut out = vec![0.0; s.batch * s.q_seq * s.heads * dv];
    let mut lse = vec![f64::NEG_INFINITY; s.batch * s.heads * s.q_seq];
    for b in 0..s.batch {
        let (n, len) = (q_lens[b] as usize, kv_lens[b] as usize);
        if n == 0 {
            continue;
        }
        let one = AttentionShape {
            batch: 1,
            q_seq: n,
            kv_seq: len,
            ..*s
        };
        let q_rows = &q[b * s.q_seq * s.heads * dk..][..n * s.heads * dk];
        let k_rows = &k[b * s.kv_seq * s.kv_heads * dk..][..len * s.kv_heads * dk];
        let v_rows = &v[b * s.kv_seq * s.kv_heads * dv..][..len * s.kv_heads * dv];
        let (o, l) = attention_forward(&one, q_rows, k_rows, v_rows, masks);
        out[b * s.q_seq * s.heads * dv..][..n * s.heads * dv].copy_from_slice(&o);
        for h in 0..s.heads {
            lse[(b * s.heads + h) * s.q_seq..][..n].copy_from_slice(&l[h * n..][..n]);
        }
    }
    (out, lse)
}

/// Gradients of the reference forward (`dsinks`, `dbias`, `drelative` empty without sinks, bias,
/// relative buckets). `dbias` has the bias's shape (summed over its broadcast dimensions),
/// `drelative` the table's `[H, buckets]`.
#[derive(Clone, Debug)]
pub struct Grads {
    /// `[B, Lq, H, Dk]`.
    pub dq: Vec<f64>,
    /// `[B, Lk, Hkv, Dk]`.
    pub dk: Vec<f64>,
    /// `[B, Lk, Hkv, Dv]`.
    pub dv: Vec<f64>,
    /// Of the sinks `[H]`.
    pub dsinks: Vec<f64>,
    /// Of the bias (its shape).
    pub dbias: Vec<f64>,
    /// Of the relative table `[H, buckets]`.
    pub drelative: Vec<f64>,
    /// The learned cosine scales' gradient `[H]` (empty without them).
    pub dcosine: Vec<f64>,
}

/// Reference backward per SPEC.md, recomputing P from the forward. dK and dV sum over the query
/// heads that share a kv head. Rows with no visible key get zero gradients.
pub fn attention_backward(
    s: &AttentionShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_out: &[f64],
    masks: &Masks,
) -> Grads {
    let (dk_dim, dv_dim) = (s.head_dim_qk, s.head_dim_v);
    let group = s.heads / s.kv_heads;
    let (q_in, k_in) = (q, k);
    let q_unit = transform_rows(q_in, dk_dim, masks.normalize_qk, None);
    let q = &scale_heads(&q_unit, dk_dim, masks)[..];
    let k = &transform_rows(k_in, dk_dim, masks.normalize_qk, masks.key_clip)[..];
    let (out, lse) = forward_of_transformed(s, q, k, v, masks);
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    let mut dsinks = vec![0.0; masks.sinks.as_ref().map_or(0, Vec::len)];
    let mut dbias = vec![0.0; masks.bias.as_ref().map_or(0, |b| b.values.len())];
    let mut drelative = vec![0.0; masks.relative.as_ref().map_or(0, |r| r.1.len())];
    for b in 0..s.batch {
        for h in 0..s.heads {
            let hk = h / group;
            for i in 0..s.q_seq {
                let row_lse = lse[(b * s.heads + h) * s.q_seq + i];
                if row_lse == f64::NEG_INFINITY {
                    continue;
                }
                let qo = idx(s.q_seq, s.heads, dk_dim, b, i, h);
                let oo = idx(s.q_seq, s.heads, dv_dim, b, i, h);
                let delta: f64 = (0..dv_dim).map(|c| d_out[oo + c] * out[oo + c]).sum();
                // The sink's probability exp(sink - lse) times (its dP = 0) - delta.
                if let Some(sinks) = &masks.sinks {
                    dsinks[h] -= (sinks[h] - row_lse).exp() * delta;
                }
                for j in 0..s.kv_seq {
                    if !masks.visible(s, b, i, j) {
                        continue;
                    }
                    let ko = idx(s.kv_seq, s.kv_heads, dk_dim, b, j, hk);
                    let vo = idx(s.kv_seq, s.kv_heads, dv_dim, b, j, hk);
                    let dot: f64 = (0..dk_dim).map(|c| q[qo + c] * k[ko + c]).sum();
                    let (score, score_grad) = masks.modify(s, b, h, i, j, masks.scale * dot);
                    if score == f64::NEG_INFINITY {
                        continue;
                    }
                    let p = (score - row_lse).exp();
                    let dp: f64 = (0..dv_dim).map(|c| d_out[oo + c] * v[vo + c]).sum();
                    // dL/d(score), the bias terms' gradient; then through the softcap.
                    let d_score = p * (dp - delta);
                    if let Some(bias) = &masks.bias {
                        dbias[bias.index(s, b, h, i, j)] += d_score;
                    }
                    if let Some((config, _)) = &masks.relative {
                        drelative[h * config.buckets + masks.bucket(s, i, j)] += d_score;
                    }
                    let ds = d_score * score_grad;
                    for c in 0..dv_dim {
                        dv[vo + c] += p * d_out[oo + c];
                    }
                    for c in 0..dk_dim {
                        dq[qo + c] += masks.scale * ds * k[ko + c];
                        dk[ko + c] += masks.scale * ds * q[qo + c];
                    }
                }
            }
        }
    }
    // Through the learned scale (dL/ds = dL/dy . unit q), then the transforms of Q and K.
    let mut dcosine = Vec::new();
    if let Some(scales) = &masks.cosine_scales {
        dcosine = vec![0.0; scales.len()];
        for (row, (g, x)) in dq.chunks_mut(dk_dim).zip(q_unit.chunks(dk_dim)).enumerate() {
            let h = row % scales.len();
            dcosine[h] += g.iter().zip(x).map(|(a, b)| a * b).sum::<f64>();
            g.iter_mut().for_each(|v| *v *= scales[h]);
        }
    }
    let dq = transform_rows_backward(q_in, &dq, dk_dim, masks.normalize_qk, None);
    let dk = transform_rows_backward(k_in, &dk, dk_dim, masks.normalize_qk, masks.key_clip);
    Grads {
        dq,
        dk,
        dv,
        dsinks,
        dbias,
        drelative,
        dcosine,
    }
}
