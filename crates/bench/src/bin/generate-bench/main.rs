//! Inference throughput of a decoder-only language model on one adapter: prefill and decode tokens/s
//! of cached generation ([`Generator`]) per batch size, the same generation by re-running the full
//! forward for every new token (the baseline the cache replaces), and the decode attention kernel's
//! achieved bandwidth against copies of the same bytes; with `--page`, `--f16` and `--int8`,
//! paged, f16 and int8 caches beside the contiguous f32 one.
//!
//! ```text
//! cargo run --release -p wgpu-attention-bench --bin generate-bench -- [--d-model 512 --layers 8 --heads 8 --context 2048
//!     --prompt 512 --new-tokens 128 --batches 1,8 --rerun --attention-lengths 1024,2048]
//! cargo run --release -p wgpu-attention-bench --bin generate-bench -- --model DIR [--context ...]   # a published model
//! ```

mod decode_attention;

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use decode_attention::DecodeCase;
use wgpu_attention::bench::{bench_options, measure, Timer};
use wgpu_attention::kernels::kv_cache::BlockTable;
use wgpu_attention::kernels::sampling::Sampling;
use wgpu_attention::{
    attention_decode_f16_into, attention_decode_int8_into, attention_decode_into,
    attention_decode_paged_into, attention_forward_into, attention_forward_plan, parse_backends,
    AttentionOptions, AttentionShape, Context, Error, ForwardViews, GpuTensor, GpuTensorF16,
    GpuTensorQ8, HalfCache, HeadsView, QuantizedCache, SeqLens,
};
use wgpu_attention_serve::{
    CacheConfig, CacheLayout, Draft, GenerateOptions, Generator, GeneratorShape, KvFormat,
};
use wgpu_attention_transformer::model::pretrained::Pretrained;
use wgpu_attention_transformer::model::{Batch, BatchShape, Transformer, TransformerConfig};

#[derive(Parser, Debug)]
#[command(version, about = "Cached generation throughput on any wgpu adapter")]
struct Cli {
    /// Back end: vulkan, gl, metal, dx12 (default: WGPU_BACKEND, else all)
    #[arg(long)]
    backend: Option<String>,
    /// Case-insensitive substring of the adapter name (default: WGPU_ADAPTER_NAME)
    #[arg(long)]
    adapter: Option<String>,
    #[arg(long, default_value_t = 512)]
    d_model: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Feed-forward width (default 4 * d_model)
    #[arg(long)]
    d_ff: Option<usize>,
    #[arg(long, default_value_t = 8)]
    layers: usize,
    #[arg(long, default_value_t = 1000)]
    vocab: usize,
    /// Cache capacity per sequence (prompt + new tokens must fit)
    #[arg(long, default_value_t = 2048)]
    context: usize,
    /// Prompt tokens per sequence
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// Prompt tokens per sequence in one prefill pass
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// Tokens generated per sequence (greedy)
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Batch sizes to run
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batches: Vec<usize>,
    /// Also generate by re-running the full forward for every new token (the first batch size)
    #[arg(long)]
    rerun: bool,
    /// Decode attention microbenchmark: cache lengths (one new query per sequence, every batch
    /// size, head layout and head dim below; with --f16 and --int8 those caches too, with --page
    /// paged ones);
    /// 0 to skip
    #[arg(long, value_delimiter = ',', default_value = "1024,2048")]
    attention_lengths: Vec<usize>,
    /// Decode attention microbenchmark: query heads / key-value heads, e.g. 32/8,8/2 (default:
    /// heads / (heads / 4))
    #[arg(long, value_delimiter = ',')]
    attention_heads: Vec<String>,
    /// Decode attention microbenchmark: head dims
    #[arg(long, value_delimiter = ',', default_value = "64")]
    attention_head_dims: Vec<usize>,
    /// Run only the decode attention microbenchmark (no model, generation or prefill attention)
    #[arg(long)]
    decode_attention: bool,
    /// Prefill-shaped attention: prompt lengths P (H = heads, Hkv = heads / 4, D = 64, P new
    /// causal queries per sequence over their own P keys, every batch size), run by
    /// `attention_decode_into` (what prefill calls: the decode kernel below PREFILL_FORWARD_ROWS
    /// new rows, the fused forward from there) and by the fused forward directly, on the same
    /// tensors, with --page through a paged cache (`attention_decode_paged_into`), and with --f16
    /// and --int8 over caches of those formats (contiguous, and paged with --page); 0 to skip
    #[arg(long, value_delimiter = ',', default_value = "256")]
    prefill_attention: Vec<usize>,
    /// Additive (Bahdanau) self-attention scores with this score dim Da instead of dot products (and
    /// sinusoidal positions instead of rotary ones)
    #[arg(long)]
    additive: Option<usize>,
    /// Print one decoding step's GPU time per compute pass (timestamps)
    #[arg(long)]
    profile: bool,
    /// Timed runs of each microbenchmark measurement (after warm-up)
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Write the figures as JSON
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Also generate through a paged cache of blocks of this many tokens (the pool sized to the
    /// run's tokens), beside the contiguous cache
    #[arg(long)]
    page: Option<usize>,
    /// Also generate from int8 key/value caches (each layout measured), and time decode attention
    /// over an int8 cache beside the f32 one
    #[arg(long)]
    int8: bool,
    /// Also generate from f16 key/value caches (each layout measured), and time decode attention
    /// over an f16 cache beside the f32 one
    #[arg(long)]
    f16: bool,
    /// Also generate by speculative decoding (greedy, contiguous f32 cache) with chains of this
    /// many guesses verified per pass: guesses that are the plain run's tokens (every one kept: the
    /// upper bound) and guesses that never match (none kept: verification's overhead)
    #[arg(long)]
    speculate: Option<usize>,
    /// A Hugging Face model directory (config.json and safetensors weights) to measure instead of a
    /// randomly initialised model (--d-model, --layers, --heads, --d-ff, --vocab, --additive are
    /// then ignored)
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// Build every pipeline of prefill, decoding and sampling at each batch size (and with a paged
    /// cache, with --page) and exit without running them (with WGPU_ATTENTION_DUMP_PIPELINES=DIR, this writes the decoding kernel set)
    #[arg(long)]
    compile_only: bool,
}

fn model(ctx: &Context, cli: &Cli) -> Result<Transformer, Error> {
    // The generator keeps its own buffers; the model's training shape only sizes unused activations.
    let shape = BatchShape {
        batch: 1,
        src_len: 1,
        tgt_len: 1,
    };
    if let Some(dir) = &cli.model {
        return Pretrained::open(dir)?.model(ctx, shape);
    }
    let config = TransformerConfig::default()
        .vocab(cli.vocab)
        .d_model(cli.d_model)
        .heads(cli.heads)
        .d_ff(cli.d_ff.unwrap_or(4 * cli.d_model))
        .encoder_layers(0)
        .decoder_layers(cli.layers)
        .pre_ln(true)
        // Additive scores take no rotary positions (the sinusoidal ones instead).
        .rope_base(cli.additive.is_none().then_some(10000.0))
        .additive_attention(cli.additive);
    Transformer::new(ctx, config, shape, 1)
}

/// Deterministic prompt ids in 1..vocab.
fn prompts(cli: &Cli, vocab: usize, batch: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..cli.prompt)
                .map(|i| 1 + ((i * 7919 + b * 104729) % (vocab - 1)) as u32)
                .collect()
        })
        .collect()
}

