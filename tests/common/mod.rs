//! Shared test helpers: GPU contexts for every back end under test, seeded random data, the reference
//! bridge and the one `assert_close` that reports the worst error and where.
#![allow(dead_code)]

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use wgpu_attention::reference::attention::{self as reference, Bias, Grads, Masks};
use wgpu_attention::{
    AttentionOptions, AttentionShape, BiasView, Context, GpuTensor, HeadsView, RelativeBuckets,
    SeqLens,
};

/// Tolerances of SPEC.md, kept in one place: the library's comparison module.
#[allow(unused_imports)]
pub use wgpu_attention::reference::compare::{
    BACKWARD_ATOL, BACKWARD_RTOL, FORWARD_ATOL, FORWARD_RTOL,
};

#[cfg(not(target_arch = "wasm32"))]
mod contexts;
#[cfg(not(target_arch = "wasm32"))]
#[allow(unused_imports)]
pub use contexts::*;

pub fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

/// Uniform values in [-scale, scale).
pub fn random(rng: &mut SmallRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Log-sum-exp rows against the reference: a row that sees no key is -inf on both sides exactly,
/// the others within `atol + rtol |ref|`.
pub fn assert_lse_close(what: &str, got: &[f32], reference: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), reference.len(), "{what}: lse length");
    for (n, (&g, &r)) in got.iter().zip(reference).enumerate() {
        let ok = match r == f64::NEG_INFINITY {
            true => g == f32::NEG_INFINITY,
            false => (g as f64 - r).abs() <= atol + rtol * r.abs(),
        };
        assert!(ok, "{what} lse[{n}]: {g} vs {r}");
    }
}

pub fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Worst error of a comparison, for the report.
#[derive(Clone, Copy, Debug, Default)]
pub struct Worst {
    pub abs: f64,
    /// abs / (atol + rtol * |ref|): <= 1 passes.
    pub ratio: f64,
    pub index: usize,
}

/// Compares `gpu` with `reference` elementwise: `|gpu - ref| <= atol * max(1, max|ref|) + rtol * |ref|`.
/// A `-inf` reference must be matched exactly; NaN anywhere fails. Panics with the worst element.
pub fn assert_close(what: &str, gpu: &[f32], reference: &[f64], atol: f64, rtol: f64) -> Worst {
    assert_eq!(gpu.len(), reference.len(), "{what}: length");
    let max_ref = reference
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs()));
    let atol = atol * max_ref.max(1.0);
    let mut worst = Worst::default();
    for (i, (&g, &r)) in gpu.iter().zip(reference).enumerate() {
        let g = g as f64;
        assert!(!g.is_nan(), "{what}: NaN at {i} (reference {r})");
        if r.is_infinite() {
            assert_eq!(g, r, "{what}: element {i} is {g}, reference {r}");
            continue;
        }
        let err = (g - r).abs();
        let ratio = err / (atol + rtol * r.abs());
        if ratio > worst.ratio || !ratio.is_finite() {
            worst = Worst {
                abs: err,
                ratio,
                index: i,
            };
        }
        assert!(
            ratio <= 1.0,
            "{what}: element {i}: gpu {g} vs reference {r}, |err| {err:.3e} > {:.3e}",
            atol + rtol * r.abs()
        );
    }
    println!(
        "worst {what}: |err| {:.3e} ({:.1}% of tolerance) at {}",
        worst.abs,
        worst.ratio * 100.0,
        worst.index
    );
    worst
}

/// One attention problem: sizes, masks and how the data is drawn.
#[derive(Clone, Debug)]
pub struct Case {
    pub b: usize,
    pub lq: usize,
    pub lk: usize,
    pub h: usize,
    pub hkv: usize,
    pub dk: usize,
    pub dv: usize,
    pub causal: bool,
    pub q_lens: Option<Vec<u32>>,
    pub kv_lens: Option<Vec<u32>>,
    /// Magnitude of the random inputs (large values give large logits).
    pub magnitude: f32,
    pub temperature: Option<f32>,
    pub softcap: Option<f32>,
    pub alibi: bool,
    pub alibi_slopes: Option<Vec<f32>>,
    pub window: Option<(usize, usize)>,
    pub sinks: Option<Vec<f32>>,
    pub cosine: Option<f32>,
    /// Learned per-head cosine scales.
    pub cosine_scales: Option<Vec<f32>>,
    pub key_clip: Option<f32>,
    pub bias: Option<BiasCase>,
    pub relative: Option<RelativeBuckets>,
    pub seed: u64,
}

