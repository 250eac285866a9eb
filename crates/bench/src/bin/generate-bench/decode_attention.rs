//! Decode attention alone: one new query per sequence against a full cache, its achieved bandwidth
//! (bytes of K and V read per second) against a copy of as many bytes measured in the same run,
//! over a grid of batch sizes, context lengths, head layouts (GQA), head dims, cache formats and
//! layouts (contiguous or paged).

use std::collections::HashMap;

use wgpu_attention::bench::copy::{copy_bandwidth, CopyBandwidth};
use wgpu_attention::bench::{measure, Timer};
use wgpu_attention::kernels::kv_cache::{BlockTable, KvFormat};
use wgpu_attention::{
    attention_decode_f16_into, attention_decode_int8_into, attention_decode_into,
    attention_decode_paged_into, AttentionOptions, AttentionShape, Context, DecodePlan, Error,
    ForwardViews, GpuTensor, GpuTensorF16, GpuTensorQ8, HalfCache, QuantizedCache, SeqLens,
};

/// The copy that stands for the memory's bandwidth moves at most this many bytes: far past any
/// cache, and within every adapter's buffer limits.
const MAX_COPY_BYTES: u64 = 1 << 30;

/// Records one decode attention call.
type Record<'a> = dyn FnMut(&mut wgpu::CommandEncoder) -> Result<(), Error> + 'a;

/// One point of the grid.
#[derive(Clone, Copy, Debug)]
pub struct DecodeCase {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub context: usize,
    pub format: KvFormat,
    /// Rows per block of a paged cache; `None` for a contiguous one.
    pub page: Option<usize>,
}

impl DecodeCase {
    /// "f32", "int8 paged 16", ...
    pub fn cache(&self) -> String {
        match self.page {
            None => self.format.name().to_string(),
            Some(page) => format!("{} paged {page}", self.format.name()),
        }
    }

    /// Bytes of K and V one step reads: every cached key and value of every sequence and KV head
    /// (an int8 row: D bytes and a 4-byte scale; an f16 row 2 D bytes).
    pub fn cache_bytes(&self) -> u64 {
        let row = match self.format {
            KvFormat::Int8 => self.head_dim + 4,
            KvFormat::F16 => 2 * self.head_dim,
            _ => 4 * self.head_dim,
        };
        2 * (self.batch * self.context * self.kv_heads * row) as u64
    }
}

/// What one case measured; `None` figures where it was skipped.
pub struct DecodeFigures {
    pub case: DecodeCase,
    pub ms: f64,
    pub gb_s: f64,
    pub copy: CopyBandwidth,
    /// Keys per tile, rows per workgroup and key splits the kernel ran with.
    pub plan: DecodePlan,
}

/// Runs every case of the grid (batch, context, (H, Hkv), D, format, layout), skipping those whose
/// caches exceed the adapter's binding or buffer limits (listed in the returned strings). The copy
/// bandwidth is measured once per byte count.
pub fn run_grid(
    ctx: &Context,
    timer: &Timer,
    reps: usize,
    cases: &[DecodeCase],
) -> Result<(Vec<DecodeFigures>, Vec<String>), Error> {
    let mut copies: HashMap<u64, CopyBandwidth> = HashMap::new();
    let (mut figures, mut skipped) = (Vec::new(), Vec::new());
    let limits = ctx.limits();
    let limit = limits
        .max_storage_buffer_binding_size
        .min(limits.max_buffer_size);
    for case in cases {
        // One of K or V: half the bytes.
        if case.cache_bytes() / 2 > limit {
            skipped.push(format!(
                "batch {} H {}/{} D {} {} context {}: a {}-byte cache passes the adapter's {limit}-byte binding limit",
                case.batch, case.heads, case.kv_heads, case.head_dim, case.cache(), case.context, case.cache_bytes() / 2
            ));
            continue;
        }
        let (ms, plan) = decode(ctx, timer, reps, case)?;
        let copy_bytes = case.cache_bytes().min(MAX_COPY_BYTES) / 16 * 16;
        let copy = match copies.get(&copy_bytes) {
            Some(c) => *c,
            None => {
                let c = copy_bandwidth(ctx, timer, reps, copy_bytes)?;
                copies.insert(copy_bytes, c);
                c
            }
        };
        figures.push(DecodeFigures {
            case: *case,
            ms,
            gb_s: case.cache_bytes() as f64 / (ms * 1e6),
            copy,
            plan,
        });
    }
    Ok((figures, skipped))
}