struct GenerationFigures {
    batch: usize,
    /// "contiguous" or "paged N", then "f32", "f16" or "int8".
    layout: String,
    /// Bytes of the key/value cache.
    cache_bytes: u64,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    decode_ms_per_step: f64,
    /// Wall-clock seconds of the prefill (with the first sampled token) and of the decoding steps.
    seconds: f64,
    generated: Vec<Vec<u32>>,
}

/// The cache layout of a run at `batch` with `page`-token blocks (`None`: contiguous): a paged pool
/// holds what the run caches (every sequence's prompt and new tokens), not batch x context. The
/// run and `--compile-only` take it from here, so both build the same pipelines.
fn cache_layout(cli: &Cli, batch: usize, page: Option<usize>) -> CacheLayout {
    match page {
        Some(page) => CacheLayout::Paged {
            page,
            pool_blocks: batch * (cli.prompt + cli.new_tokens).div_ceil(page),
        },
        None => CacheLayout::Contiguous,
    }
}

fn cached(
    ctx: &Context,
    cli: &Cli,
    model: &Transformer,
    batch: usize,
    page: Option<usize>,
    format: KvFormat,
) -> Result<GenerationFigures, Error> {
    let shape = GeneratorShape {
        batch,
        capacity: cli.context,
        prefill_chunk: cli.prefill_chunk,
        src_len: 0,
    };
    let cache = CacheConfig::new(cache_layout(cli, batch, page)).with_format(format);
    let mut generator = Generator::with_layout(ctx, model, shape, cache)?;
    let cache_bytes = match (generator.cache(), generator.paged_cache()) {
        (Some(c), _) => c.bytes(),
        (_, Some(c)) => c.bytes(),
        _ => 0,
    };
    let options = GenerateOptions::default()
        .max_new_tokens(cli.new_tokens)
        .sampling(Sampling::greedy())
        .stop(None);
    let prompts = prompts(cli, model.config().vocab, batch);
    // A first run compiles every pipeline; the second is measured.
    generator.generate(ctx, &prompts, None, &options)?;
    let out = generator.generate(ctx, &prompts, None, &options)?;
    if cli.profile {
        ctx.start_profiling()?;
        generator.prefill(ctx, &prompts, None)?;
        print_profile(
            &format!("the prefill at batch {batch}"),
            ctx.finish_profiling()?,
        );
        ctx.start_profiling()?;
        generator.step(ctx, &vec![Some(1); batch])?;
        print_profile(
            &format!("one decoding step at batch {batch}"),
            ctx.finish_profiling()?,
        );
    }
    Ok(GenerationFigures {
        batch,
        layout: format!(
            "{} {}",
            page.map_or("contiguous".into(), |p| format!("paged {p}")),
            format.name()
        ),
        cache_bytes,
        prefill_tokens_per_s: out.prefill_tokens as f64 / out.prefill_seconds,
        decode_tokens_per_s: out.decode_tokens as f64 / out.decode_seconds,
        decode_ms_per_step: out.decode_seconds * 1e3 / out.decode_steps.max(1) as f64,
        seconds: out.prefill_seconds + out.decode_seconds,
        generated: out.tokens,
    })
}