/// An additive bias of a case: `[batch, heads, Lq, Lk]` with `batch` 1 or B and `heads` 1 or H,
/// random values of magnitude 2, every `masked_every`-th entry `-inf` (0: none); `strided` stores
/// it at an offset with padded rows, read through a strided view.
#[derive(Clone, Copy, Debug)]
pub struct BiasCase {
    pub batch: usize,
    pub heads: usize,
    pub learnable: bool,
    pub masked_every: usize,
    pub strided: bool,
}

/// The GPU objects a case's options borrow.
pub struct CaseBuffers {
    pub lens: Option<SeqLens>,
    pub sinks: Option<GpuTensor>,
    pub bias: Option<BiasView>,
    pub table: Option<GpuTensor>,
    /// Learned cosine scales and their gradient.
    pub cosine: Option<(GpuTensor, GpuTensor)>,
    /// The case's ALiBi slopes, which the options borrow.
    pub alibi_slopes: Option<Vec<f32>>,
}

impl Case {
    pub fn new(b: usize, lq: usize, lk: usize, h: usize, hkv: usize, dk: usize, dv: usize) -> Self {
        Self {
            b,
            lq,
            lk,
            h,
            hkv,
            dk,
            dv,
            causal: false,
            q_lens: None,
            kv_lens: None,
            magnitude: 1.0,
            temperature: None,
            softcap: None,
            alibi: false,
            alibi_slopes: None,
            window: None,
            sinks: None,
            cosine: None,
            cosine_scales: None,
            key_clip: None,
            bias: None,
            relative: None,
            seed: 7,
        }
    }

    pub fn causal(mut self) -> Self {
        self.causal = true;
        self
    }

    pub fn q_lens(mut self, lens: &[u32]) -> Self {
        self.q_lens = Some(lens.to_vec());
        self
    }

    pub fn kv_lens(mut self, lens: &[u32]) -> Self {
        self.kv_lens = Some(lens.to_vec());
        self
    }

    pub fn magnitude(mut self, m: f32) -> Self {
        self.magnitude = m;
        self
    }

    pub fn temperature(mut self, t: f32) -> Self {
        self.temperature = Some(t);
        self
    }

    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    pub fn alibi(mut self) -> Self {
        self.alibi = true;
        self
    }

    pub fn alibi_slopes(mut self, slopes: &[f32]) -> Self {
        self.alibi = true;
        self.alibi_slopes = Some(slopes.to_vec());
        self
    }

    pub fn cosine(mut self, scale: f32) -> Self {
        self.cosine = Some(scale);
        self
    }

    pub fn cosine_learned(mut self, scales: &[f32]) -> Self {
        self.cosine_scales = Some(scales.to_vec());
        self
    }

    pub fn key_clip(mut self, max_norm: f32) -> Self {
        self.key_clip = Some(max_norm);
        self
    }

    pub fn sinks(mut self, sinks: &[f32]) -> Self {
        self.sinks = Some(sinks.to_vec());
        self
    }

    pub fn window(mut self, left: usize, right: usize) -> Self {
        self.window = Some((left, right));
        self
    }

    pub fn bias(mut self, bias: BiasCase) -> Self {
        self.bias = Some(bias);
        self
    }

    pub fn relative(mut self, buckets: usize, max_distance: usize, bidirectional: bool) -> Self {
        self.relative = Some(RelativeBuckets::new(buckets, max_distance, bidirectional));
        self
    }

