//! The Transformer of [`crate::model::transformer`] on the CPU in f64, composed of the reference
//! ops: logits, loss and the gradient of every parameter, looked up by the GPU model's parameter
//! names. Each backward recomputes the activations it needs from its inputs (plain, not fast).

use std::collections::HashMap;

use crate::model::transformer::{Batch, BatchShape, TransformerConfig};
use wgpu_attention::reference::additive::{additive_backward, additive_forward, ScoreParams};
use wgpu_attention::reference::attention::{
    attention_backward, attention_forward, Masks, RelativeConfig,
};
use wgpu_attention::reference::cross_entropy::cross_entropy;
use wgpu_attention::reference::elementwise::{
    activation_backward, activation_forward, add, gated_activation_backward,
    gated_activation_forward,
};
use wgpu_attention::reference::embedding::sinusoidal_positions;
use wgpu_attention::reference::embedding::{
    embedding_backward, embedding_forward, positional_backward, positional_forward,
};
use wgpu_attention::reference::layer_norm::{
    layer_norm_backward, layer_norm_forward, rms_norm_backward, rms_norm_forward,
};
use wgpu_attention::reference::linear::{linear_backward, linear_forward};
use wgpu_attention::reference::rope::{rope_scaled, RopeLayout, Rotation};
use wgpu_attention::spec::{AttentionShape, Norm};

/// Parameters by name (as in `Params::names`).
pub type ParamMap = HashMap<String, Vec<f64>>;

/// What [`forward_backward`] computes.
pub struct Output {
    /// `[batch * tgt_len, vocab]`.
    pub logits: Vec<f64>,
    /// Mean cross-entropy over the non-padding targets.
    pub loss: f64,
    /// Every parameter's gradient, by name.
    pub grads: ParamMap,
}

#[derive(Clone)]
enum Sub {
    SelfAttention { name: String, causal: bool },
    Cross { name: String },
    FeedForward { name: String },
}

/// A stream of `[batch, len, d_model]` rows with its padding lengths.
#[derive(Clone, Copy)]
struct Rows<'a> {
    len: usize,
    lens: &'a [u32],
}

struct Model<'a> {
    c: &'a TransformerConfig,
    s: &'a BatchShape,
    p: &'a ParamMap,
    grads: ParamMap,
}

/// Columns `[from, from + width)` of each row of a row-major matrix with `cols` columns.
fn columns(x: &[f64], cols: usize, from: usize, width: usize) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| row[from..from + width].iter().copied())
        .collect()
}

/// Row-wise concatenation of matrices of `widths[i]` columns each.
fn concat_widths(parts: &[&[f64]], widths: &[usize]) -> Vec<f64> {
    let rows = parts[0].len() / widths[0];
    (0..rows)
        .flat_map(|r| {
            parts
                .iter()
                .zip(widths)
                .flat_map(move |(p, &w)| p[r * w..(r + 1) * w].iter().copied())
        })
        .collect()
}

/// Row-wise concatenation of matrices of `d` columns each.
fn concat_columns(parts: &[&[f64]], d: usize) -> Vec<f64> {
    let rows = parts[0].len() / d;
    (0..rows)
        .flat_map(|r| {
            parts
                .iter()
                .flat_map(move |p| p[r * d..(r + 1) * d].iter().copied())
        })
        .collect()
}

/// Additive scores take the masks (lengths, causal, window) and no scale (the score vector is
/// learned).
fn additive_masks(m: Masks) -> Masks {
    Masks {
        scale: 1.0,
        causal: m.causal,
        q_lens: m.q_lens,
        kv_lens: m.kv_lens,
        window: m.window,
        ..Default::default()
    }
}

