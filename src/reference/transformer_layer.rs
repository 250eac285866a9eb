//! The pre-LN Transformer encoder layer of [`crate::layers::transformer_layer`], in f64, composed of
//! the reference ops: the ground truth its GPU forward and every gradient are tested against.

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
    h1: Vec<f64>,
    qkv: Vec<f64>,
    attn: Vec<f64>,
    x1: Vec<f64>,
    h2: Vec<f64>,
    ff_in: Vec<f64>,
    ff_act: Vec<f64>,
    y: Vec<f64>,
}

fn forward_all(
    c: &TransformerLayerConfig,
    p: &[Vec<f64>],
    x: &[f64],
    batch: usize,
    seq: usize,
) -> Activations {
    let d = c.d_model;
    let (h1, _) = layer_norm_forward(x, &p[0], &p[1], d, LN_EPS);
    let qkv = linear_forward(&h1, &p[2], Some(&p[3]), d);
    let (q, k, v) = (
        columns(&qkv, 3 * d, 0, d),
        columns(&qkv, 3 * d, d, d),
        columns(&qkv, 3 * d, 2 * d, d),
    );
    let (attn, _) = attention_forward(&shape(c, batch, seq), &q, &k, &v, &masks(c));
    let x1 = add(x, &linear_forward(&attn, &p[4], Some(&p[5]), d));
    let (h2, _) = layer_norm_forward(&x1, &p[6], &p[7], d, LN_EPS);
    let ff_in = linear_forward(&h2, &p[8], Some(&p[9]), d);
    let ff_act = activation_forward(Activation::Gelu, &ff_in);
    let y = add(&x1, &linear_forward(&ff_act, &p[10], Some(&p[11]), c.d_ff));
    Activations {
        h1,
        qkv,
        attn,
        x1,
        h2,
        ff_in,
        ff_act,
        y,
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
    let (d_act, d_w2, d_b2) = linear_backward(&a.ff_act, &p[10], dy, c.d_ff);
    let d_ff_in = activation_backward(Activation::Gelu, &a.ff_in, &d_act);
    let (d_h2, d_w1, d_b1) = linear_backward(&a.h2, &p[8], &d_ff_in, d);
    let ln2 = layer_norm_backward(&a.x1, &p[6], &d_h2, d, LN_EPS);
    let d_x1 = add(dy, &ln2.dx);
    let (d_attn, d_wo, d_bo) = linear_backward(&a.attn, &p[4], &d_x1, d);
    let (q, k, v) = (
        columns(&a.qkv, 3 * d, 0, d),
        columns(&a.qkv, 3 * d, d, d),
        columns(&a.qkv, 3 * d, 2 * d, d),
    );
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
    let (d_h1, d_wqkv, d_bqkv) = linear_backward(&a.h1, &p[2], &d_qkv, d);
    let ln1 = layer_norm_backward(x, &p[0], &d_h1, d, LN_EPS);
    let dx = add(&d_x1, &ln1.dx);
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