    /// The bias values `[bb, hb, Lq, Lk]` (contiguous), if any.
    pub fn bias_values(&self) -> Option<Vec<f32>> {
        let bias = self.bias?;
        let mut r = rng(self.seed ^ 0xb1a5);
        let mut values = random(&mut r, bias.batch * bias.heads * self.lq * self.lk, 2.0);
        if bias.masked_every > 0 {
            for x in values.iter_mut().step_by(bias.masked_every) {
                *x = f32::NEG_INFINITY;
            }
        }
        Some(values)
    }

    /// The relative table `[H, buckets]`, if any.
    pub fn table_values(&self) -> Option<Vec<f32>> {
        let buckets = self.relative?;
        let mut r = rng(self.seed ^ 0x7ab1e);
        Some(random(&mut r, self.h * buckets.buckets, 2.0))
    }

    pub fn shape(&self) -> AttentionShape {
        AttentionShape {
            batch: self.b,
            q_seq: self.lq,
            kv_seq: self.lk,
            heads: self.h,
            kv_heads: self.hkv,
            head_dim_qk: self.dk,
            head_dim_v: self.dv,
        }
    }

    pub fn label(&self) -> String {
        format!(
            "B{} Lq{} Lk{} H{}/{} Dk{} Dv{}{}{}{}{}{}{}{}{}{}{}",
            self.b,
            self.lq,
            self.lk,
            self.h,
            self.hkv,
            self.dk,
            self.dv,
            if self.causal { " causal" } else { "" },
            self.q_lens
                .as_ref()
                .map_or(String::new(), |l| format!(" q_lens{l:?}")),
            self.kv_lens
                .as_ref()
                .map_or(String::new(), |l| format!(" kv_lens{l:?}")),
            if self.magnitude != 1.0 {
                format!(" x{}", self.magnitude)
            } else {
                String::new()
            },
            self.softcap
                .map_or(String::new(), |c| format!(" softcap{c}")),
            match (&self.alibi_slopes, self.alibi) {
                (Some(s), _) => format!(" alibi{s:?}"),
                (None, true) => " alibi".to_string(),
                (None, false) => String::new(),
            },
            self.window
                .map_or(String::new(), |(l, r)| format!(" window{l}/{r}")),
            if self.sinks.is_some() { " sinks" } else { "" },
            self.cosine.map_or(String::new(), |c| format!(" cosine{c}"))
                + &self
                    .cosine_scales
                    .as_ref()
                    .map_or(String::new(), |c| format!(" cosine{c:?}")),
            self.key_clip.map_or(String::new(), |c| format!(" clip{c}")),
        ) + &self.bias.map_or(String::new(), |b| {
            format!(
                " bias[{},{}]{}{}{}",
                b.batch,
                b.heads,
                if b.learnable { "" } else { " constant" },
                if b.masked_every > 0 { " -inf" } else { "" },
                if b.strided { " strided" } else { "" }
            )
        }) + &self.relative.map_or(String::new(), |r| {
            format!(
                " relative{}/{}{}",
                r.buckets,
                r.max_distance,
                if r.bidirectional { " bidir" } else { "" }
            )
        })
    }

    pub fn scale(&self) -> f32 {
        let scale = match (self.cosine, &self.cosine_scales) {
            (_, Some(_)) => 1.0,
            (Some(c), None) => c,
            (None, None) => 1.0 / (self.dk as f32).sqrt(),
        };
        scale / self.temperature.unwrap_or(1.0)
    }

    pub fn masks(&self) -> Masks {
        Masks {
            scale: self.scale() as f64,
            causal: self.causal,
            q_lens: self.q_lens.clone(),
            kv_lens: self.kv_lens.clone(),
            softcap: self.softcap.map(f64::from),
            alibi: self.alibi,
            alibi_slopes: self
                .alibi_slopes
                .as_ref()
                .map(|s| s.iter().map(|&x| x as f64).collect()),
            window: self.window,
            sinks: self
                .sinks
                .as_ref()
                .map(|s| s.iter().map(|&x| x as f64).collect()),
            normalize_qk: self.cosine.is_some() || self.cosine_scales.is_some(),
            cosine_scales: self
                .cosine_scales
                .as_ref()
                .map(|s| s.iter().map(|&x| x as f64).collect()),
            key_clip: self.key_clip.map(f64::from),
            // A constant bias has no gradient: the reference still computes one, the test skips it.
            bias: self.bias_values().map(|values| Bias {
                values: to_f64(&values),
                batch: self.bias.unwrap().batch,
                heads: self.bias.unwrap().heads,
            }),
            relative: self
                .relative
                .map(|r| (r, to_f64(&self.table_values().unwrap()))),
        }
    }