/// GPU time per compute pass, summed by label, the longest first.
fn print_profile(what: &str, passes: Vec<(&'static str, f64)>) {
    let total: f64 = passes.iter().map(|p| p.1).sum();
    let count = passes.len();
    let mut by_label: Vec<(&str, f64, usize)> = Vec::new();
    for (label, ms) in passes {
        match by_label.iter_mut().find(|(l, _, _)| *l == label) {
            Some(entry) => {
                entry.1 += ms;
                entry.2 += 1;
            }
            None => by_label.push((label, ms, 1)),
        }
    }
    by_label.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("\n{what}: {count} passes, {total:.2} ms of GPU time; by kernel, the longest:");
    for (label, ms, n) in by_label.iter().take(8) {
        println!("  {label:<28} {ms:9.3} ms in {n} passes");
    }
}

/// Greedy generation by re-running the whole forward over the prompt and the tokens so far for
/// every new token, reading back the logits: tokens/s, and the tokens (to check against the cache).
fn rerun(
    ctx: &Context,
    cli: &Cli,
    base: &Transformer,
    batch: usize,
) -> Result<(f64, Vec<Vec<u32>>), Error> {
    let total = cli.prompt + cli.new_tokens;
    let shape = BatchShape {
        batch,
        src_len: 1,
        tgt_len: total,
    };
    let mut model = Transformer::new(ctx, *base.config(), shape, 1)?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    for (dst, src) in model.params.values().iter().zip(base.params.values()) {
        dst.copy_from_into(&mut encoder, src)?;
    }
    ctx.queue().submit([encoder.finish()]);
    let vocab = base.config().vocab;
    let mut sequences = prompts(cli, vocab, batch);
    let start = Instant::now();
    for _ in 0..cli.new_tokens {
        let len = sequences[0].len();
        let mut tgt_in = vec![0u32; batch * total];
        for (b, s) in sequences.iter().enumerate() {
            tgt_in[b * total..][..s.len()].copy_from_slice(s);
        }
        let batch_data = Batch {
            src: Vec::new(),
            src_lens: Vec::new(),
            tgt_in,
            tgt_out: vec![0; batch * total],
            tgt_lens: vec![len as u32; batch],
        };
        model.set_batch(ctx, &batch_data)?;
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        model.forward(ctx, &mut encoder)?;
        ctx.queue().submit([encoder.finish()]);
        let logits = model.logits().to_vec(ctx)?;
        for (b, s) in sequences.iter_mut().enumerate() {
            let row = &logits[(b * total + len - 1) * vocab..][..vocab];
            let next = (0..vocab)
                .max_by(|&x, &y| row[x].total_cmp(&row[y]).then(y.cmp(&x)))
                .unwrap_or(0);
            s.push(next as u32);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let generated = sequences
        .into_iter()
        .map(|s| s[cli.prompt..].to_vec())
        .collect();
    Ok(((batch * cli.new_tokens) as f64 / seconds, generated))
}

struct PrefillFigures {
    batch: usize,
    prompt: usize,
    decode_kernel_ms: f64,
    forward_kernel_ms: f64,
    forward_plan: String,
    /// With `--page`: the same prefill through a paged cache (`attention_decode_paged_into`).
    paged_ms: Option<f64>,
    /// With `--f16` and `--int8`: the same prefill over caches of those formats, contiguous and
    /// (with `--page`) paged: format, paged, median ms.
    stored: Vec<(KvFormat, bool, f64)>,
}

/// Prefill-shaped attention: `prompt` causal queries per sequence over their own keys, through
/// `attention_decode_into` (as a prefill over an empty cache runs) and the fused forward, same
/// tensors; the two outputs are checked to agree.
fn prefill_attention(
    ctx: &Context,
    cli: &Cli,
    timer: &Timer,
    batch: usize,
    prompt: usize,
) -> Result<PrefillFigures, Error> {
    let (h, hkv, d) = (cli.heads, (cli.heads / 4).max(1), 64);
    let values = |n: usize, salt: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + salt * 104729) % 2001) as f32 / 1000.0) - 1.0)
            .collect()
    };
    let q = GpuTensor::from_slice(
        ctx,
        &values(batch * prompt * h * d, 1),
        &[batch, prompt, h, d],
    )?;
    let k = GpuTensor::from_slice(
        ctx,
        &values(batch * prompt * hkv * d, 2),
        &[batch, prompt, hkv, d],
    )?;
    let v = GpuTensor::from_slice(
        ctx,
        &values(batch * prompt * hkv * d, 3),
        &[batch, prompt, hkv, d],
    )?;
    let outputs = || -> Result<(GpuTensor, GpuTensor), Error> {
        Ok((
            GpuTensor::zeros(ctx, &[batch, prompt, h, d])?,
            GpuTensor::zeros(ctx, &[batch, h, prompt])?,
        ))
    };
    let (decode_out, decode_lse) = outputs()?;
    let (forward_out, forward_lse) = outputs()?;
    let full = vec![prompt as u32; batch];
    let lens = SeqLens::new(ctx, Some(&full), Some(&full))?;
    let opts = AttentionOptions::new().causal(true).seq_lens(&lens);
    let (qv, kv, vv) = (q.heads()?, k.heads()?, v.heads()?);
    let decode = measure(ctx, timer, cli.reps, || {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let out = decode_out.heads()?;
        attention_decode_into(
            ctx,
            &mut encoder,
            &ForwardViews {
                q: &qv,
                k: &kv,
                v: &vv,
                out: &out,
                lse: &decode_lse,
            },
            &opts,
        )?;
        ctx.queue().submit([encoder.finish()]);
        Ok(())
    })?;
    let forward = measure(ctx, timer, cli.reps, || {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let out = forward_out.heads()?;
        attention_forward_into(
            ctx,
            &mut encoder,
            &ForwardViews {
                q: &qv,
                k: &kv,
                v: &vv,
                out: &out,
                lse: &forward_lse,
            },
            &opts,
        )?;
        ctx.queue().submit([encoder.finish()]);
        Ok(())
    })?;
    let kv_data = [
        values(batch * prompt * hkv * d, 2),
        values(batch * prompt * hkv * d, 3),
    ];
    let kv_data = [kv_data[0].as_slice(), kv_data[1].as_slice()];
    let paged = match cli.page {
        None => None,
        Some(page) => Some(cached_prefill(
            ctx,
            (timer, cli.reps),
            &qv,
            kv_data,
            (KvFormat::F32, Some(page)),
            &opts,
        )?),
    };
    // The other formats asked for, contiguous and paged: each output within its rounding of the
    // f32 forward's (int8 moves each value by at most max |row| / 254; these rows are within 1).
    let mut stored = Vec::new();
    let mut stored_outputs = Vec::new();
    for format in cli.formats().into_iter().filter(|&f| f != KvFormat::F32) {
        for page in [None].into_iter().chain(cli.page.map(Some)) {
            let (ms, out) =
                cached_prefill(ctx, (timer, cli.reps), &qv, kv_data, (format, page), &opts)?;
            let what = format!(
                "{} {}",
                format.name(),
                if page.is_some() {
                    "paged"
                } else {
                    "contiguous"
                }
            );
            stored.push((format, page.is_some(), ms));
            stored_outputs.push((what, out, 2e-2));
        }
    }
    let paged_ms = paged.as_ref().map(|(ms, _)| *ms);
    let (a, b) = (decode_out.to_vec(ctx)?, forward_out.to_vec(ctx)?);
    let outputs = [("decode".to_string(), a, 1e-4)]
        .into_iter()
        .chain(paged.map(|(_, out)| ("paged".to_string(), out, 1e-4)))
        .chain(stored_outputs);
    for (what, out, bound) in outputs {
        let worst = out
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        // A NaN difference fails too: it is not below the bound.
        if !out.iter().zip(&b).all(|(x, y)| (x - y).abs() <= bound) {
            eprintln!("generate-bench: VALIDATION FAILED: prefill attention, {what} and forward kernels differ by {worst}");
            std::process::exit(1);
        }
    }
    Ok(PrefillFigures {
        batch,
        prompt,
        decode_kernel_ms: decode.median(),
        forward_kernel_ms: forward.median(),
        forward_plan: attention_forward_plan(ctx, &AttentionShape::of(&qv, &kv, &vv)?)?.to_string(),
        paged_ms,
        stored,
    })
}