impl<'a> Model<'a> {
    fn p(&self, name: &str) -> &'a [f64] {
        self.p
            .get(name)
            .unwrap_or_else(|| panic!("reference model: no parameter {name}"))
    }

    fn acc(&mut self, name: &str, g: Vec<f64>) {
        let entry = self
            .grads
            .entry(name.to_string())
            .or_insert_with(|| vec![0.0; g.len()]);
        for (e, v) in entry.iter_mut().zip(g) {
            *e += v;
        }
    }

    fn d(&self) -> usize {
        self.c.d_model
    }

    /// The weight of linear layer `name`: the target embedding for a tied output head.
    fn weight_name(&self, name: &str) -> String {
        match name {
            "out" if self.c.tied_embeddings => "tgt.embed".to_string(),
            _ => format!("{name}.weight"),
        }
    }

    /// Whether linear layer `name` has a bias.
    fn has_bias(&self, name: &str) -> bool {
        match name {
            "out" => self.c.output_bias,
            _ => self.c.bias,
        }
    }

    fn linear(&self, name: &str, x: &[f64], in_f: usize) -> Vec<f64> {
        let bias = self.has_bias(name).then(|| self.p(&format!("{name}.bias")));
        linear_forward(x, self.p(&self.weight_name(name)), bias, in_f)
    }

    fn linear_back(&mut self, name: &str, x: &[f64], dy: &[f64], in_f: usize) -> Vec<f64> {
        let weight = self.weight_name(name);
        let (dx, dw, db) = linear_backward(x, self.p(&weight), dy, in_f);
        self.acc(&weight, dw);
        if self.has_bias(name) {
            self.acc(&format!("{name}.bias"), db);
        }
        dx
    }

    fn layer_norm(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let (g, eps) = (self.p(&format!("{name}.gamma")), self.c.norm_eps as f64);
        match self.c.norm {
            Norm::LayerNorm => {
                let b = self.p(&format!("{name}.beta"));
                layer_norm_forward(x, g, b, self.d(), eps).0
            }
            Norm::RmsNorm => rms_norm_forward(x, g, self.d(), eps),
        }
    }

    fn layer_norm_back(&mut self, name: &str, x: &[f64], dy: &[f64]) -> Vec<f64> {
        let (g, eps) = (self.p(&format!("{name}.gamma")), self.c.norm_eps as f64);
        match self.c.norm {
            Norm::LayerNorm => {
                let g = layer_norm_backward(x, g, dy, self.d(), eps);
                self.acc(&format!("{name}.gamma"), g.d_gamma);
                self.acc(&format!("{name}.beta"), g.d_beta);
                g.dx
            }
            Norm::RmsNorm => {
                let (dx, d_gamma) = rms_norm_backward(x, g, dy, self.d(), eps);
                self.acc(&format!("{name}.gamma"), d_gamma);
                dx
            }
        }
    }

    /// Key and value heads of an attention sublayer: the configuration's in self-attention.
    fn kv_heads(&self, self_attention: bool) -> usize {
        if self_attention {
            self.c.effective_kv_heads()
        } else {
            self.c.heads
        }
    }

    /// `act(x W1^T + b1)`, or the gated `act(gate) * up`, and the hidden pre-activation.
    fn ff_hidden(&self, name: &str, x: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let h = self.linear(&format!("{name}.in"), x, self.d());
        let a = match self.c.gated_feed_forward {
            true => gated_activation_forward(self.c.activation, &h, self.c.d_ff),
            false => activation_forward(self.c.activation, &h),
        };
        (h, a)
    }

    fn attention_shape(&self, q: Rows, kv: Rows, self_attention: bool) -> AttentionShape {
        let h = self.c.heads;
        AttentionShape {
            batch: self.s.batch,
            q_seq: q.len,
            kv_seq: kv.len,
            heads: h,
            kv_heads: self.kv_heads(self_attention),
            head_dim_qk: self.d() / h,
            head_dim_v: self.d() / h,
        }
    }

    /// Masks of attention sublayer `name`; self-attention also gets the configuration's score
    /// modifiers (a window of `w` keys on each side, or only before the query when causal; relative
    /// buckets one-directional when causal) and its learned sinks and relative table.
    fn masks(&self, name: &str, q: Rows, kv: Rows, causal: bool, self_attention: bool) -> Masks {
        let c = &self.c;
        let modified = self_attention.then_some(c);
        let scale = 1.0 / ((self.d() / c.heads) as f64).sqrt();
        Masks {
            // Cosine scores: the learned per-head scale multiplies the unit queries instead.
            scale: if modified.is_some_and(|c| c.cosine_scores.is_some()) {
                1.0
            } else {
                scale
            },
            cosine_scales: modified
                .filter(|c| c.cosine_scores.is_some())
                .map(|_| self.p(&format!("{name}.cosine_scale")).to_vec()),
            sinks: modified
                .filter(|c| c.attention_sinks)
                .map(|_| self.p(&format!("{name}.sinks")).to_vec()),
            relative: modified.and_then(|c| c.relative_buckets).map(|r| {
                let config = RelativeConfig {
                    bidirectional: r.bidirectional && !causal,
                    ..r
                };
                (config, self.p(&format!("{name}.relative")).to_vec())
            }),
            normalize_qk: modified.is_some_and(|c| c.cosine_scores.is_some()),
            key_clip: modified.and_then(|c| c.key_norm_clip.map(f64::from)),
            causal,
            q_lens: Some(q.lens.to_vec()),
            kv_lens: Some(kv.lens.to_vec()),
            softcap: modified.and_then(|c| c.attention_softcap.map(f64::from)),
            alibi: modified.is_some_and(|c| c.alibi),
            window: modified
                .and_then(|c| c.attention_window)
                .map(|w| (w, if causal { 0 } else { w })),
            ..Default::default()
        }
    }

    /// A self-attention layer's additive score vector and bias, `[H, Da]` each.
    fn additive_params(&self, name: &str) -> (&'a [f64], &'a [f64]) {
        (
            self.p(&format!("{name}.additive_w")),
            self.p(&format!("{name}.additive_bias")),
        )
    }

    /// Width of self-attention's Q and K (or additive a and b) projections per head: `d / H`, or
    /// `Da`.
    fn qk_dim(&self) -> usize {
        self.c.additive_attention.unwrap_or(self.d() / self.c.heads)
    }

    /// Widths of self-attention's Q (or a), K (or b) and V projections.
    fn qkv_widths(&self) -> [usize; 3] {
        let (h, kv, hd) = (
            self.c.heads,
            self.c.effective_kv_heads(),
            self.d() / self.c.heads,
        );
        [h * self.qk_dim(), kv * self.qk_dim(), kv * hd]
    }

    /// Q, K, V (each `[B, L, d]` = `[B, L, H, d/H]`) of an attention sublayer.
    fn qkv(&self, sub: &Sub, x: &[f64], memory: &[f64]) -> [Vec<f64>; 3] {
        let d = self.d();
        match sub {
            Sub::SelfAttention { name, .. } => {
                let qkv = self.linear(&format!("{name}.qkv"), x, d);
                let len = x.len() / (self.s.batch * d);
                // Q and K, or additive attention's a and b, then V.
                let [wq, wk, wv] = self.qkv_widths();
                let width = wq + wk + wv;
                let q = columns(&qkv, width, 0, wq);
                let k = columns(&qkv, width, wq, wk);
                [
                    self.rotate(&q, len, 1.0),
                    self.rotate(&k, len, 1.0),
                    columns(&qkv, width, wq + wk, wv),
                ]
            }
            Sub::Cross { name } => {
                let kv = self.linear(&format!("{name}.kv"), memory, d);
                [
                    self.linear(&format!("{name}.q"), x, d),
                    columns(&kv, 2 * d, 0, d),
                    columns(&kv, 2 * d, d, d),
                ]
            }
            Sub::FeedForward { .. } => unreachable!(),
        }
    }

    fn sub_forward(&self, sub: &Sub, x: &[f64], rows: Rows, memory: &[f64], mem: Rows) -> Vec<f64> {
        let d = self.d();
        match sub {
            Sub::FeedForward { name } => {
                let (_, a) = self.ff_hidden(name, x);
                self.linear(&format!("{name}.out"), &a, self.c.d_ff)
            }
            Sub::SelfAttention { name, .. } | Sub::Cross { name } => {
                let (kv_rows, causal, self_attention) = match sub {
                    Sub::SelfAttention { causal, .. } => (rows, *causal, true),
                    _ => (mem, false, false),
                };
                let [q, k, v] = self.qkv(sub, x, memory);
                let shape = self.attention_shape(rows, kv_rows, self_attention);
                let masks = self.masks(name, rows, kv_rows, causal, self_attention);
                let out = match (self_attention, self.c.additive_attention) {
                    (true, Some(da)) => {
                        let (w, bias) = self.additive_params(name);
                        let shape = AttentionShape {
                            head_dim_qk: da,
                            ..shape
                        };
                        additive_forward(
                            &shape,
                            &q,
                            &k,
                            &v,
                            ScoreParams { w, bias },
                            &additive_masks(masks),
                        )
                        .0
                    }
                    _ => attention_forward(&shape, &q, &k, &v, &masks).0,
                };
                self.linear(&format!("{name}.out"), &out, d)
            }
        }
    }

    /// `(dx, d_memory)` of a sublayer for `dy`, parameter gradients accumulated.
    fn sub_backward(
        &mut self,
        sub: &Sub,
        x: &[f64],
        rows: Rows,
        memory: &[f64],
        mem: Rows,
        dy: &[f64],
    ) -> (Vec<f64>, Option<Vec<f64>>) {
        let d = self.d();
        match sub {
            Sub::FeedForward { name } => {
                let (h, a) = self.ff_hidden(name, x);
                let d_a = self.linear_back(&format!("{name}.out"), &a, dy, self.c.d_ff);
                let (act, f) = (self.c.activation, self.c.d_ff);
                let d_h = match self.c.gated_feed_forward {
                    true => gated_activation_backward(act, &h, &d_a, f),
                    false => activation_backward(act, &h, &d_a),
                };
                (self.linear_back(&format!("{name}.in"), x, &d_h, d), None)
            }
            Sub::SelfAttention { name, causal } if self.c.additive_attention.is_some() => {
                let da = self.c.additive_attention.unwrap_or(0);
                let [a, b, v] = self.qkv(sub, x, memory);
                let shape = AttentionShape {
                    head_dim_qk: da,
                    ..self.attention_shape(rows, rows, true)
                };
                let masks = additive_masks(self.masks(name, rows, rows, *causal, true));
                let (w, bias) = self.additive_params(name);
                let (w, bias) = (w.to_vec(), bias.to_vec());
                let scores = ScoreParams { w: &w, bias: &bias };
                let (out, _) = additive_forward(&shape, &a, &b, &v, scores, &masks);
                let d_out = self.linear_back(&format!("{name}.out"), &out, dy, d);
                let g = additive_backward(&shape, &a, &b, &v, scores, &d_out, &masks);
                self.acc(&format!("{name}.additive_w"), g.dw);
                self.acc(&format!("{name}.additive_bias"), g.dbias);
                let d_qkv = concat_widths(&[&g.da, &g.db, &g.dv], &self.qkv_widths());
                (self.linear_back(&format!("{name}.qkv"), x, &d_qkv, d), None)
            }
            Sub::SelfAttention { name, causal } => {
                let [q, k, v] = self.qkv(sub, x, memory);
                let shape = self.attention_shape(rows, rows, true);
                let masks = self.masks(name, rows, rows, *causal, true);
                let (out, _) = attention_forward(&shape, &q, &k, &v, &masks);
                let d_out = self.linear_back(&format!("{name}.out"), &out, dy, d);
                let g = attention_backward(&shape, &q, &k, &v, &d_out, &masks);
                if masks.sinks.is_some() {
                    self.acc(&format!("{name}.sinks"), g.dsinks.clone());
                }
                if masks.relative.is_some() {
                    self.acc(&format!("{name}.relative"), g.drelative.clone());
                }
                if masks.cosine_scales.is_some() {
                    self.acc(&format!("{name}.cosine_scale"), g.dcosine.clone());
                }
                let len = x.len() / (self.s.batch * d);
                let (dq, dk) = (self.rotate(&g.dq, len, -1.0), self.rotate(&g.dk, len, -1.0));
                let d_qkv = concat_widths(&[&dq, &dk, &g.dv], &self.qkv_widths());
                (self.linear_back(&format!("{name}.qkv"), x, &d_qkv, d), None)
            }
            Sub::Cross { name } => {
                let [q, k, v] = self.qkv(sub, x, memory);
                let shape = self.attention_shape(rows, mem, false);
                let masks = self.masks(name, rows, mem, false, false);
                let (out, _) = attention_forward(&shape, &q, &k, &v, &masks);
                let d_out = self.linear_back(&format!("{name}.out"), &out, dy, d);
                let g = attention_backward(&shape, &q, &k, &v, &d_out, &masks);
                let dx = self.linear_back(&format!("{name}.q"), x, &g.dq, d);
                let d_kv = concat_columns(&[&g.dk, &g.dv], d);
                let d_mem = self.linear_back(&format!("{name}.kv"), memory, &d_kv, d);
                (dx, Some(d_mem))
            }
        }
    }

    /// One residual block: its LayerNorm `ln` around the sublayer `sub`.
    fn block_forward(
        &self,
        (ln, sub): (&str, &Sub),
        x: &[f64],
        rows: Rows,
        memory: &[f64],
        mem: Rows,
    ) -> Vec<f64> {
        if self.c.pre_ln {
            add(
                x,
                &self.sub_forward(sub, &self.layer_norm(ln, x), rows, memory, mem),
            )
        } else {
            self.layer_norm(ln, &add(x, &self.sub_forward(sub, x, rows, memory, mem)))
        }
    }

    fn block_backward(
        &mut self,
        (ln, sub): (&str, &Sub),
        x: &[f64],
        rows: Rows,
        memory: &[f64],
        mem: Rows,
        dy: &[f64],
    ) -> (Vec<f64>, Option<Vec<f64>>) {
        if self.c.pre_ln {
            let h = self.layer_norm(ln, x);
            let (d_h, d_mem) = self.sub_backward(sub, &h, rows, memory, mem, dy);
            (add(dy, &self.layer_norm_back(ln, x, &d_h)), d_mem)
        } else {
            let s = add(x, &self.sub_forward(sub, x, rows, memory, mem));
            let ds = self.layer_norm_back(ln, &s, dy);
            let (d_in, d_mem) = self.sub_backward(sub, x, rows, memory, mem, &ds);
            (add(&ds, &d_in), d_mem)
        }
    }

    /// Every residual block of a stack in order, as (LayerNorm name, sublayer).
    fn blocks(&self, encoder: bool) -> Vec<(String, Sub)> {
        let mut blocks = Vec::new();
        if encoder {
            for i in 0..self.c.encoder_layers {
                let n = format!("enc.{i}");
                blocks.push((
                    format!("{n}.ln1"),
                    Sub::SelfAttention {
                        name: format!("{n}.attn"),
                        causal: false,
                    },
                ));
                blocks.push((
                    format!("{n}.ln2"),
                    Sub::FeedForward {
                        name: format!("{n}.ff"),
                    },
                ));
            }
        } else {
            for i in 0..self.c.decoder_layers {
                let n = format!("dec.{i}");
                blocks.push((
                    format!("{n}.ln1"),
                    Sub::SelfAttention {
                        name: format!("{n}.self_attn"),
                        causal: true,
                    },
                ));
                if self.c.has_encoder() {
                    let name = format!("{n}.cross_attn");
                    blocks.push((format!("{n}.ln_cross"), Sub::Cross { name }));
                }
                blocks.push((
                    format!("{n}.ln2"),
                    Sub::FeedForward {
                        name: format!("{n}.ff"),
                    },
                ));
            }
        }
        blocks
    }

    /// The inputs of every block and the stack's output (after the final LayerNorm when pre-LN).
    fn stack_forward(
        &self,
        encoder: bool,
        x: &[f64],
        rows: Rows,
        memory: &[f64],
        mem: Rows,
    ) -> (Vec<Vec<f64>>, Vec<f64>) {
        let mut inputs = Vec::new();
        let mut h = x.to_vec();
        for (ln, sub) in self.blocks(encoder) {
            let y = self.block_forward((&ln, &sub), &h, rows, memory, mem);
            inputs.push(std::mem::replace(&mut h, y));
        }
        let out = if self.c.pre_ln {
            self.layer_norm(&format!("{}.norm", stack_name(encoder)), &h)
        } else {
            h.clone()
        };
        inputs.push(h);
        (inputs, out)
    }

    /// `(dx, summed d_memory)` of a stack for `dy` at its output.
    fn stack_backward(
        &mut self,
        encoder: bool,
        x: &[f64],
        rows: Rows,
        memory: &[f64],
        mem: Rows,
        dy: &[f64],
    ) -> (Vec<f64>, Vec<f64>) {
        let (inputs, _) = self.stack_forward(encoder, x, rows, memory, mem);
        let mut d = dy.to_vec();
        if self.c.pre_ln {
            let last = inputs.last().expect("stack input");
            d = self.layer_norm_back(&format!("{}.norm", stack_name(encoder)), last, &d);
        }
        let mut d_memory = vec![0.0; memory.len()];
        for (i, (ln, sub)) in self.blocks(encoder).iter().enumerate().rev() {
            let (dx, d_mem) = self.block_backward((ln, sub), &inputs[i], rows, memory, mem, &d);
            if let Some(dm) = d_mem {
                d_memory = add(&d_memory, &dm);
            }
            d = dx;
        }
        (d, d_memory)
    }

    /// Token embedding plus positions of stream `name` (`"src"`, `"tgt"`).
    fn embed(&self, name: &str, tokens: &[u32], len: usize) -> Vec<f64> {
        let d = self.d();
        let e = embedding_forward(tokens, self.p(&format!("{name}.embed")), d);
        if self.c.rope_base.is_some() {
            return e;
        }
        positional_forward(&e, &self.positions(name, len), len, d)
    }

    /// Rotary embeddings of self-attention Q or K `[B, L, heads, d/H]` (`sign` -1: the backward).
    fn rotate(&self, x: &[f64], len: usize, sign: f64) -> Vec<f64> {
        let Some(base) = self.c.rope_base else {
            return x.to_vec();
        };
        let hd = self.d() / self.c.heads;
        let heads = x.len() / (self.s.batch * len * hd);
        let rotation = Rotation {
            base: base.into(),
            rotary_dim: hd,
            layout: RopeLayout::Half,
            scaling: self.c.rope_scaling,
        };
        rope_scaled(x, [self.s.batch, len, heads, hd], rotation, 0, sign)
    }

    fn positions(&self, name: &str, len: usize) -> Vec<f64> {
        if self.c.learned_positions {
            self.p(&format!("{name}.pos")).to_vec()
        } else {
            sinusoidal_positions(len, self.d())
        }
    }

    fn embed_back(&mut self, name: &str, tokens: &[u32], len: usize, dx: &[f64]) {
        let d = self.d();
        let g = embedding_backward(tokens, dx, self.c.vocab, d);
        self.acc(&format!("{name}.embed"), g);
        if self.c.learned_positions && self.c.rope_base.is_none() {
            let g = positional_backward(dx, len, d, self.c.position_rows(len));
            self.acc(&format!("{name}.pos"), g);
        }
    }
}