/// One case's median milliseconds and plan. The cache is zeros (what is read, not its values,
/// sets the time); a paged cache's blocks are interleaved across the sequences (block i of
/// sequence b is pool block i * batch + b), as a pool serving several requests hands them out.
fn decode(
    ctx: &Context,
    timer: &Timer,
    reps: usize,
    case: &DecodeCase,
) -> Result<(f64, DecodePlan), Error> {
    let &DecodeCase {
        batch,
        heads: h,
        kv_heads: hkv,
        head_dim: d,
        context: len,
        format,
        page,
    } = case;
    let q = GpuTensor::zeros(ctx, &[batch, 1, h, d])?;
    let out = GpuTensor::zeros(ctx, &[batch, 1, h, d])?;
    let lse = GpuTensor::zeros(ctx, &[batch, h, 1])?;
    let lens = SeqLens::new(ctx, Some(&vec![1; batch]), Some(&vec![len as u32; batch]))?;
    let opts = AttentionOptions::new().causal(true).seq_lens(&lens);
    let (qv, ov) = (q.heads()?, out.heads()?);
    // The cache's rows: [B, len] contiguous, or a pool of whole blocks.
    let table = match page {
        None => None,
        Some(page) => {
            let per_seq = len.div_ceil(page);
            let mut table = BlockTable::new(ctx, batch, per_seq, page, batch * per_seq)?;
            let ids: Vec<u32> = (0..batch)
                .flat_map(|b| (0..per_seq).map(move |i| (i * batch + b) as u32))
                .collect();
            table.write(ctx, &ids)?;
            Some(table)
        }
    };
    let shape = AttentionShape {
        batch,
        q_seq: 1,
        kv_seq: len,
        heads: h,
        kv_heads: hkv,
        head_dim_qk: d,
        head_dim_v: d,
    };
    let plan = match format {
        KvFormat::Int8 => DecodePlan::new_int8(ctx, &shape, len)?,
        KvFormat::F32 | KvFormat::F16 => DecodePlan::new(ctx, &shape, len)?,
        other => {
            let message = format!("{} caches are not benchmarked", other.name());
            return Err(Error::shape("format", message));
        }
    };
    // A contiguous cache [B, len, Hkv, D]; a pool [pool rows, Hkv, D] (f32 views [1, pool rows,
    // Hkv, D]).
    let rows = match &table {
        None => vec![batch, len, hkv, d],
        Some(t) => vec![t.pool_blocks() * t.page(), hkv, d],
    };
    let mut record: Box<Record> = match format {
        KvFormat::Int8 => {
            let (k, v) = (
                GpuTensorQ8::zeros(ctx, &rows)?,
                GpuTensorQ8::zeros(ctx, &rows)?,
            );
            Box::new(move |encoder| {
                let cache = QuantizedCache {
                    k: &k,
                    v: &v,
                    table: table.as_ref(),
                };
                attention_decode_int8_into(ctx, encoder, &qv, cache, &ov, &lse, &opts)
            })
        }
        KvFormat::F16 => {
            let (k, v) = (
                GpuTensorF16::zeros(ctx, &rows)?,
                GpuTensorF16::zeros(ctx, &rows)?,
            );
            Box::new(move |encoder| {
                let cache = HalfCache {
                    k: &k,
                    v: &v,
                    table: table.as_ref(),
                };
                attention_decode_f16_into(ctx, encoder, &qv, cache, &ov, &lse, &opts)
            })
        }
        _ => {
            let rows = match table {
                None => rows,
                Some(_) => [&[1], &rows[..]].concat(),
            };
            let (k, v) = (GpuTensor::zeros(ctx, &rows)?, GpuTensor::zeros(ctx, &rows)?);
            let (kv, vv) = (k.heads()?, v.heads()?);
            Box::new(move |encoder| {
                let views = ForwardViews {
                    q: &qv,
                    k: &kv,
                    v: &vv,
                    out: &ov,
                    lse: &lse,
                };
                match &table {
                    None => attention_decode_into(ctx, encoder, &views, &opts),
                    Some(table) => attention_decode_paged_into(ctx, encoder, &views, table, &opts),
                }
            })
        }
    };
    let samples = measure(ctx, timer, reps, || {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        record(&mut encoder)?;
        ctx.queue().submit([encoder.finish()]);
        Ok(())
    })?;
    Ok((samples.median(), plan))
}

