//! One Transformer layer, [`crate::layers::encoder::EncoderLayer`] (pre-LN or post-LN, causal or
//! not), in f64, composed of the reference ops: the ground truth its GPU forward and every gradient
//! are tested against, and the benchmark's layer case validated against.
//!
//! ```text
//! pre-LN:  x1 = x + Attn(LN1(x));   y = x1 + FF(LN2(x1))
//! post-LN: x1 = LN1(x + Attn(x));   y = LN2(x1 + FF(x1))
//! Attn(h) = attention(q, k, v) Wo^T + bo with [q k v] = h Wqkv^T + bqkv;  FF(h) = GELU(h W1^T + b1) W2^T + b2
//! ```

use wgpu_attention::reference::attention::{attention_backward, attention_forward, Masks};
use wgpu_attention::reference::elementwise::{activation_backward, activation_forward, add};
use wgpu_attention::reference::layer_norm::{layer_norm_backward, layer_norm_forward};
use wgpu_attention::reference::linear::{linear_backward, linear_forward};
use wgpu_attention::spec::Activation;
use wgpu_attention::spec::AttentionShape;

const LN_EPS: f64 = 1e-5;

/// Sizes of a layer; `causal` masks its self-attention. `TransformerLayerConfig::default()` (width
/// 32, 4 heads, feed-forward 64, not causal, pre-LN) with setters: `.d_model(64).causal(true)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransformerLayerConfig {
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Feed-forward width.
    pub d_ff: usize,
    /// Causal self-attention.
    pub causal: bool,
    /// LayerNorm before each sub-block (pre-LN) or after each residual sum (post-LN).
    pub pre_ln: bool,
}

impl Default for TransformerLayerConfig {
    fn default() -> Self {
        Self {
            d_model: 32,
            heads: 4,
            d_ff: 64,
            causal: false,
            pre_ln: true,
        }
    }
}

wgpu_attention::config_setters!(TransformerLayerConfig {
    d_model: usize,
    heads: usize,
    d_ff: usize,
    causal: bool,
    pre_ln: bool,
});

/// Parameter names (as [`crate::layers::encoder::EncoderLayer`] names them under its prefix) and
/// shapes, in the order [`forward`] takes them and [`backward`] returns their gradients.
pub fn param_shapes(c: &TransformerLayerConfig) -> Vec<(&'static str, Vec<usize>)> {
    let d = c.d_model;
    vec![
        ("ln1.gamma", vec![d]),
        ("ln1.beta", vec![d]),
        ("attn.qkv.weight", vec![3 * d, d]),
        ("attn.qkv.bias", vec![3 * d]),
        ("attn.out.weight", vec![d, d]),
        ("attn.out.bias", vec![d]),
        ("ln2.gamma", vec![d]),
        ("ln2.beta", vec![d]),
        ("ff.in.weight", vec![c.d_ff, d]),
        ("ff.in.bias", vec![c.d_ff]),
        ("ff.out.weight", vec![d, c.d_ff]),
        ("ff.out.bias", vec![d]),
    ]
}

/// Deterministic initial parameters: LayerNorm gamma 1 and beta 0, weights uniform in
/// `+-1/sqrt(fan_in)` from `seed`, biases small.
pub fn init_params(c: &TransformerLayerConfig, seed: u64) -> Vec<Vec<f64>> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut uniform = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f64 / (1u64 << 24) as f64) * 2.0 - 1.0
    };
    param_shapes(c)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            if name.ends_with("gamma") {
                vec![1.0; n]
            } else if name.ends_with("beta") {
                vec![0.0; n]
            } else if name.ends_with("bias") {
                (0..n).map(|_| 0.02 * uniform()).collect()
            } else {
                let bound = 1.0 / (shape[1] as f64).sqrt();
                (0..n).map(|_| bound * uniform()).collect()
            }
        })
        .collect()
}

/// Columns `[from, from + width)` of each row of a row-major matrix with `cols` columns.
fn columns(x: &[f64], cols: usize, from: usize, width: usize) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| row[from..from + width].iter().copied())
        .collect()
}

fn shape(c: &TransformerLayerConfig, batch: usize, seq: usize) -> AttentionShape {
    AttentionShape {
        batch,
        q_seq: seq,
        kv_seq: seq,
        heads: c.heads,
        kv_heads: c.heads,
        head_dim_qk: c.d_model / c.heads,
        head_dim_v: c.d_model / c.heads,
    }
}

fn masks(c: &TransformerLayerConfig) -> Masks {
    Masks {
        scale: 1.0 / ((c.d_model / c.heads) as f64).sqrt(),
        causal: c.causal,
        q_lens: None,
        kv_lens: None,
        ..Default::default()
    }
}

/// `y` for `x [batch, seq, d_model]` and parameters in `param_shapes` order.
pub fn forward(
    c: &TransformerLayerConfig,
    p: &[Vec<f64>],
    x: &[f64],
    batch: usize,
    seq: usize,
) -> Vec<f64> {
    forward_all(c, p, x, batch, seq).y
}

struct Activations {
    attn_in: Vec<f64>,
    ln1_in: Vec<f64>,
    qkv: Vec<f64>,
    attn: Vec<f64>,
    ff_x: Vec<f64>,
    ln2_in: Vec<f64>,
    ff_in: Vec<f64>,
    ff_act: Vec<f64>,
    y: Vec<f64>,
}

fn split_qkv(qkv: &[f64], d: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    (
        columns(qkv, 3 * d, 0, d),
        columns(qkv, 3 * d, d, d),
        columns(qkv, 3 * d, 2 * d, d),
    )
}

