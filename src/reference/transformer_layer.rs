//! The Transformer encoder layer of [`crate::layers::transformer_layer`] (pre-LN or post-LN), in f64,
//! composed of the reference ops: the ground truth its GPU forward and every gradient are tested
//! against.

use crate::kernels::attention::AttentionShape;
use crate::kernels::elementwise::Activation;
use crate::layers::transformer_layer::TransformerLayerConfig;
use crate::reference::attention::{attention_backward, attention_forward, Masks};
use crate::reference::elementwise::{activation_backward, activation_forward, add};
use crate::reference::layer_norm::{layer_norm_backward, layer_norm_forward};
use crate::reference::linear::{linear_backward, linear_forward};

const LN_EPS: f64 = 1e-5;

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
