//! Heat maps of what the digit-reversal model of `train_seq2seq` attends to, as SVG and PNG files with the
//! tokens on both axes: cross-attention of every head of the last decoder layer (the anti-diagonal
//! of reversal), decoder self-attention, attention rollout over the encoder, and
//! gradient-times-attention of the cross-attention. See `model::maps` for what each does and does not
//! show (seed 000: attention weights are not explanations).
//!
//! ```text
//! cargo run --release --example train_seq2seq            # trains and saves the model
//! cargo run --release --example attention_maps -- [--checkpoint PATH] [--digits 3141592] [--out DIR]
//!     [--cross-layer 1] [--self-layer 0] [--heads 0,1,2,3]
//! ```
//!
//! Without a checkpoint it trains the model itself first (300 steps, a few minutes on a CPU driver).

use std::fmt::Write;
use std::path::PathBuf;

use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::{Context, Error};
use wgpu_attention_transformer::model::{
    attention_rollout, AttentionSite, Batch, BatchShape, Transformer, TransformerConfig,
};
use wgpu_attention_transformer::training::{checkpoint, Trainer};

const PAD: u32 = 0;
const BOS: u32 = 1;
const EOS: u32 = 2;
const DIGIT0: u32 = 3;
const MAX_LEN: usize = 10;

/// The configuration `train_seq2seq` trains.
fn config() -> TransformerConfig {
    TransformerConfig::default()
        .vocab((DIGIT0 + 10) as usize)
        .d_model(64)
        .heads(4)
        .d_ff(128)
        .encoder_layers(2)
        .decoder_layers(2)
        .pre_ln(true)
        .pad_id(PAD)
}

/// Source digits, decoder input BOS + reversed digits, targets reversed digits + EOS.
fn batch_of(digits: &[Vec<u32>]) -> Batch {
    let mut b = Batch::default();
    for seq in digits {
        let rev: Vec<u32> = seq.iter().rev().copied().collect();
        let pad = |mut v: Vec<u32>, len: usize| {
            v.resize(len, PAD);
            v
        };
        b.src.extend(pad(seq.clone(), MAX_LEN));
        b.src_lens.push(seq.len() as u32);
        b.tgt_in
            .extend(pad([vec![BOS], rev.clone()].concat(), MAX_LEN + 1));
        b.tgt_out
            .extend(pad([rev, vec![EOS]].concat(), MAX_LEN + 1));
        b.tgt_lens.push(seq.len() as u32 + 1);
    }
    b
}

fn label(t: u32) -> String {
    match t {
        BOS => "<s>".into(),
        EOS => "</s>".into(),
        PAD => "_".into(),
        d => (d - DIGIT0).to_string(),
    }
}

/// One heat map: `values` `[rows, cols]`, colour scaled to the largest magnitude (diverging
/// blue-white-red when `signed`).
struct Map<'a> {
    title: String,
    rows: &'a [String],
    cols: &'a [String],
    values: Vec<f64>,
    signed: bool,
}

impl Map<'_> {
    /// The cell colour of `v`: white at 0, full colour at the map's largest magnitude.
    fn colour(&self, v: f64) -> [u8; 3] {
        let scale = self
            .values
            .iter()
            .fold(0.0f64, |a, v| a.max(v.abs()))
            .max(1e-12);
        let t = (v.abs() / scale).clamp(0.0, 1.0);
        let full = if self.signed && v < 0.0 {
            [33.0, 102.0, 172.0]
        } else if self.signed {
            [178.0, 24.0, 43.0]
        } else {
            [8.0, 48.0, 107.0]
        };
        full.map(|c: f64| (255.0 - t * (255.0 - c)).round() as u8)
    }
}

/// An RGB image with 8x8 bitmap text (font8x8), for the PNG versions of the maps.
struct Canvas {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

impl Canvas {
    fn new(width: usize, height: usize) -> Self {
        Self {
            width,
            height,
            rgb: vec![255; width * height * 3],
        }
    }

    /// Fills the rectangle, clipped to the image.
    fn rect(&mut self, x: usize, y: usize, w: usize, h: usize, colour: [u8; 3]) {
        for row in y.min(self.height)..(y + h).min(self.height) {
            for col in x.min(self.width)..(x + w).min(self.width) {
                let i = (row * self.width + col) * 3;
                self.rgb[i..i + 3].copy_from_slice(&colour);
            }
        }
    }