/// The prefill of `q` over keys and values `kv` (`[B, P, Hkv, D]` each, host data) held in a cache
/// of `format` (f32, f16 or int8), contiguous or (`page`: `Some(rows)`) paged, its blocks
/// interleaved across the sequences as a pool serving several requests hands them out (block i of
/// sequence b is pool block i * B + b): its median ms and output.
fn cached_prefill(
    ctx: &Context,
    (timer, reps): (&Timer, usize),
    q: &HeadsView,
    kv: [&[f32]; 2],
    (format, page): (KvFormat, Option<usize>),
    opts: &AttentionOptions<'_>,
) -> Result<(f64, Vec<f32>), Error> {
    let [batch, prompt, heads, d] = q.shape();
    let hkv = kv[0].len() / (batch * prompt * d);
    let row = hkv * d;
    // The cache's rows and shape, and the table: contiguous `[B, P, Hkv, D]`, or the pool.
    let (table, rows, shape) = match page {
        None => (None, kv.map(<[f32]>::to_vec), vec![batch, prompt, hkv, d]),
        Some(page) => {
            let per_seq = prompt.div_ceil(page);
            let pool_rows = batch * per_seq * page;
            let mut table = BlockTable::new(ctx, batch, per_seq, page, batch * per_seq)?;
            let ids: Vec<u32> = (0..batch)
                .flat_map(|b| (0..per_seq).map(move |i| (i * batch + b) as u32))
                .collect();
            table.write(ctx, &ids)?;
            let pool = |data: &[f32]| {
                let mut rows = vec![0.0; pool_rows * row];
                for b in 0..batch {
                    for j in 0..prompt {
                        let at = (ids[b * per_seq + j / page] as usize * page + j % page) * row;
                        rows[at..at + row].copy_from_slice(&data[(b * prompt + j) * row..][..row]);
                    }
                }
                rows
            };
            (Some(table), kv.map(pool), vec![pool_rows, hkv, d])
        }
    };
    let out = GpuTensor::zeros(ctx, &[batch, prompt, heads, d])?;
    let lse = GpuTensor::zeros(ctx, &[batch, heads, prompt])?;
    let ov = out.heads()?;
    let samples = match format {
        KvFormat::Int8 => {
            let [k, v] = [0, 1].map(|i| GpuTensorQ8::from_f32(ctx, &rows[i], &shape));
            let (k, v) = (k?, v?);
            measure(ctx, timer, reps, || {
                let mut encoder = ctx.device().create_command_encoder(&Default::default());
                let cache = QuantizedCache {
                    k: &k,
                    v: &v,
                    table: table.as_ref(),
                };
                attention_decode_int8_into(ctx, &mut encoder, q, cache, &ov, &lse, opts)?;
                ctx.queue().submit([encoder.finish()]);
                Ok(())
            })?
        }
        KvFormat::F16 => {
            let [k, v] = [0, 1].map(|i| GpuTensorF16::from_f32(ctx, &rows[i], &shape));
            let (k, v) = (k?, v?);
            measure(ctx, timer, reps, || {
                let mut encoder = ctx.device().create_command_encoder(&Default::default());
                let cache = HalfCache {
                    k: &k,
                    v: &v,
                    table: table.as_ref(),
                };
                attention_decode_f16_into(ctx, &mut encoder, q, cache, &ov, &lse, opts)?;
                ctx.queue().submit([encoder.finish()]);
                Ok(())
            })?
        }
        _ => {
            let views_shape = match page {
                None => shape.clone(),
                Some(_) => [vec![1], shape.clone()].concat(),
            };
            let [k, v] = [0, 1].map(|i| GpuTensor::from_slice(ctx, &rows[i], &views_shape));
            let (k, v) = (k?.heads()?, v?.heads()?);
            measure(ctx, timer, reps, || {
                let mut encoder = ctx.device().create_command_encoder(&Default::default());
                let views = ForwardViews {
                    q,
                    k: &k,
                    v: &v,
                    out: &ov,
                    lse: &lse,
                };
                match &table {
                    Some(table) => {
                        attention_decode_paged_into(ctx, &mut encoder, &views, table, opts)?
                    }
                    None => attention_decode_into(ctx, &mut encoder, &views, opts)?,
                }
                ctx.queue().submit([encoder.finish()]);
                Ok(())
            })?
        }
    };
    Ok((samples.median(), out.to_vec(ctx)?))
}