fn forward_all(
    c: &TransformerLayerConfig,
    p: &[Vec<f64>],
    x: &[f64],
    batch: usize,
    seq: usize,
) -> Activations {
    let d = c.d_model;
    let attention = |h: &[f64]| {
        let qkv = linear_forward(h, &p[2], Some(&p[3]), d);
        let (q, k, v) = split_qkv(&qkv, d);
        let (attn, _) = attention_forward(&shape(c, batch, seq), &q, &k, &v, &masks(c));
        let proj = linear_forward(&attn, &p[4], Some(&p[5]), d);
        (qkv, attn, proj)
    };
    let feed_forward = |h: &[f64]| {
        let ff_in = linear_forward(h, &p[8], Some(&p[9]), d);
        let ff_act = activation_forward(Activation::Gelu, &ff_in);
        let ff_out = linear_forward(&ff_act, &p[10], Some(&p[11]), c.d_ff);
        (ff_in, ff_act, ff_out)
    };
    if c.pre_ln {
        let (h1, _) = layer_norm_forward(x, &p[0], &p[1], d, LN_EPS);
        let (qkv, attn, proj) = attention(&h1);
        let x1 = add(x, &proj);
        let (h2, _) = layer_norm_forward(&x1, &p[6], &p[7], d, LN_EPS);
        let (ff_in, ff_act, ff_out) = feed_forward(&h2);
        let y = add(&x1, &ff_out);
        Activations {
            attn_in: h1,
            ln1_in: x.to_vec(),
            qkv,
            attn,
            ff_x: h2,
            ln2_in: x1,
            ff_in,
            ff_act,
            y,
        }
    } else {
        let (qkv, attn, proj) = attention(x);
        let s1 = add(x, &proj);
        let (x1, _) = layer_norm_forward(&s1, &p[0], &p[1], d, LN_EPS);
        let (ff_in, ff_act, ff_out) = feed_forward(&x1);
        let s2 = add(&x1, &ff_out);
        let (y, _) = layer_norm_forward(&s2, &p[6], &p[7], d, LN_EPS);
        Activations {
            attn_in: x.to_vec(),
            ln1_in: s1,
            qkv,
            attn,
            ff_x: x1,
            ln2_in: s2,
            ff_in,
            ff_act,
            y,
        }
    }
}

/// `(dx, parameter gradients in param_shapes order)` for the upstream gradient `dy`.
pub fn backward(
    c: &TransformerLayerConfig,
    p: &[Vec<f64>],
    x: &[f64],
    dy: &[f64],
    batch: usize,
    seq: usize,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let d = c.d_model;
    let a = forward_all(c, p, x, batch, seq);
    let feed_forward_back = |d_out: &[f64]| {
        let (d_act, d_w2, d_b2) = linear_backward(&a.ff_act, &p[10], d_out, c.d_ff);
        let d_ff_in = activation_backward(Activation::Gelu, &a.ff_in, &d_act);
        let (d_ff_x, d_w1, d_b1) = linear_backward(&a.ff_x, &p[8], &d_ff_in, d);
        (d_ff_x, [d_w1, d_b1, d_w2, d_b2])
    };
    let attention_back = |d_proj: &[f64]| {
        let (d_attn, d_wo, d_bo) = linear_backward(&a.attn, &p[4], d_proj, d);
        let (q, k, v) = split_qkv(&a.qkv, d);
        let g = attention_backward(&shape(c, batch, seq), &q, &k, &v, &d_attn, &masks(c));
        let d_qkv: Vec<f64> = (0..batch * seq)
            .flat_map(|r| {
                g.dq[r * d..(r + 1) * d]
                    .iter()
                    .chain(&g.dk[r * d..(r + 1) * d])
                    .chain(&g.dv[r * d..(r + 1) * d])
                    .copied()
                    .collect::<Vec<_>>()
            })
            .collect();
        let (d_in, d_wqkv, d_bqkv) = linear_backward(&a.attn_in, &p[2], &d_qkv, d);
        (d_in, [d_wqkv, d_bqkv, d_wo, d_bo])
    };
    let (dx, ln1, ln2, at, ff) = if c.pre_ln {
        let (d_h2, ff) = feed_forward_back(dy);
        let ln2 = layer_norm_backward(&a.ln2_in, &p[6], &d_h2, d, LN_EPS);
        let d_x1 = add(dy, &ln2.dx);
        let (d_h1, at) = attention_back(&d_x1);
        let ln1 = layer_norm_backward(&a.ln1_in, &p[0], &d_h1, d, LN_EPS);
        (add(&d_x1, &ln1.dx), ln1, ln2, at, ff)
    } else {
        let ln2 = layer_norm_backward(&a.ln2_in, &p[6], dy, d, LN_EPS);
        let (d_ff_x, ff) = feed_forward_back(&ln2.dx);
        let d_x1 = add(&ln2.dx, &d_ff_x);
        let ln1 = layer_norm_backward(&a.ln1_in, &p[0], &d_x1, d, LN_EPS);
        let (d_in, at) = attention_back(&ln1.dx);
        (add(&ln1.dx, &d_in), ln1, ln2, at, ff)
    };
    let [d_wqkv, d_bqkv, d_wo, d_bo] = at;
    let [d_w1, d_b1, d_w2, d_b2] = ff;
    (
        dx,
        vec![
            ln1.d_gamma,
            ln1.d_beta,
            d_wqkv,
            d_bqkv,
            d_wo,
            d_bo,
            ln2.d_gamma,
            ln2.d_beta,
            d_w1,
            d_b1,
            d_w2,
            d_b2,
        ],
    )
}
