//! The browser page of wgpu-attention (`web/index.html`): the engine on the page's WebGPU adapter.
//! It reports the adapter, runs fused attention forward and backward for a chosen shape and mask
//! (validated in the page against the f64 reference, timed against the unfused kernels), and trains
//! the digit-reversal model live, returning its loss and cross-attention maps for the page to draw.
//!
//! Everything is async (a page's thread must never block); results go to JavaScript as JSON text.

use std::cell::RefCell;
use std::rc::Rc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use wasm_bindgen::prelude::*;
use web_time::Instant;
use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::reference::attention::{self as reference, Masks};
use wgpu_attention::reference::compare::{
    compare, BACKWARD_ATOL, BACKWARD_RTOL, FORWARD_ATOL, FORWARD_RTOL,
};
use wgpu_attention::{
    attention_backward, attention_backward_unfused, attention_forward, attention_forward_unfused,
    AttentionOptions, AttentionShape, Context, ContextOptions, GpuTensor, HeadsView,
};
use wgpu_attention_transformer::model::{
    AttentionSite, Batch, BatchShape, Transformer, TransformerConfig,
};
use wgpu_attention_transformer::training::Trainer;

fn js_error(e: impl std::fmt::Display) -> JsError {
    JsError::new(&e.to_string())
}

fn json(value: &impl Serialize) -> Result<String, JsError> {
    serde_json::to_string(value).map_err(js_error)
}

/// The engine on the page's adapter, with the reversal model it trains.
#[wasm_bindgen]
pub struct Demo {
    ctx: Rc<Context>,
    model: Rc<RefCell<Reversal>>,
}

#[derive(Serialize)]
struct AdapterJson {
    name: String,
    backend: String,
    device_type: String,
    driver: String,
    kernel_family: String,
    shader_f16: bool,
    subgroups: bool,
    timestamp_query: bool,
    limits: Vec<(&'static str, u64)>,
}

#[derive(Serialize)]
struct Check {
    name: &'static str,
    worst_abs: f64,
    /// Of the tolerance: at most 1 passes.
    worst_ratio: f64,
    passed: bool,
}

#[derive(Serialize)]
struct AttentionRun {
    shape: String,
    checks: Vec<Check>,
    /// Median milliseconds, each from recording to the result read back.
    fused_forward_ms: f64,
    fused_backward_ms: f64,
    unfused_forward_ms: f64,
    unfused_backward_ms: f64,
    repeats: usize,
}

#[wasm_bindgen]
impl Demo {
    /// Opens the adapter the browser offers (WebGPU) and builds the reversal model.
    pub async fn create() -> Result<Demo, JsError> {
        let ctx = Context::new_async(&ContextOptions::new())
            .await
            .map_err(js_error)?;
        let model = Reversal::new(&ctx).map_err(js_error)?;
        Ok(Demo {
            ctx: Rc::new(ctx),
            model: Rc::new(RefCell::new(model)),
        })
    }

    /// The adapter, the kernel family chosen for it, its features and the limits that bound what
    /// runs (JSON).
    pub fn adapter(&self) -> Result<String, JsError> {
        let r = self.ctx.report();
        let l = &r.limits;
        json(&AdapterJson {
            name: r.name.clone(),
            backend: format!("{:?}", r.backend),
            device_type: format!("{:?}", r.device_type),
            driver: format!("{} {}", r.driver, r.driver_info),
            kernel_family: self.ctx.kernel_family().name().to_string(),
            shader_f16: r.features.contains(wgpu::Features::SHADER_F16),
            subgroups: r.features.contains(wgpu::Features::SUBGROUP),
            timestamp_query: r.features.contains(wgpu::Features::TIMESTAMP_QUERY),
            limits: vec![
                (
                    "maxStorageBuffersPerShaderStage",
                    l.max_storage_buffers_per_shader_stage as u64,
                ),
                (
                    "maxComputeWorkgroupStorageSize",
                    l.max_compute_workgroup_storage_size as u64,
                ),
                (
                    "maxComputeInvocationsPerWorkgroup",
                    l.max_compute_invocations_per_workgroup as u64,
                ),
                (
                    "maxStorageBufferBindingSize",
                    l.max_storage_buffer_binding_size,
                ),
                ("maxBufferSize", l.max_buffer_size),
            ],
        })
    }