    /// Black ASCII text with its top-left corner at (x, y), each font pixel `scale` pixels wide.
    fn text(&mut self, x: usize, y: usize, text: &str, scale: usize) {
        for (n, c) in text.chars().enumerate() {
            let glyph = font8x8::legacy::BASIC_LEGACY[(c as usize).min(127)];
            for (gy, bits) in glyph.iter().enumerate() {
                for gx in 0..8 {
                    if bits >> gx & 1 == 1 {
                        let (px, py) = (x + (n * 8 + gx) * scale, y + gy * scale);
                        self.rect(px, py, scale, scale, [0, 0, 0]);
                    }
                }
            }
        }
    }

    /// Width in pixels of `text` at `scale`.
    fn text_width(text: &str, scale: usize) -> usize {
        text.chars().count() * 8 * scale
    }

    fn png(&self) -> Result<Vec<u8>, png::EncodingError> {
        let mut bytes = Vec::new();
        let mut encoder = png::Encoder::new(&mut bytes, self.width as u32, self.height as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&self.rgb)?;
        writer.finish()?;
        Ok(bytes)
    }
}

/// The PNG of [`svg`]'s layout: the maps side by side, token labels on both axes (without the
/// tooltips).
fn png(title: &str, maps: &[Map<'_>]) -> Result<Vec<u8>, png::EncodingError> {
    const CELL: usize = 34;
    const LABEL_SCALE: usize = 2;
    let label_width = |labels: &[String]| {
        labels
            .iter()
            .map(|l| Canvas::text_width(l, LABEL_SCALE))
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = maps
        .iter()
        .map(|m| {
            let grid = label_width(m.rows) + 6 + CELL * m.cols.len();
            grid.max(Canvas::text_width(&m.title, 1)) + 24
        })
        .collect();
    let top = 40 + 8 * LABEL_SCALE + 6;
    let rows = maps.iter().map(|m| m.rows.len()).max().unwrap_or(0);
    let width = (widths.iter().sum::<usize>() + 16).max(Canvas::text_width(title, 1) + 16);
    let mut canvas = Canvas::new(width, top + CELL * rows + 16);
    canvas.text(8, 8, title, 1);
    let mut x0 = 8;
    for (m, w) in maps.iter().zip(&widths) {
        let left = x0 + label_width(m.rows) + 6;
        canvas.text(left, 26, &m.title, 1);
        for (j, c) in m.cols.iter().enumerate() {
            // Labels wider than a cell ("<s>", "</s>") at half size, bottom-aligned.
            let scale = match Canvas::text_width(c, LABEL_SCALE) < CELL {
                true => LABEL_SCALE,
                false => 1,
            };
            let x = left + CELL * j + CELL / 2 - Canvas::text_width(c, scale) / 2;
            canvas.text(x, 40 + 8 * (LABEL_SCALE - scale), c, scale);
        }
        for (i, r) in m.rows.iter().enumerate() {
            let y = top + CELL * i;
            let label_x = left - 6 - Canvas::text_width(r, LABEL_SCALE);
            canvas.text(label_x, y + (CELL - 8 * LABEL_SCALE) / 2, r, LABEL_SCALE);
            for j in 0..m.cols.len() {
                let colour = m.colour(m.values[i * m.cols.len() + j]);
                // One white pixel between cells, like the SVG's stroke.
                canvas.rect(left + CELL * j, y, CELL - 1, CELL - 1, colour);
            }
        }
        x0 += w;
    }
    canvas.png()
}

/// An SVG with the maps side by side, each cell's value in its tooltip.
fn svg(title: &str, maps: &[Map<'_>]) -> String {
    let cell = 26.0;
    let margin = 44.0;
    let widths: Vec<f64> = maps
        .iter()
        .map(|m| margin + cell * m.cols.len() as f64 + 24.0)
        .collect();
    let height =
        40.0 + margin + cell * maps.iter().map(|m| m.rows.len()).max().unwrap_or(0) as f64 + 30.0;
    let width: f64 = widths.iter().sum::<f64>() + 10.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="8" y="16" font-size="13" font-weight="bold">{title}</text>"#
    );
    let mut x0 = 8.0;
    for (m, w) in maps.iter().zip(&widths) {
        let top = 40.0 + margin;
        let left = x0 + margin;
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="34" font-size="12">{}</text>"#,
            m.title
        );
        for (j, c) in m.cols.iter().enumerate() {
            let x = left + cell * (j as f64 + 0.5);
            let _ = writeln!(
                s,
                r#"<text x="{x}" y="{}" text-anchor="middle">{c}</text>"#,
                top - 6.0
            );
        }
        for (i, r) in m.rows.iter().enumerate() {
            let y = top + cell * i as f64;
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{r}</text>"#,
                left - 4.0,
                y + cell * 0.65
            );
            for j in 0..m.cols.len() {
                let v = m.values[i * m.cols.len() + j];
                let [red, green, blue] = m.colour(v);
                let _ = writeln!(
                    s,
                    r#"<rect x="{}" y="{y}" width="{cell}" height="{cell}" fill="rgb({red},{green},{blue})" stroke="white"><title>{r} -> {}: {v:.4}</title></rect>"#,
                    left + cell * j as f64,
                    m.cols[j]
                );
            }
        }
        x0 += w;
    }
    s.push_str("</svg>\n");
    s
}

/// Draws a trained reversal model's attention maps (cross- and self-attention of chosen decoder
/// layers and heads) as SVG and PNG heat maps with token labels.
#[derive(clap::Parser)]
#[command(name = "attention_maps")]
struct Cli {
    /// The checkpoint of `train_seq2seq` to draw.
    #[arg(long, default_value = "target/train_seq2seq.safetensors")]
    checkpoint: PathBuf,
    /// Directory of the pictures.
    #[arg(long, default_value = "target/attention_maps")]
    out: PathBuf,
    /// Decoder layer of the cross-attention maps (default: the last).
    #[arg(long)]
    cross_layer: Option<usize>,
    /// Decoder layer of the self-attention maps.
    #[arg(long, default_value_t = 0)]
    self_layer: usize,
    /// Comma list of heads to draw (default: all).
    #[arg(long)]
    heads: Option<String>,
    /// The digits to reverse (1 to 8 of them).
    #[arg(long, default_value = "3141592")]
    digits: String,
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cli = <Cli as clap::Parser>::parse();
    let (checkpoint_path, out) = (cli.checkpoint, cli.out);
    let c = config();
    let layer = |flag: &str, l: usize| -> Result<usize, String> {
        (l < c.decoder_layers).then_some(l).ok_or(format!(
            "{flag} {l}: the model has decoder layers 0 to {}",
            c.decoder_layers - 1
        ))
    };
    let cross_layer = layer(
        "--cross-layer",
        cli.cross_layer.unwrap_or(c.decoder_layers - 1),
    )?;
    let self_layer = layer("--self-layer", cli.self_layer)?;
    let heads: Vec<usize> = match &cli.heads {
        None => (0..c.heads).collect(),
        Some(value) => value
            .split(',')
            .map(|h| h.trim().parse().ok().filter(|&h| h < c.heads))
            .collect::<Option<Vec<usize>>>()
            .filter(|hs| !hs.is_empty())
            .ok_or(format!(
                "--heads {value}: a comma list of heads 0 to {}",
                c.heads - 1
            ))?,
    };
    let value = &cli.digits;
    if !((1..=MAX_LEN).contains(&value.len()) && value.bytes().all(|c| c.is_ascii_digit())) {
        return Err(format!("--digits {value}: give 1 to {MAX_LEN} digits").into());
    }
    let digits: Vec<u32> = value.bytes().map(|c| DIGIT0 + (c - b'0') as u32).collect();
    let ctx = Context::from_env()?;
    println!("adapter: {}", ctx.report());
    let shape = BatchShape {
        batch: 1,
        src_len: MAX_LEN,
        tgt_len: MAX_LEN + 1,
    };
    let model = Transformer::new(&ctx, config(), shape, 1)?;
    let mut trainer = Trainer::new(&ctx, model, AdamWConfig::default())?;
    if checkpoint_path.exists() {
        checkpoint::load(&ctx, &mut trainer, &checkpoint_path)?;
        println!("loaded {}", checkpoint_path.display());
    } else {
        println!(
            "no {}: training the reversal model here (300 steps)",
            checkpoint_path.display()
        );
        let train_shape = BatchShape { batch: 64, ..shape };
        let mut big = Trainer::new(
            &ctx,
            Transformer::new(&ctx, config(), train_shape, 1)?,
            AdamWConfig::default(),
        )?;
        let mut state = 0x9E3779B97F4A7C15u64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n) as u32
        };
        for step in 0..300 {
            let seqs: Vec<Vec<u32>> = (0..64)
                .map(|_| (0..3 + next(8)).map(|_| DIGIT0 + next(10)).collect())
                .collect();
            big.optimizer
                .set_lr(2e-3 * ((step + 1) as f32 / 100.0).min(1.0))?;
            big.step(&ctx, &batch_of(&seqs))?;
        }
        big.check_finite(&ctx)?;
        // The same parameters, into the batch-of-one model.
        for (dst, src) in trainer
            .model
            .params
            .values()
            .iter()
            .zip(big.model.params.values())
        {
            dst.write(&ctx, &src.to_vec(&ctx)?)?;
        }
    }

    // Teacher-forced forward and backward on the correct reversal, for the maps and the gradients.
    let batch = batch_of(std::slice::from_ref(&digits));
    trainer.forward(&ctx, &batch)?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    trainer.model.backward(&ctx, &mut encoder)?;
    ctx.queue().submit([encoder.finish()]);
    let loss = trainer.model.loss().to_vec(&ctx)?[0];
    let n = digits.len();
    let src: Vec<String> = digits.iter().map(|&t| label(t)).collect();
    let tgt: Vec<String> = batch.tgt_in[..n + 1].iter().map(|&t| label(t)).collect();
    println!("input {}  loss {loss:.4}", src.join(" "));
    std::fs::create_dir_all(&out).map_err(|e| Error::Device(format!("{}: {e}", out.display())))?;
    let all_heads = c.heads;
    // [1, H, Lq, Lk] padded to the model's lengths: crop to the sequence.
    let crop = |m: &[f32], h: usize, lq: usize, lk: usize, rows: usize, cols: usize| -> Vec<f64> {
        (0..rows)
            .flat_map(|i| (0..cols).map(move |j| m[(h * lq + i) * lk + j] as f64))
            .collect()
    };
    let (lq, lk) = (MAX_LEN + 1, MAX_LEN);
    // Each figure as SVG (vector, values in tooltips) and PNG.
    let write =
        |name: &str, title: &str, maps: &[Map<'_>]| -> Result<(), Box<dyn std::error::Error>> {
            let image = png(title, maps)?;
            for (extension, bytes) in [("svg", svg(title, maps).into_bytes()), ("png", image)] {
                let path = out.join(format!("{name}.{extension}"));
                std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
                println!("wrote {}", path.display());
            }
            Ok(())
        };

    let cross = trainer
        .model
        .attention_map(&ctx, AttentionSite::DecoderCross(cross_layer))?
        .to_vec(&ctx)?;
    let maps: Vec<Map> = heads
        .iter()
        .map(|&h| Map {
            title: format!("head {h}"),
            rows: &tgt,
            cols: &src,
            values: crop(&cross, h, lq, lk, n + 1, n),
            signed: false,
        })
        .collect();
    write(
        "cross_attention",
        &format!(
            "Decoder layer {cross_layer} cross-attention (rows: decoder input, columns: source)"
        ),
        &maps,
    )?;
    // How close the heads come to the anti-diagonal: the weight row i (predicting the digit at
    // source position n - 1 - i) puts on that position.
    for (&h, m) in heads.iter().zip(&maps) {
        let on: f64 = (0..n).map(|i| m.values[i * n + (n - 1 - i)]).sum::<f64>() / n as f64;
        println!("cross-attention head {h}: mean weight on the reversed position {on:.3}");
    }

    let dec_self = trainer
        .model
        .attention_map(&ctx, AttentionSite::DecoderSelf(self_layer))?
        .to_vec(&ctx)?;
    let maps: Vec<Map> = heads
        .iter()
        .map(|&h| Map {
            title: format!("head {h}"),
            rows: &tgt,
            cols: &tgt,
            values: crop(&dec_self, h, lq, lq, n + 1, n + 1),
            signed: false,
        })
        .collect();
    write(
        "decoder_self_attention",
        &format!("Decoder layer {self_layer} self-attention (causal)"),
        &maps,
    )?;

    let layers: Vec<Vec<f32>> = (0..config().encoder_layers)
        .map(|l| {
            trainer
                .model
                .attention_map(&ctx, AttentionSite::EncoderSelf(l))?
                .to_vec(&ctx)
        })
        .collect::<Result<_, _>>()?;
    let rollout = attention_rollout(&layers, [1, all_heads, lk])?;
    let rollout: Vec<f64> = (0..n)
        .flat_map(|i| (0..n).map(move |j| (i, j)))
        .map(|(i, j)| rollout[i * lk + j])
        .collect();
    let grad = trainer
        .model
        .gradient_times_attention(&ctx, AttentionSite::DecoderCross(cross_layer))?;
    let grad_mean: Vec<f64> = (0..(n + 1) * n)
        .map(|x| {
            heads
                .iter()
                .map(|&h| grad[(h * lq + x / n) * lk + x % n] as f64)
                .sum::<f64>()
                / heads.len() as f64
        })
        .collect();
    write(
        "rollout_and_gradient",
        &format!("Encoder attention rollout, and gradient x attention of decoder layer {cross_layer} cross-attention (mean over the drawn heads)"),
        &[
                Map {
                    title: "rollout over 2 encoder layers".into(),
                    rows: &src,
                    cols: &src,
                    values: rollout,
                    signed: false,
                },
                Map {
                    title: "P * dL/dP (red +, blue -)".into(),
                    rows: &tgt,
                    cols: &src,
                    values: grad_mean,
                    signed: true,
                },
            ],
    )?;
    Ok(())
}

fn main() {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    if let Err(e) = run() {
        eprintln!("attention_maps: {e}");
        std::process::exit(1);
    }
}