    /// Uploads the case's per-batch lengths and sinks, if any.
    pub fn buffers(&self, ctx: &Context) -> CaseBuffers {
        let lens = (self.q_lens.is_some() || self.kv_lens.is_some())
            .then(|| SeqLens::new(ctx, self.q_lens.as_deref(), self.kv_lens.as_deref()).unwrap());
        let sinks = self
            .sinks
            .as_ref()
            .map(|s| GpuTensor::from_slice(ctx, s, &[s.len()]).unwrap());
        let bias = self.bias.map(|spec| {
            let values = self.bias_values().unwrap();
            let shape = [spec.batch, spec.heads, self.lq, self.lk];
            if !spec.strided {
                let t = GpuTensor::from_slice(ctx, &values, &shape).unwrap();
                return BiasView::of(&t).unwrap();
            }
            // Rows padded to Lk + 3, the whole at element offset 5.
            let (offset, row) = (5, self.lk + 3);
            let mut data = vec![0.0f32; offset + spec.batch * spec.heads * self.lq * row];
            for (n, chunk) in values.chunks(self.lk).enumerate() {
                data[offset + n * row..][..self.lk].copy_from_slice(chunk);
            }
            let t = GpuTensor::from_slice(ctx, &data, &[data.len()]).unwrap();
            let strides = [spec.heads * self.lq * row, self.lq * row, row, 1];
            BiasView::new(t.buffer().clone(), offset, shape, strides).unwrap()
        });
        let table = self.table_values().map(|values| {
            GpuTensor::from_slice(ctx, &values, &[self.h, self.relative.unwrap().buckets]).unwrap()
        });
        let cosine = self.cosine_scales.as_ref().map(|s| {
            (
                GpuTensor::from_slice(ctx, s, &[s.len()]).unwrap(),
                GpuTensor::zeros(ctx, &[s.len()]).unwrap(),
            )
        });
        CaseBuffers {
            lens,
            sinks,
            bias,
            table,
            cosine,
            alibi_slopes: self.alibi_slopes.clone(),
        }
    }