struct SpeculativeFigures {
    batch: usize,
    guesses: usize,
    /// Guesses were the plain run's tokens (all kept) or never matched (none kept).
    oracle: bool,
    tokens_per_s: f64,
    passes: usize,
    /// Tokens each sequence gained per verification pass, on average.
    tokens_per_pass: f64,
    same_tokens: bool,
}

/// Greedy speculative decoding after the prefill: chains of `guesses` verified per pass, the
/// guesses the plain run's next tokens (`oracle`) or tokens that never match; decode tokens/s over
/// the verification passes (the prefill not counted, as in the plain figures' decode rate).
fn speculative(
    ctx: &Context,
    cli: &Cli,
    model: &Transformer,
    batch: usize,
    guesses: usize,
    plain: &[Vec<u32>],
    oracle: bool,
) -> Result<SpeculativeFigures, Error> {
    let shape = GeneratorShape {
        batch,
        capacity: cli.context,
        prefill_chunk: cli.prefill_chunk.max(guesses + 1),
        src_len: 0,
    };
    let mut generator = Generator::new(ctx, model, shape)?;
    let prompts = prompts(cli, model.config().vocab, batch);
    let vocab = model.config().vocab as u32;
    let mut run = || -> Result<(f64, usize, Vec<Vec<u32>>), Error> {
        generator.prefill(ctx, &prompts, None)?;
        let first = generator.sample(ctx, &Sampling::greedy())?;
        let mut out: Vec<Vec<u32>> = first.iter().map(|&t| vec![t]).collect();
        let start = Instant::now();
        let mut passes = 0;
        while out.iter().any(|o| o.len() < cli.new_tokens) {
            let drafts: Vec<Option<Draft>> = out
                .iter()
                .enumerate()
                .map(|(b, o)| {
                    (o.len() < cli.new_tokens).then(|| {
                        let k = o.len() - 1;
                        let chain: Vec<u32> = (1..=guesses)
                            .map(|i| {
                                let t = plain[b].get(k + i).copied().unwrap_or(0);
                                if oracle {
                                    t
                                } else {
                                    (t + 1) % vocab
                                }
                            })
                            .collect();
                        Draft::chain(o[k], &chain)
                    })
                })
                .collect();
            let got = generator.verify(ctx, &drafts)?;
            for (o, g) in out.iter_mut().zip(got) {
                o.extend(g);
            }
            passes += 1;
        }
        Ok((start.elapsed().as_secs_f64(), passes, out))
    };
    // A first run compiles the verification pipelines; the second is measured.
    run()?;
    let (seconds, passes, out) = run()?;
    let gained: usize = out.iter().map(|o| o.len() - 1).sum();
    let same = out
        .iter()
        .zip(plain)
        .all(|(o, p)| o.len() >= p.len() && o[..p.len()] == p[..]);
    Ok(SpeculativeFigures {
        batch,
        guesses,
        oracle,
        tokens_per_s: gained as f64 / seconds,
        passes,
        tokens_per_pass: gained as f64 / (passes * batch) as f64,
        same_tokens: same,
    })
}