    /// Fused attention forward and backward on random `[1, len, 4, head_dim]` inputs with `mask`
    /// (`none`, `causal`, `window`), checked against the f64 reference and timed against the
    /// unfused kernels (median of `repeats`); JSON.
    pub async fn run_attention(
        &self,
        len: usize,
        head_dim: usize,
        mask: String,
        repeats: usize,
    ) -> Result<String, JsError> {
        let ctx = self.ctx.clone();
        run_attention(&ctx, len, head_dim, &mask, repeats.max(1)).await
    }

    /// Trains the reversal model for `steps` steps; returns the mean loss of the last one.
    pub async fn train(&self, steps: usize) -> Result<f32, JsError> {
        let (ctx, model) = (self.ctx.clone(), self.model.clone());
        for _ in 0..steps {
            model.borrow_mut().step(&ctx).map_err(js_error)?;
        }
        // No RefCell borrow is held across an await: the page may call in meanwhile.
        let loss = model.borrow().trainer.model.loss().clone();
        let loss = loss.to_vec_async(&ctx).await.map_err(js_error)?;
        if !loss[0].is_finite() {
            // The optimizer's guard has stopped updating (Trainer::check_finite says from when).
            return Err(JsError::new(&format!("the loss is {}", loss[0])));
        }
        Ok(loss[0])
    }

    /// Steps trained so far.
    pub fn steps(&self) -> usize {
        self.model.borrow().steps
    }