    /// The GPU options of the case, borrowing what [`Case::buffers`] uploaded.
    pub fn options<'a>(&self, buffers: &'a CaseBuffers) -> AttentionOptions<'a> {
        let lens = buffers.lens.as_ref();
        let mut opts = AttentionOptions::new().causal(self.causal);
        if let Some(t) = self.temperature {
            opts = opts.temperature(t);
        }
        if let Some(l) = lens {
            opts = opts.seq_lens(l);
        }
        if let Some(cap) = self.softcap {
            opts = opts.softcap(cap);
        }
        if let Some((left, right)) = self.window {
            opts = opts.window(left, right);
        }
        if let Some(sinks) = &buffers.sinks {
            opts = opts.sinks(sinks);
        }
        if let Some(scale) = self.cosine {
            opts = opts.cosine(scale);
        }
        if let Some(max_norm) = self.key_clip {
            opts = opts.key_norm_clip(max_norm);
        }
        if let Some((scale, grad)) = &buffers.cosine {
            opts = opts.cosine_learned(scale, grad);
        }
        if let Some(bias) = &buffers.bias {
            opts = match self.bias.unwrap().learnable {
                true => opts.bias(bias),
                false => opts.constant_bias(bias),
            };
        }
        if let (Some(buckets), Some(table)) = (self.relative, &buffers.table) {
            opts = opts.relative_buckets(buckets, table);
        }
        match &buffers.alibi_slopes {
            Some(slopes) => opts.alibi_slopes(slopes),
            None => opts.alibi(self.alibi),
        }
    }

    /// Uploads (q, k, v, d_out) as head views.
    pub fn upload(&self, ctx: &Context) -> [HeadsView; 4] {
        let (q, k, v, d_out) = self.data();
        [
            upload(ctx, &q, [self.b, self.lq, self.h, self.dk]),
            upload(ctx, &k, [self.b, self.lk, self.hkv, self.dk]),
            upload(ctx, &v, [self.b, self.lk, self.hkv, self.dv]),
            upload(ctx, &d_out, [self.b, self.lq, self.h, self.dv]),
        ]
    }

    /// Reference forward `(out, lse)` of the case's data.
    pub fn reference_forward(&self) -> (Vec<f64>, Vec<f64>) {
        let (q, k, v, _) = self.data();
        reference::attention_forward(
            &self.shape(),
            &to_f64(&q),
            &to_f64(&k),
            &to_f64(&v),
            &self.masks(),
        )
    }

    /// Reference gradients of the case's data.
    pub fn reference_backward(&self) -> Grads {
        let (q, k, v, d_out) = self.data();
        reference::attention_backward(
            &self.shape(),
            &to_f64(&q),
            &to_f64(&k),
            &to_f64(&v),
            &to_f64(&d_out),
            &self.masks(),
        )
    }

    /// Random (q, k, v, d_out) host data, contiguous BSHD.
    pub fn data(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut r = rng(self.seed);
        let q = random(&mut r, self.b * self.lq * self.h * self.dk, self.magnitude);
        let k = random(
            &mut r,
            self.b * self.lk * self.hkv * self.dk,
            self.magnitude,
        );
        let v = random(&mut r, self.b * self.lk * self.hkv * self.dv, 1.0);
        let d_out = random(&mut r, self.b * self.lq * self.h * self.dv, 1.0);
        (q, k, v, d_out)
    }
}

/// Uploads contiguous BSHD data as a head view.
pub fn upload(ctx: &Context, data: &[f32], shape: [usize; 4]) -> HeadsView {
    GpuTensor::from_slice(ctx, data, &shape)
        .unwrap()
        .heads()
        .unwrap()
}

/// Odd sequence lengths and every head dim of SPEC.md (plus non-multiples of 4 down to 1), no mask:
/// the grid shared by the forward and backward tests.
pub fn odd_size_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for d in [8, 40, 64, 80, 128, 256] {
        for (lq, lk) in [(1, 1), (7, 7), (33, 33), (129, 129), (1, 129), (129, 7)] {
            let mut case = Case::new(1, lq, lk, 2, 2, d, d);
            case.seed = (d * 1000 + lq * 10 + lk) as u64;
            cases.push(case);
        }
    }
    // One element, one vec4 and one more, eight and one more: each a fresh compile of every kernel
    // of every family on a cold shader cache, so no more of them (3 and 17 added nothing 1, 5 and
    // 33 do not cover).
    for d in [1, 5, 33] {
        cases.push(Case::new(2, 9, 13, 2, 1, d, d));
    }
    cases
}

/// Causal, key padding, query padding and their combinations, self- and cross-attention.
pub fn mask_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (lq, lk) in [(33, 33), (7, 33), (33, 7), (129, 65)] {
        let base = Case::new(3, lq, lk, 2, 2, 40, 40);
        let kv_lens = [lk as u32, (lk / 2) as u32 + 1, 1];
        let q_lens = [(lq / 3) as u32 + 1, lq as u32, (lq / 2) as u32];
        cases.extend([
            base.clone().causal(),
            base.clone().kv_lens(&kv_lens),
            base.clone().q_lens(&q_lens),
            base.clone().q_lens(&q_lens).kv_lens(&kv_lens),
            base.clone().causal().kv_lens(&kv_lens),
            base.clone().causal().q_lens(&q_lens).kv_lens(&kv_lens),
        ]);
    }
    cases
}