fn run(cli: &Cli) -> Result<(), Error> {
    let backends = cli.backend.as_deref().map(parse_backends).transpose()?;
    let ctx = Context::new_with(&bench_options(backends, cli.adapter.clone())?)?;
    println!("adapter: {}", ctx.report());
    if cli.decode_attention {
        return decode_attention_only(&ctx, cli);
    }
    let model = model(&ctx, cli)?;
    let c = model.config();
    println!(
        "model: {}decoder-only, d_model {}, {} layers, {} heads ({} key/value), d_ff {}, vocab {}, {}; {} parameters",
        cli.model
            .as_ref()
            .map_or(String::new(), |dir| format!("{} ", dir.display())),
        c.d_model,
        c.decoder_layers,
        c.heads,
        c.effective_kv_heads(),
        c.d_ff,
        c.vocab,
        match (c.additive_attention, c.position_kind()) {
            (Some(da), _) => format!("additive scores (Da {da}), sinusoidal positions"),
            (None, kind) => format!("{kind:?} positions"),
        },
        model.params.elements()
    );
    println!(
        "generation: prompt {} tokens (prefill chunks of {}), {} new tokens greedy, cache capacity {}",
        cli.prompt, cli.prefill_chunk, cli.new_tokens, cli.context
    );
    let formats = cli.formats();
    let formats = formats.as_slice();
    if cli.compile_only {
        let started = std::time::Instant::now();
        for &batch in &cli.batches {
            let shape = GeneratorShape {
                batch,
                capacity: cli.context,
                prefill_chunk: cli.prefill_chunk,
                src_len: 0,
            };
            let pages = [None].into_iter().chain(cli.page.map(Some));
            for page in pages {
                for &format in formats {
                    let layout = cache_layout(cli, batch, page);
                    let cache = CacheConfig::new(layout).with_format(format);
                    let built = Generator::with_layout(&ctx, &model, shape, cache)?
                        .precompile(&ctx, &Sampling::greedy())?;
                    println!(
                        "batch {batch}, {layout:?} {} cache: built {built} new pipelines",
                        format.name()
                    );
                }
            }
        }
        println!("in {:.1} s", started.elapsed().as_secs_f64());
        return Ok(());
    }
    let mut figures = Vec::new();
    let pages = [None].into_iter().chain(cli.page.map(Some));
    for &batch in &cli.batches {
        let mut baseline: Option<Vec<Vec<u32>>> = None;
        for page in pages.clone() {
            for &format in formats {
                let f = cached(&ctx, cli, &model, batch, page, format)?;
                match &baseline {
                    None => baseline = Some(f.generated.clone()),
                    Some(tokens) => {
                        let same = f
                            .generated
                            .iter()
                            .zip(tokens)
                            .map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count());
                        let same: usize = same.sum();
                        let all: usize = tokens.iter().map(Vec::len).sum();
                        if same != all {
                            println!(
                                "note: batch {batch}, {} cache: {same} of {all} greedy tokens equal the contiguous f32 cache's before the sequences diverge",
                                f.layout
                            );
                        }
                    }
                }
                figures.push(f);
            }
        }
    }
    println!(
        "\n| batch | cache | cache MB | prefill tokens/s | decode tokens/s | ms per decode step |\n|---|---|---|---|---|---|"
    );
    for f in &figures {
        println!(
            "| {} | {} | {:.1} | {:.0} | {:.1} | {:.2} |",
            f.batch,
            f.layout,
            f.cache_bytes as f64 / 1e6,
            f.prefill_tokens_per_s,
            f.decode_tokens_per_s,
            f.decode_ms_per_step
        );
    }
    let mut speculative_figures = Vec::new();
    if let Some(guesses) = cli.speculate {
        for f in figures.iter().filter(|f| f.layout == "contiguous f32") {
            for oracle in [true, false] {
                let s = speculative(&ctx, cli, &model, f.batch, guesses, &f.generated, oracle)?;
                speculative_figures.push((s, f.decode_tokens_per_s));
            }
        }
        println!(
            "\nspeculative decoding, chains of {guesses} guesses (greedy, contiguous f32 cache):\n\n| batch | guesses | tokens per pass | passes | decode tokens/s | vs plain decoding | same tokens |\n|---|---|---|---|---|---|---|"
        );
        for (s, plain) in &speculative_figures {
            println!(
                "| {} | {} | {:.2} | {} | {:.1} | {:.2}x | {} |",
                s.batch,
                match s.oracle {
                    true => "the plain run's (all kept)",
                    false => "never matching (none kept)",
                },
                s.tokens_per_pass,
                s.passes,
                s.tokens_per_s,
                s.tokens_per_s / plain,
                s.same_tokens
            );
        }
    }
    let mut rerun_figures = None;
    if cli.rerun {
        let batch = cli.batches[0];
        let (tokens_per_s, generated) = rerun(&ctx, cli, &model, batch)?;
        let cached = &figures[0];
        // Cached generation end to end: the prefill and every decoding step.
        let cached_rate = (batch * cli.new_tokens) as f64 / cached.seconds;
        let same = generated == cached.generated;
        println!(
            "\nre-running the forward for every new token (batch {batch}): {tokens_per_s:.1} tokens/s; \
             cached generation {cached_rate:.1} tokens/s (prefill included): {:.1}x; same tokens: {same}",
            cached_rate / tokens_per_s
        );
        rerun_figures = Some((batch, tokens_per_s, cached_rate, same));
    }
    let timer = Timer::new(&ctx, false);
    let (attention_figures, skipped) =
        decode_attention::run_grid(&ctx, &timer, cli.reps, &decode_cases(cli)?)?;
    decode_attention::print(&attention_figures, &skipped, timer.clock().name());
    let mut prefill_figures = Vec::new();
    for &prompt in cli.prefill_attention.iter().filter(|&&p| p > 0) {
        for &batch in &cli.batches {
            prefill_figures.push(prefill_attention(&ctx, cli, &timer, batch, prompt)?);
        }
    }
    if !prefill_figures.is_empty() {
        println!(
            "\nprefill-shaped attention, H {} / Hkv {}, D 64, causal, prompt = keys ({}); outputs \
             of the kernels checked to agree with the fused forward:\n",
            cli.heads,
            (cli.heads / 4).max(1),
            timer.clock().name()
        );
        println!("| batch | prompt | attention_decode_into ms | fused forward ms | forward plan | decode / forward | paged ms | paged / decode |\n|---|---|---|---|---|---|---|---|");
        for p in &prefill_figures {
            let paged = match p.paged_ms {
                Some(ms) => format!("{ms:.2} | {:.2}x", ms / p.decode_kernel_ms),
                None => "- | -".to_string(),
            };
            println!(
                "| {} | {} | {:.2} | {:.2} | {} | {:.2}x | {paged} |",
                p.batch,
                p.prompt,
                p.decode_kernel_ms,
                p.forward_kernel_ms,
                p.forward_plan,
                p.decode_kernel_ms / p.forward_kernel_ms
            );
        }
        let stored: Vec<_> = prefill_figures
            .iter()
            .flat_map(|p| p.stored.iter().map(move |s| (p, s)))
            .collect();
        if !stored.is_empty() {
            println!("\nthe same prefill over caches of other formats (attention_decode_{{f16,int8}}_into; the fused forward dequantises them as it stages them):\n");
            println!(
                "| batch | prompt | cache | ms | / f32 cache, same layout |\n|---|---|---|---|---|"
            );
            for (p, &(format, paged, ms)) in stored {
                let f32_ms = if paged {
                    p.paged_ms.unwrap_or(f64::NAN)
                } else {
                    p.decode_kernel_ms
                };
                println!(
                    "| {} | {} | {} {} | {ms:.2} | {:.2}x |",
                    p.batch,
                    p.prompt,
                    format.name(),
                    if paged { "paged" } else { "contiguous" },
                    ms / f32_ms
                );
            }
        }
    }
    if let Some(path) = &cli.json {
        let report = serde_json::json!({
            "adapter": ctx.report().to_string(),
            "cli": format!("{cli:?}"),
            "prefill_attention": prefill_figures.iter().map(|p| serde_json::json!({
                "batch": p.batch, "prompt": p.prompt, "decode_kernel_ms": p.decode_kernel_ms,
                "forward_kernel_ms": p.forward_kernel_ms, "forward_plan": p.forward_plan,
                "paged_ms": p.paged_ms,
                "stored": p.stored.iter().map(|&(format, paged, ms)| serde_json::json!({
                    "format": format.name(), "paged": paged, "ms": ms,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "generation": figures.iter().map(|f| serde_json::json!({
                "batch": f.batch,
                "cache": f.layout,
                "cache_bytes": f.cache_bytes,
                "prefill_tokens_per_s": f.prefill_tokens_per_s,
                "decode_tokens_per_s": f.decode_tokens_per_s,
                "decode_ms_per_step": f.decode_ms_per_step,
            })).collect::<Vec<_>>(),
            "rerun": rerun_figures.map(|(batch, rerun, cached, same)| serde_json::json!({
                "batch": batch, "rerun_tokens_per_s": rerun, "cached_tokens_per_s": cached,
                "speedup": cached / rerun, "same_tokens": same,
            })),
            "speculative": speculative_figures.iter().map(|(s, plain)| serde_json::json!({
                "batch": s.batch, "guesses": s.guesses, "oracle": s.oracle,
                "tokens_per_s": s.tokens_per_s, "passes": s.passes,
                "tokens_per_pass": s.tokens_per_pass, "plain_decode_tokens_per_s": plain,
                "same_tokens": s.same_tokens,
            })).collect::<Vec<_>>(),
            "decode_attention": decode_attention::json(&attention_figures),
        });
        wgpu_attention::bench::write_report(path, &serde_json::to_string_pretty(&report).unwrap())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

impl Cli {
    /// The cache formats asked for: f32, then f16 and int8 with their flags.
    fn formats(&self) -> Vec<KvFormat> {
        let mut formats = vec![KvFormat::F32];
        if self.f16 {
            formats.push(KvFormat::F16);
        }
        if self.int8 {
            formats.push(KvFormat::Int8);
        }
        formats
    }
}

/// The decode attention grid of the command line.
fn decode_cases(cli: &Cli) -> Result<Vec<DecodeCase>, Error> {
    let heads = match cli.attention_heads.is_empty() {
        true => vec![(cli.heads, (cli.heads / 4).max(1))],
        false => cli
            .attention_heads
            .iter()
            .map(|t| decode_attention::parse_heads(t))
            .collect::<Result<_, _>>()
            .map_err(|e| Error::shape("--attention-heads", e))?,
    };
    let formats = cli.formats();
    let pages = [None].into_iter().chain(cli.page.map(Some));
    let mut cases = Vec::new();
    for &context in cli.attention_lengths.iter().filter(|&&l| l > 0) {
        for &batch in &cli.batches {
            for &(heads, kv_heads) in &heads {
                for &head_dim in &cli.attention_head_dims {
                    for &format in &formats {
                        for page in pages.clone() {
                            cases.push(DecodeCase {
                                batch,
                                heads,
                                kv_heads,
                                head_dim,
                                context,
                                format,
                                page,
                            });
                        }
                    }
                }
            }
        }
    }
    Ok(cases)
}

/// `--decode-attention`: the grid alone, its table and JSON.
fn decode_attention_only(ctx: &Context, cli: &Cli) -> Result<(), Error> {
    let timer = Timer::new(ctx, false);
    let (figures, skipped) =
        decode_attention::run_grid(ctx, &timer, cli.reps, &decode_cases(cli)?)?;
    decode_attention::print(&figures, &skipped, timer.clock().name());
    if let Some(path) = &cli.json {
        let report = serde_json::json!({
            "adapter": ctx.report().to_string(),
            "cli": format!("{cli:?}"),
            "decode_attention": decode_attention::json(&figures),
            "skipped": skipped,
        });
        wgpu_attention::bench::write_report(path, &serde_json::to_string_pretty(&report).unwrap())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(2);
        }
    };
    if cli.vocab < 2
        || cli.layers == 0
        || cli.batches.is_empty()
        || cli.batches.contains(&0)
        || cli.prompt == 0
        || cli.prompt + cli.new_tokens > cli.context
    {
        eprintln!("generate-bench: vocab >= 2, layers, batches and prompt positive, prompt + new tokens within the context");
        return ExitCode::from(2);
    }
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("generate-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