fn stack_name(encoder: bool) -> &'static str {
    if encoder {
        "enc"
    } else {
        "dec"
    }
}

/// Logits and mean loss of `batch`.
pub fn forward(
    c: &TransformerConfig,
    s: &BatchShape,
    p: &ParamMap,
    batch: &Batch,
) -> (Vec<f64>, f64) {
    let o = run(c, s, p, batch, false);
    (o.logits, o.loss)
}

/// Logits, mean loss and the gradient of the mean loss for every parameter.
pub fn forward_backward(
    c: &TransformerConfig,
    s: &BatchShape,
    p: &ParamMap,
    batch: &Batch,
) -> Output {
    run(c, s, p, batch, true)
}

fn run(
    c: &TransformerConfig,
    s: &BatchShape,
    p: &ParamMap,
    batch: &Batch,
    backward: bool,
) -> Output {
    let mut m = Model {
        c,
        s,
        p,
        grads: ParamMap::new(),
    };
    let d = c.d_model;
    let src = Rows {
        len: s.src_len,
        lens: &batch.src_lens,
    };
    let tgt = Rows {
        len: s.tgt_len,
        lens: &batch.tgt_lens,
    };
    let (src_x, memory) = if c.has_encoder() {
        let x = m.embed("src", &batch.src, s.src_len);
        let (_, out) = m.stack_forward(true, &x, src, &[], src);
        (x, out)
    } else {
        (Vec::new(), Vec::new())
    };
    let tgt_x = m.embed("tgt", &batch.tgt_in, s.tgt_len);
    let (_, h) = m.stack_forward(false, &tgt_x, tgt, &memory, src);
    let logits = m.linear("out", &h, d);
    let (loss, _, d_logits) = cross_entropy(&logits, &batch.tgt_out, c.vocab, Some(c.pad_id));
    if backward {
        let d_h = m.linear_back("out", &h, &d_logits, d);
        let (d_tgt_x, d_memory) = m.stack_backward(false, &tgt_x, tgt, &memory, src, &d_h);
        m.embed_back("tgt", &batch.tgt_in, s.tgt_len, &d_tgt_x);
        if c.has_encoder() {
            let (d_src_x, _) = m.stack_backward(true, &src_x, src, &[], src, &d_memory);
            m.embed_back("src", &batch.src, s.src_len, &d_src_x);
        }
    }
    Output {
        logits,
        loss,
        grads: m.grads,
    }
}