/// Grouped- and multi-query heads, and Dk != Dv.
pub fn grouped_head_cases() -> Vec<Case> {
    vec![
        Case::new(2, 33, 33, 8, 2, 64, 64),
        Case::new(2, 33, 47, 4, 1, 64, 64).causal(),
        Case::new(1, 17, 29, 6, 3, 40, 24),
        Case::new(2, 7, 33, 4, 2, 16, 128).kv_lens(&[20, 33]),
        Case::new(1, 65, 65, 2, 1, 256, 8).causal(),
        Case::new(1, 33, 33, 2, 2, 80, 256),
        // A group of 4 query heads over 256 keys: ~1024 query iterations per key block.
        Case::new(1, 256, 256, 8, 2, 64, 64),
    ]
}

/// Cases whose kernel loops are split into chunks under a small loop budget: chunk boundaries fall
/// inside key and query tiles, across the query heads of a group, and between masked regions.
pub fn split_loop_cases() -> Vec<Case> {
    vec![
        Case::new(1, 129, 129, 2, 2, 40, 40),
        Case::new(2, 65, 200, 4, 2, 40, 24).causal(),
        Case::new(3, 129, 65, 2, 2, 40, 40)
            .causal()
            .q_lens(&[44, 129, 64])
            .kv_lens(&[65, 33, 1]),
        Case::new(1, 200, 200, 4, 1, 16, 16).kv_lens(&[150]),
    ]
}

/// Score modifiers alone and with every mask, GQA, Dk != Dv and per-batch lengths. Inputs of
/// magnitude 3 give scaled scores up to about 10, so a cap of 4 bends most of them; 6 heads test the
/// ALiBi slopes of a head count that is not a power of two.
pub fn score_modifier_cases() -> Vec<Case> {
    let base = Case::new(2, 33, 47, 4, 2, 40, 40).magnitude(3.0);
    vec![
        base.clone().softcap(4.0),
        base.clone().alibi(),
        base.clone().softcap(4.0).alibi().causal(),
        base.clone()
            .softcap(4.0)
            .alibi()
            .causal()
            .q_lens(&[20, 33])
            .kv_lens(&[47, 9]),
        Case::new(1, 17, 29, 6, 3, 40, 24).alibi().causal(),
        // Caller's per-head slopes (a negative one and zero included).
        base.clone()
            .alibi_slopes(&[0.5, 0.0, -0.125, 2.0])
            .kv_lens(&[47, 30]),
        Case::new(2, 7, 33, 4, 2, 16, 128)
            .magnitude(3.0)
            .softcap(2.5)
            .kv_lens(&[20, 33]),
    ]
}

/// Sliding windows: two-sided, causal, cross-attention (Lq != Lk, so positions are aligned), zero
/// width (rows past the keys see nothing), wider than the sequence, with padding, GQA and the score
/// modifiers, and long enough (129 rows, 256-row CPU-family blocks, 16-64-row GPU-family blocks) that
/// whole key blocks fall outside the window and are skipped.
pub fn window_cases() -> Vec<Case> {
    vec![
        Case::new(2, 33, 33, 2, 2, 40, 40).window(5, 3),
        Case::new(2, 33, 47, 4, 2, 40, 40)
            .causal()
            .window(7, 0)
            .q_lens(&[20, 33])
            .kv_lens(&[47, 9]),
        Case::new(1, 7, 33, 2, 1, 40, 24).window(4, 2),
        Case::new(1, 33, 7, 2, 2, 40, 40).window(0, 0),
        Case::new(1, 17, 29, 2, 2, 40, 40).window(1000, 1000),
        Case::new(1, 129, 129, 2, 2, 40, 40)
            .magnitude(3.0)
            .softcap(4.0)
            .alibi()
            .window(10, 20),
        Case::new(1, 129, 129, 4, 2, 64, 64).causal().window(15, 0),
    ]
}