    /// The cross-attention of every head of the last decoder layer on `digits` (a string of 1 to
    /// 8 digits), with the tokens of both axes; JSON.
    pub async fn cross_attention(&self, digits: String) -> Result<String, JsError> {
        let (ctx, model) = (self.ctx.clone(), self.model.clone());
        let digits: Vec<u32> = digits
            .chars()
            .filter_map(|c| c.to_digit(10))
            .take(MAX_LEN)
            .collect();
        if digits.is_empty() {
            return Err(JsError::new("give 1 to 8 digits"));
        }
        let map = model
            .borrow_mut()
            .record_map(&ctx, &digits)
            .map_err(js_error)?;
        let values = map.to_vec_async(&ctx).await.map_err(js_error)?;
        let map = model.borrow().map_json(&digits, &values);
        json(&map)
    }
}

fn masks_of(mask: &str, scale: f64) -> Result<Masks, JsError> {
    let mut masks = Masks {
        scale,
        ..Default::default()
    };
    match mask {
        "none" => {}
        "causal" => masks.causal = true,
        "window" => {
            masks.causal = true;
            masks.window = Some((WINDOW, 0));
        }
        other => {
            return Err(JsError::new(&format!(
                "mask {other:?} is not none, causal or window"
            )))
        }
    }
    Ok(masks)
}

/// The sliding window of the `window` mask: each query sees itself and the 32 keys before it.
const WINDOW: usize = 32;

fn options_of(mask: &str) -> AttentionOptions<'static> {
    match mask {
        "causal" => AttentionOptions::new().causal(true),
        "window" => AttentionOptions::new().causal(true).window(WINDOW, 0),
        _ => AttentionOptions::new(),
    }
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

async fn run_attention(
    ctx: &Context,
    len: usize,
    head_dim: usize,
    mask: &str,
    repeats: usize,
) -> Result<String, JsError> {
    const HEADS: usize = 4;
    let s = AttentionShape {
        batch: 1,
        q_seq: len,
        kv_seq: len,
        heads: HEADS,
        kv_heads: HEADS,
        head_dim_qk: head_dim,
        head_dim_v: head_dim,
    };
    let masks = masks_of(mask, 1.0 / (head_dim as f64).sqrt())?;
    let opts = options_of(mask);
    let mut rng = SmallRng::seed_from_u64(len as u64 * 1000 + head_dim as u64);
    let n = len * HEADS * head_dim;
    let mut random = || -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (q, k, v, d_out) = (random(), random(), random(), random());
    let upload = |data: &[f32]| -> wgpu_attention::Result<HeadsView> {
        GpuTensor::from_slice(ctx, data, &[1, len, HEADS, head_dim])?.heads()
    };
    let [qv, kv, vv, dov] = [upload(&q)?, upload(&k)?, upload(&v)?, upload(&d_out)?];

    // Correctness first: the fused results against the f64 reference.
    let fwd = attention_forward(ctx, &qv, &kv, &vv, &opts)?;
    let grads = attention_backward(ctx, &qv, &kv, &vv, &fwd, &dov, &opts)?;
    let f64s = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let (ref_out, _) = reference::attention_forward(&s, &f64s(&q), &f64s(&k), &f64s(&v), &masks);
    let r =
        reference::attention_backward(&s, &f64s(&q), &f64s(&k), &f64s(&v), &f64s(&d_out), &masks);
    let mut checks = Vec::new();
    for (name, gpu, reference, (atol, rtol)) in [
        (
            "out",
            fwd.out.to_vec_async(ctx).await?,
            &ref_out,
            (FORWARD_ATOL, FORWARD_RTOL),
        ),
        (
            "dq",
            grads.dq.to_vec_async(ctx).await?,
            &r.dq,
            (BACKWARD_ATOL, BACKWARD_RTOL),
        ),
        (
            "dk",
            grads.dk.to_vec_async(ctx).await?,
            &r.dk,
            (BACKWARD_ATOL, BACKWARD_RTOL),
        ),
        (
            "dv",
            grads.dv.to_vec_async(ctx).await?,
            &r.dv,
            (BACKWARD_ATOL, BACKWARD_RTOL),
        ),
    ] {
        let c = compare(&gpu, reference, atol, rtol);
        checks.push(Check {
            name,
            worst_abs: c.worst_abs,
            worst_ratio: c.worst_ratio,
            passed: c.passed(),
        });
    }

    // Timings: each run from recording to a result read back (a browser has no blocking wait).
    let mut times = [(); 4].map(|_| Vec::new());
    for _ in 0..repeats {
        let start = Instant::now();
        let fwd = attention_forward(ctx, &qv, &kv, &vv, &opts)?;
        fwd.lse.to_vec_async(ctx).await?;
        times[0].push(start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        let g = attention_backward(ctx, &qv, &kv, &vv, &fwd, &dov, &opts)?;
        g.dv.to_vec_async(ctx).await?;
        times[1].push(start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        let unfused = attention_forward_unfused(ctx, &qv, &kv, &vv, &opts)?;
        unfused.lse.to_vec_async(ctx).await?;
        times[2].push(start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        let g = attention_backward_unfused(ctx, &qv, &kv, &vv, &dov, &opts)?;
        g.dv.to_vec_async(ctx).await?;
        times[3].push(start.elapsed().as_secs_f64() * 1e3);
    }
    let [f, b, uf, ub] = times.map(median);
    json(&AttentionRun {
        shape: format!("B1 L{len} H{HEADS} D{head_dim} {mask}"),
        checks,
        fused_forward_ms: f,
        fused_backward_ms: b,
        unfused_forward_ms: uf,
        unfused_backward_ms: ub,
        repeats,
    })
}

const PAD: u32 = 0;
const BOS: u32 = 1;
const EOS: u32 = 2;
const DIGIT0: u32 = 3;
/// Longest digit string.
const MAX_LEN: usize = 8;
const BATCH: usize = 16;
const SHAPE: BatchShape = BatchShape {
    batch: BATCH,
    src_len: MAX_LEN,
    tgt_len: MAX_LEN + 1,
};

/// The digit-reversal task of `examples/train_seq2seq`, smaller: the decoder learns to read the
/// source from its end, which its cross-attention shows as an anti-diagonal.
struct Reversal {
    trainer: Trainer,
    rng: SmallRng,
    steps: usize,
}

#[derive(Serialize)]
struct MapJson {
    /// Decoder input tokens (the rows).
    rows: Vec<String>,
    /// Source tokens (the columns).
    cols: Vec<String>,
    /// `[head][row][col]` probabilities.
    heads: Vec<Vec<Vec<f32>>>,
    steps: usize,
}

impl Reversal {
    fn config() -> TransformerConfig {
        TransformerConfig::default()
            .vocab((DIGIT0 + 10) as usize)
            .d_model(32)
            .heads(4)
            .d_ff(64)
            .encoder_layers(1)
            .decoder_layers(2)
            .pre_ln(true)
            .pad_id(PAD)
    }

    fn new(ctx: &Context) -> wgpu_attention::Result<Self> {
        let model = Transformer::new(ctx, Self::config(), SHAPE, 1)?;
        let adam = AdamWConfig::default().lr(3e-3);
        Ok(Self {
            trainer: Trainer::new(ctx, model, adam)?,
            rng: SmallRng::seed_from_u64(7),
            steps: 0,
        })
    }

    /// Source digits, decoder input BOS + reversed digits, targets reversed digits + EOS.
    fn batch_of(sequences: &[Vec<u32>]) -> Batch {
        let mut b = Batch::default();
        let pad = |mut v: Vec<u32>, len: usize| {
            v.resize(len, PAD);
            v
        };
        for seq in sequences {
            let tokens: Vec<u32> = seq.iter().map(|d| DIGIT0 + d).collect();
            let rev: Vec<u32> = tokens.iter().rev().copied().collect();
            b.src.extend(pad(tokens.clone(), MAX_LEN));
            b.src_lens.push(tokens.len() as u32);
            b.tgt_in
                .extend(pad([vec![BOS], rev.clone()].concat(), MAX_LEN + 1));
            b.tgt_out
                .extend(pad([rev, vec![EOS]].concat(), MAX_LEN + 1));
            b.tgt_lens.push(tokens.len() as u32 + 1);
        }
        b
    }

    fn step(&mut self, ctx: &Context) -> wgpu_attention::Result<()> {
        let sequences: Vec<Vec<u32>> = (0..BATCH)
            .map(|_| {
                let len = self.rng.random_range(3..=MAX_LEN);
                (0..len).map(|_| self.rng.random_range(0..10)).collect()
            })
            .collect();
        self.trainer.step(ctx, &Self::batch_of(&sequences))?;
        self.steps += 1;
        Ok(())
    }

    /// Records a forward of `digits` (every batch row the same) and the last decoder layer's
    /// cross-attention map `[B, H, Lq, Lk]`.
    fn record_map(&mut self, ctx: &Context, digits: &[u32]) -> wgpu_attention::Result<GpuTensor> {
        let batch = Self::batch_of(&vec![digits.to_vec(); BATCH]);
        self.trainer.forward(ctx, &batch)?;
        let last = Self::config().decoder_layers - 1;
        self.trainer
            .model
            .attention_map(ctx, AttentionSite::DecoderCross(last))
    }

    fn map_json(&self, digits: &[u32], values: &[f32]) -> MapJson {
        let label = |t: u32| match t {
            BOS => "<s>".to_string(),
            EOS => "</s>".to_string(),
            PAD => "_".to_string(),
            d => (d - DIGIT0).to_string(),
        };
        let n = digits.len();
        let rows: Vec<String> = [BOS]
            .into_iter()
            .chain(digits.iter().rev().map(|d| DIGIT0 + d))
            .map(label)
            .collect();
        let cols: Vec<String> = digits.iter().map(|d| label(DIGIT0 + d)).collect();
        let heads = Self::config().heads;
        let (lq, lk) = (MAX_LEN + 1, MAX_LEN);
        // Batch row 0: [H, Lq, Lk], the first n + 1 rows and n columns.
        let heads = (0..heads)
            .map(|h| {
                (0..=n)
                    .map(|i| (0..n).map(|j| values[(h * lq + i) * lk + j]).collect())
                    .collect()
            })
            .collect();
        MapJson {
            rows,
            cols,
            heads,
            steps: self.steps,
        }
    }
}