/// Parses "H/Hkv" (query heads over key-value heads, H a multiple of Hkv).
pub fn parse_heads(text: &str) -> Result<(usize, usize), String> {
    let parsed = text
        .split_once('/')
        .and_then(|(h, hkv)| Some((h.trim().parse().ok()?, hkv.trim().parse().ok()?)));
    match parsed {
        Some((h, hkv)) if hkv > 0 && h > 0 && h % hkv == 0 => Ok((h, hkv)),
        _ => Err(format!(
            "--attention-heads {text:?}: expected H/Hkv with H a positive multiple of Hkv (e.g. 32/8)"
        )),
    }
}

/// The table of figures, then the skipped cases.
pub fn print(figures: &[DecodeFigures], skipped: &[String], clock: &str) {
    if figures.is_empty() && skipped.is_empty() {
        return;
    }
    println!(
        "\ndecode attention, one query per sequence, full caches ({clock}); copies of the same \
         bytes (at most {} MiB): the copy kernel's and a buffer-to-buffer copy's, the share of the \
         better one:\n",
        MAX_COPY_BYTES >> 20
    );
    println!("| batch | H / Hkv | D | cache | context | ms | K+V read GB/s | copy kernel GB/s | buffer copy GB/s | share of copy | keys per tile, rows, splits |\n|---|---|---|---|---|---|---|---|---|---|---|");
    for f in figures {
        let c = &f.case;
        println!(
            "| {} | {} / {} | {} | {} | {} | {:.3} | {:.1} | {:.1} | {:.1} | {:.0}% | {}, {}, {} |",
            c.batch,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.cache(),
            c.context,
            f.ms,
            f.gb_s,
            f.copy.kernel_gb_s,
            f.copy.buffer_copy_gb_s,
            100.0 * f.gb_s / f.copy.best(),
            f.plan.tile_keys,
            f.plan.rows,
            f.plan.splits
        );
    }
    for s in skipped {
        println!("skipped: {s}");
    }
}

/// The figures as JSON rows.
pub fn json(figures: &[DecodeFigures]) -> Vec<serde_json::Value> {
    figures
        .iter()
        .map(|f| {
            let c = &f.case;
            serde_json::json!({
                "batch": c.batch, "heads": c.heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim,
                "format": c.format.name(), "page": c.page, "cache_len": c.context,
                "cache_bytes": c.cache_bytes(), "ms": f.ms, "gb_s": f.gb_s,
                "copy_kernel_gb_s": f.copy.kernel_gb_s,
                "buffer_copy_gb_s": f.copy.buffer_copy_gb_s,
                "share_of_copy": f.gb_s / f.copy.best(),
                "tile_keys": f.plan.tile_keys, "rows": f.plan.rows, "splits": f.plan.splits,
            })
        })
        .collect()
}