/// Attention sinks: alone, with causal + padding (rows past a length and a batch with one key), with
/// GQA, Dk != Dv and a window, and with the score modifiers; sinks from well below to well above the
/// scores, so the sink takes from nothing to most of a row's weight.
pub fn sink_cases() -> Vec<Case> {
    vec![
        Case::new(2, 33, 47, 4, 2, 40, 40).sinks(&[0.5, -2.0, 3.0, 8.0]),
        Case::new(3, 33, 33, 2, 2, 40, 40)
            .causal()
            .q_lens(&[11, 33, 20])
            .kv_lens(&[33, 1, 20])
            .sinks(&[1.0, -30.0]),
        Case::new(1, 17, 29, 6, 3, 40, 24)
            .window(5, 2)
            .sinks(&[0.0, 1.0, 2.0, -1.0, -2.0, 4.0]),
        Case::new(2, 33, 47, 4, 2, 40, 40)
            .magnitude(3.0)
            .softcap(4.0)
            .alibi()
            .causal()
            .sinks(&[2.0, 0.0, -1.0, 5.0]),
    ]
}

/// Additive bias tensors (full, broadcast over batch, over heads, over both; strided; constant; with
/// `-inf` entries) and T5 relative buckets (bidirectional and causal), with masks, GQA, Dk != Dv,
/// softcap, ALiBi and windows. Small, and on the head dims (40/24, 40/40) and bucket count (16) of
/// the other cases: each kernel family compiles only its score-bias builds for them, and the
/// relative table's (the dQ kernels', per bucket count); masks and modifiers are runtime flags.
pub fn bias_cases() -> Vec<Case> {
    let bias = |batch, heads| BiasCase {
        batch,
        heads,
        learnable: true,
        masked_every: 0,
        strided: false,
    };
    vec![
        Case::new(2, 33, 47, 4, 2, 40, 24).bias(bias(2, 4)),
        Case::new(2, 33, 47, 4, 2, 40, 40)
            .causal()
            .kv_lens(&[47, 20])
            .bias(BiasCase {
                strided: true,
                ..bias(1, 4)
            }),
        Case::new(3, 17, 29, 2, 1, 40, 40)
            .softcap(3.0)
            .window(6, 3)
            .bias(BiasCase {
                masked_every: 5,
                ..bias(3, 1)
            }),
        Case::new(2, 33, 33, 4, 2, 40, 40)
            .magnitude(2.0)
            .alibi()
            .q_lens(&[33, 9])
            .bias(BiasCase {
                learnable: false,
                masked_every: 3,
                ..bias(1, 1)
            }),
        Case::new(2, 33, 47, 4, 2, 40, 40).relative(16, 40, true),
        Case::new(2, 40, 40, 4, 1, 40, 40)
            .causal()
            .kv_lens(&[40, 21])
            .softcap(5.0)
            .relative(16, 20, false),
    ]
}

/// Cosine scores and key-norm clipping, alone, together, and with masks, GQA, Dk != Dv, softcap,
/// windows and sinks. Inputs of magnitude 2 give key norms around 7 at Dk = 40, so a clip of 3
/// shortens most keys and leaves some.
pub fn qk_norm_cases() -> Vec<Case> {
    vec![
        // Learned per-head scales (one negative), with causal, GQA and key clipping.
        Case::new(2, 33, 47, 4, 2, 40, 40)
            .magnitude(2.0)
            .causal()
            .key_clip(0.8)
            .cosine_learned(&[12.0, 5.0, -3.0, 20.0]),
        Case::new(2, 33, 47, 4, 2, 40, 40)
            .magnitude(2.0)
            .cosine(12.0),
        Case::new(2, 33, 47, 4, 2, 40, 40)
            .magnitude(2.0)
            .key_clip(6.0),
        Case::new(2, 33, 33, 2, 2, 40, 40)
            .magnitude(2.0)
            .cosine(8.0)
            .key_clip(0.5)
            .causal()
            .q_lens(&[33, 12])
            .kv_lens(&[20, 33]),
        Case::new(1, 17, 29, 6, 3, 40, 24)
            .magnitude(2.0)
            .key_clip(5.0)
            .softcap(3.0)
            .window(6, 1),
        Case::new(2, 7, 33, 4, 2, 16, 128)
            .cosine(15.0)
            .sinks(&[0.5, 1.0, -1.0, 2.0]),
    ]
}

/// A loop budget that splits every [`split_loop_cases`] kernel into several dispatches.
pub const SMALL_LOOP_BUDGET: u32 = 1_000;
