//! Training throughput of a whole Transformer on one adapter: tokens/s and GFLOP/s of a training step
//! (forward, backward, AdamW, one submission) and of the forward alone, the compute passes and
//! submissions each records, and the GPU time of one training step split by kernel family
//! (timestamp queries around every compute pass, where the adapter has them).
//!
//! ```text
//! cargo run --release -p wgpu-attention-bench --bin transformer-bench -- [--d-model 256 --heads 8 --layers 4 --seq 128 --batch 8]
//! cargo run --release -p wgpu-attention-bench --bin transformer-bench -- --varlen [--seq 256 --batch 8]   # packed vs padded
//! cargo run --release -p wgpu-attention-bench --bin transformer-bench -- --precision f32,mixed     # f32 vs mixed precision
//! ```

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use wgpu_attention::bench::{bench_options, measure, Timer};
use wgpu_attention::kernels::optimizer::AdamWConfig;
use wgpu_attention::{parse_backends, Context, Error, GemmTiles};
use wgpu_attention_transformer::layers::Precision;
use wgpu_attention_transformer::model::{
    Batch, BatchShape, PackedShape, Transformer, TransformerConfig,
};
use wgpu_attention_transformer::training::Trainer;

#[derive(Parser, Debug)]
#[command(version, about = "Transformer training throughput on any wgpu adapter")]
struct Cli {
    /// Back end: vulkan, gl, metal, dx12 (default: WGPU_BACKEND, else all)
    #[arg(long)]
    backend: Option<String>,
    /// Case-insensitive substring of the adapter name (default: WGPU_ADAPTER_NAME)
    #[arg(long)]
    adapter: Option<String>,
    #[arg(long, default_value_t = 256)]
    d_model: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Feed-forward width (default 4 * d_model)
    #[arg(long)]
    d_ff: Option<usize>,
    /// Encoder layers and decoder layers (each)
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Source and target length
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 1000)]
    vocab: usize,
    /// Decoder-only language model (no encoder, no cross-attention)
    #[arg(long)]
    decoder_only: bool,
    /// Post-LN instead of pre-LN
    #[arg(long)]
    post_ln: bool,
    /// Additive (Bahdanau) attention of this score width instead of dot-product attention
    #[arg(long)]
    additive: Option<usize>,
    /// Timed runs of each measurement (after warm-up)
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Time with the host clock even where GPU timestamps exist
    #[arg(long)]
    wall_clock: bool,
    /// GEMM output tiles: 64x64 or 128x64 (default: the adapter's, see GemmTiles)
    #[arg(long)]
    gemm_tiles: Option<String>,
    /// Write the figures as JSON
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Build every pipeline of a training step (with --varlen: of the padded and the packed step)
    /// and exit without running one (with
    /// WGPU_ATTENTION_DUMP_PIPELINES=DIR, this writes the training kernel set)
    #[arg(long)]
    compile_only: bool,
    /// Variable-length sequences (decoder-only): sequence b has seq * (4 - b % 4) / 4 tokens; the
    /// same batch is trained padded (`Transformer::new`) and packed (`Transformer::packed`), both
    /// measured in this run
    #[arg(long)]
    varlen: bool,
    /// The Linear layers' products, one run each in this process: f32, mixed (f16 products, f32
    /// master weights, loss scaling), or both (`f32,mixed`)
    #[arg(long, default_value = "f32", value_delimiter = ',')]
    precision: Vec<Precision>,
}

/// Floating-point operations of the GEMMs and attention of one forward and of one training step
/// (forward, backward): Linear layers `2 rows in out` forward and twice that backward (dx, dW);
/// attention `4 B H Lq Lk dh` forward (half the keys when causal) and 2.5 times that backward
/// (recomputing S, then dV, dP, dQ, dK), as FlashAttention counts. Elementwise work, LayerNorm and
/// the optimizer are not counted.
fn step_flops(c: &TransformerConfig, s: &BatchShape) -> (f64, f64) {
    let (d, ff, dh) = (
        c.d_model as f64,
        c.d_ff as f64,
        (c.d_model / c.heads) as f64,
    );
    let (src_rows, tgt_rows) = ((s.batch * s.src_len) as f64, (s.batch * s.tgt_len) as f64);
    let (ls, lt) = (s.src_len as f64, s.tgt_len as f64);
    let bh = (s.batch * c.heads) as f64;
    let linear = |rows: f64, inp: f64, out: f64| 2.0 * rows * inp * out;
    let attention = |lq: f64, lk: f64| 4.0 * bh * lq * lk * dh;
    let ffn = |rows: f64| linear(rows, d, ff) + linear(rows, ff, d);
    let enc = c.encoder_layers as f64;
    let dec = c.decoder_layers as f64;
    let enc_linear = enc * (linear(src_rows, d, 3.0 * d) + linear(src_rows, d, d) + ffn(src_rows));
    let enc_attention = enc * attention(ls, ls);
    let cross = c.encoder_layers > 0;
    let cross_linear = match cross {
        true => linear(tgt_rows, d, d) + linear(src_rows, d, 2.0 * d) + linear(tgt_rows, d, d),
        false => 0.0,
    };
    let dec_linear = dec
        * (linear(tgt_rows, d, 3.0 * d) + linear(tgt_rows, d, d) + cross_linear + ffn(tgt_rows));
    let causal_keys = (lt + 1.0) / 2.0;
    let dec_attention =
        dec * (attention(lt, causal_keys) + if cross { attention(lt, ls) } else { 0.0 });
    let head = linear(tgt_rows, d, c.vocab as f64);
    let linear_all = enc_linear + dec_linear + head;
    let attention_all = enc_attention + dec_attention;
    (
        linear_all + attention_all,
        3.0 * linear_all + 3.5 * attention_all,
    )
}

/// Where the JSON report of `precision` goes: `--json`'s path, or for the second precision of a
/// run with several, `NAME.mixed.json` beside `NAME.json`.
fn report_path(cli: &Cli, path: &std::path::Path, precision: Precision) -> std::path::PathBuf {
    match (precision, cli.precision.len()) {
        (Precision::F32, _) | (_, 1) => path.to_path_buf(),
        _ => path.with_extension(format!("{}.json", precision.name())),
    }
}

/// The kernel family of a compute pass, by its label.
fn family(label: &str) -> &'static str {
    match label {
        l if l.starts_with("attention") => "attention (fused, fwd + bwd)",
        l if l.starts_with("linear") || l == "column_sum" => "linear (GEMM, bias grad)",
        l if l.starts_with("layer_norm") => "layer norm",
        l if l.starts_with("activation") || l == "add" => "elementwise (GELU, residual add)",
        l if l.starts_with("embedding") || l.starts_with("positional") => "embedding + positions",
        l if l.starts_with("cross_entropy") => "cross-entropy loss",
        l if l == "adamw" || l.starts_with("grad_norm") => "optimizer (AdamW, grad norm)",
        l if l.starts_with("cast_f16") => "f16 weight copies (mixed precision)",
        _ => "other",
    }
}

fn run(cli: &Cli) -> Result<(), Error> {
    let backends = cli.backend.as_deref().map(parse_backends).transpose()?;
    let mut ctx = Context::new_with(&bench_options(backends, cli.adapter.clone())?)?;
    if let Some(tiles) = &cli.gemm_tiles {
        ctx.set_gemm_tiles(Some(GemmTiles::parse(tiles)?));
    }
    let ctx = ctx;
    println!(
        "adapter: {}\nGEMM tiles: {}",
        ctx.report(),
        ctx.gemm_tiles().name()
    );
    let config = TransformerConfig::default()
        .vocab(cli.vocab)
        .d_model(cli.d_model)
        .heads(cli.heads)
        .d_ff(cli.d_ff.unwrap_or(4 * cli.d_model))
        .encoder_layers(if cli.decoder_only || cli.varlen {
            0
        } else {
            cli.layers
        })
        .decoder_layers(cli.layers)
        .pre_ln(!cli.post_ln)
        .additive_attention(cli.additive);
    for &precision in &cli.precision {
        println!("\nprecision: {}", precision.name());
        match cli.varlen {
            true => run_varlen(cli, &ctx, config, precision)?,
            false => train_case(cli, &ctx, config, precision)?,
        }
    }
    // Which builds the tensor-core kernels ran (mixed precision's GEMMs take them by default where
    // they qualify, whatever the tiles printed above).
    for q in ctx.qualifications() {
        println!("qualification: {} {}", q.kernel, q.detail);
    }
    Ok(())
}

/// The training step and forward of `config` in `precision`, measured and reported.
fn train_case(
    cli: &Cli,
    ctx: &Context,
    config: TransformerConfig,
    precision: Precision,
) -> Result<(), Error> {
    let shape = BatchShape {
        batch: cli.batch,
        src_len: cli.seq,
        tgt_len: cli.seq,
    };
    let before = ctx.memory().current_bytes;
    let model = Transformer::new(ctx, config, shape, 1)?;
    let mut trainer = Trainer::with_precision(ctx, model, AdamWConfig::default(), precision)?;
    if cli.compile_only {
        let started = std::time::Instant::now();
        let built = trainer.precompile(ctx)?;
        println!(
            "built {built} pipelines of a training step in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let memory_mib = (ctx.memory().current_bytes - before) as f64 / (1 << 20) as f64;
    let params = trainer.model.params.elements();
    let tensors = trainer.model.params.len();
    println!(
        "model: {config:?}\nshape: {shape:?}; {params} parameters in {tensors} tensors; \
         {memory_mib:.1} MiB of tensors"
    );

    // Full-length sequences of deterministic ids in 1..vocab.
    let ids = |n: usize, salt: usize| -> Vec<u32> {
        (0..n)
            .map(|i| 1 + ((i * 7919 + salt * 104729) % (cli.vocab - 1)) as u32)
            .collect()
    };
    let n = cli.batch * cli.seq;
    let batch = Batch {
        src: if cli.decoder_only {
            Vec::new()
        } else {
            ids(n, 1)
        },
        src_lens: if cli.decoder_only {
            Vec::new()
        } else {
            vec![cli.seq as u32; cli.batch]
        },
        tgt_in: ids(n, 2),
        tgt_out: ids(n, 3),
        tgt_lens: vec![cli.seq as u32; cli.batch],
    };
    let tokens = if cli.decoder_only { n } else { 2 * n } as f64;

    let (forward_flops, train_flops) = step_flops(&config, &shape);
    // What one call records (after a first call has built the pipelines and bind groups): passes,
    // submissions and dispatches (each dispatch takes one bind group from the trainer's cache).
    let mut count = |train: bool| -> Result<(u64, u64, u64), Error> {
        let call = |trainer: &mut Trainer| match train {
            true => trainer.step(ctx, &batch),
            false => trainer.forward(ctx, &batch),
        };
        call(&mut trainer)?;
        let dispatches = |trainer: &Trainer| {
            let (created, reused) = trainer.binding_counts();
            created + reused
        };
        let before = (ctx.recorded_counts(), dispatches(&trainer));
        call(&mut trainer)?;
        let after = (ctx.recorded_counts(), dispatches(&trainer));
        ctx.synchronize()?;
        Ok((
            after.0.passes - before.0.passes,
            after.0.submissions - before.0.submissions,
            after.1 - before.1,
        ))
    };
    let train_counts = count(true)?;
    let forward_counts = count(false)?;
    // Host time to record and submit a step (not waiting for it): what a GPU faster than the host's
    // recording would wait for. Median of `reps`, each waited for before the next.
    let mut recording = Vec::new();
    for _ in 0..cli.reps.max(1) {
        let start = Instant::now();
        trainer.step(ctx, &batch)?;
        recording.push(start.elapsed().as_secs_f64() * 1e3);
        ctx.synchronize()?;
    }
    recording.sort_by(f64::total_cmp);
    let recording_ms = recording[recording.len() / 2];

    let timer = Timer::new(ctx, cli.wall_clock);
    let started = Instant::now();
    let train = measure(ctx, &timer, cli.reps, || trainer.step(ctx, &batch))?;
    let forward = measure(ctx, &timer, cli.reps, || trainer.forward(ctx, &batch))?;
    let loss = trainer.model.loss().to_vec(ctx)?[0];
    let scaling = match trainer.loss_scale_state(ctx)? {
        Some(s) => format!(
            "; loss scale {}, {} steps skipped",
            s.scale, s.skipped_steps
        ),
        None => String::new(),
    };
    println!(
        "clock: {}; {} timed runs each after warm-up ({:.1} s in all); loss after the steps {loss:.4}{scaling}",
        timer.clock().name(),
        cli.reps,
        started.elapsed().as_secs_f64()
    );
    println!(
        "\n| measurement | median ms | min-max ms | tokens/s | GFLOP | GFLOP/s | passes | dispatches | submissions |\n|---|---|---|---|---|---|---|---|---|"
    );
    for (name, s, flops, (passes, submissions, dispatches)) in [
        (
            "training step (fwd + bwd + AdamW)",
            &train,
            train_flops,
            train_counts,
        ),
        ("forward only", &forward, forward_flops, forward_counts),
    ] {
        println!(
            "| {name} | {:.2} | {:.2}-{:.2} | {:.0} | {:.2} | {:.1} | {passes} | {dispatches} | {submissions} |",
            s.median(),
            s.min(),
            s.max(),
            tokens / (s.median() / 1e3),
            flops / 1e9,
            flops / 1e9 / (s.median() / 1e3),
        );
    }
    println!("host time to record and submit a training step: {recording_ms:.2} ms (median)");
    println!(
        "(tokens: source + target tokens of the batch, {tokens}; GFLOP: the GEMMs and attention, \
         see step_flops)"
    );

    // One profiled training step.
    let mut families: Vec<(&'static str, f64, usize)> = Vec::new();
    match ctx.start_profiling() {
        Ok(()) => {
            trainer.step(ctx, &batch)?;
            let passes = ctx.finish_profiling()?;
            for (label, ms) in &passes {
                let f = family(label);
                match families.iter_mut().find(|(n, _, _)| *n == f) {
                    Some(e) => {
                        e.1 += ms;
                        e.2 += 1
                    }
                    None => families.push((f, *ms, 1)),
                }
            }
            families.sort_by(|a, b| b.1.total_cmp(&a.1));
            let total: f64 = families.iter().map(|f| f.1).sum();
            println!(
                "\none training step by kernel family (sum of pass timestamps, {} passes):\n",
                passes.len()
            );
            println!("| family | passes | ms | share |\n|---|---|---|---|");
            for (f, ms, count) in &families {
                println!("| {f} | {count} | {ms:.2} | {:.1}% |", 100.0 * ms / total);
            }
            println!("| total | {} | {total:.2} | 100% |", passes.len());
        }
        Err(e) => println!("\nno kernel breakdown: {e}"),
    }
    if let Some(path) = &cli.json {
        let report = serde_json::json!({
            "adapter": ctx.report().to_string(),
            "config": format!("{config:?}"),
            "shape": format!("{shape:?}"),
            "parameters": params,
            "parameter_tensors": tensors,
            "gemm_tiles": ctx.gemm_tiles().name(),
            "precision": precision.name(),
            "tensor_memory_mib": memory_mib,
            "clock": timer.clock().name(),
            "tokens_per_batch": tokens,
            "train_step_ms": train.times_ms,
            "forward_ms": forward.times_ms,
            "train_tokens_per_s": tokens / (train.median() / 1e3),
            "train_gflop": train_flops / 1e9,
            "train_gflop_per_s": train_flops / 1e9 / (train.median() / 1e3),
            "train_passes": train_counts.0,
            "train_submissions": train_counts.1,
            "train_dispatches": train_counts.2,
            "train_recording_ms": recording_ms,
            "forward_gflop": forward_flops / 1e9,
            "forward_passes": forward_counts.0,
            "forward_submissions": forward_counts.1,
            "forward_dispatches": forward_counts.2,
            "forward_tokens_per_s": tokens / (forward.median() / 1e3),
            "families_ms": families.iter().map(|(f, ms, c)| serde_json::json!({"family": f, "ms": ms, "passes": c})).collect::<Vec<_>>(),
        });
        let path = report_path(cli, path, precision);
        wgpu_attention::bench::write_report(
            &path,
            &serde_json::to_string_pretty(&report).unwrap(),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// `--varlen`: the same variable-length sequences trained padded and packed, in one run.
fn run_varlen(
    cli: &Cli,
    ctx: &Context,
    config: TransformerConfig,
    precision: Precision,
) -> Result<(), Error> {
    let lens: Vec<u32> = (0..cli.batch)
        .map(|b| (cli.seq * (4 - b % 4) / 4).max(1) as u32)
        .collect();
    let rows: usize = lens.iter().map(|&l| l as usize).sum();
    let id = |i: usize, salt: usize| 1 + ((i * 7919 + salt * 104729) % (cli.vocab - 1)) as u32;
    // Padded: sequence b in row b, pad_id after its length.
    let padded_ids = |salt: usize| -> Vec<u32> {
        (0..cli.batch * cli.seq)
            .map(|i| match (i % cli.seq) < lens[i / cli.seq] as usize {
                true => id(i, salt),
                false => config.pad_id,
            })
            .collect()
    };
    let (tgt_in, tgt_out) = (padded_ids(2), padded_ids(3));
    let padded_batch = Batch {
        tgt_in: tgt_in.clone(),
        tgt_out: tgt_out.clone(),
        tgt_lens: lens.clone(),
        ..Batch::default()
    };
    let pack = |ids: &[u32]| -> Vec<u32> {
        (0..cli.batch)
            .flat_map(|b| ids[b * cli.seq..][..lens[b] as usize].to_vec())
            .collect()
    };
    let packed_batch = Batch {
        tgt_in: pack(&tgt_in),
        tgt_out: pack(&tgt_out),
        tgt_lens: lens.clone(),
        ..Batch::default()
    };
    let shape = BatchShape {
        batch: cli.batch,
        src_len: 0,
        tgt_len: cli.seq,
    };
    let packed_shape = PackedShape {
        sequences: cli.batch,
        rows,
    };
    println!(
        "model: {config:?}\nsequences: {lens:?}: {rows} tokens, padded to {} ({:.0}% padding)",
        cli.batch * cli.seq,
        100.0 * (1.0 - rows as f64 / (cli.batch * cli.seq) as f64)
    );
    let timer = Timer::new(ctx, cli.wall_clock);
    let mut results = Vec::new();
    for (layout, packed) in [("padded", false), ("packed", true)] {
        let before = ctx.memory().current_bytes;
        let (model, batch) = match packed {
            false => (Transformer::new(ctx, config, shape, 1)?, &padded_batch),
            true => (
                Transformer::packed(ctx, config, packed_shape, 1)?,
                &packed_batch,
            ),
        };
        let mut trainer = Trainer::with_precision(ctx, model, AdamWConfig::default(), precision)?;
        if cli.compile_only {
            trainer.precompile(ctx)?;
            continue;
        }
        let memory_mib = (ctx.memory().current_bytes - before) as f64 / (1 << 20) as f64;
        // The loss of the initial parameters (both layouts draw the same): the two must agree.
        trainer.forward(ctx, batch)?;
        let loss = trainer.model.loss().to_vec(ctx)?[0];
        let train = measure(ctx, &timer, cli.reps, || trainer.step(ctx, batch))?;
        let forward = measure(ctx, &timer, cli.reps, || trainer.forward(ctx, batch))?;
        results.push((layout, train, forward, memory_mib, loss));
    }
    if cli.compile_only {
        println!(
            "built {} pipelines of the padded and the packed training steps",
            ctx.cached_pipelines()
        );
        return Ok(());
    }
    println!(
        "clock: {}; {} timed runs each after warm-up\n\n| layout | training step ms (median, min-max) | forward ms | real tokens/s (step) | tensor MiB | initial loss |\n|---|---|---|---|---|---|",
        timer.clock().name(),
        cli.reps
    );
    for (layout, train, forward, memory_mib, loss) in &results {
        println!(
            "| {layout} | {:.2} ({:.2}-{:.2}) | {:.2} | {:.0} | {memory_mib:.1} | {loss:.4} |",
            train.median(),
            train.min(),
            train.max(),
            forward.median(),
            rows as f64 / (train.median() / 1e3),
        );
    }
    let (padded, packed) = (&results[0], &results[1]);
    if (padded.4 - packed.4).abs() > 1e-4 * padded.4.abs().max(1.0) {
        // A failed check is a failed run (exit code 1), as attention-bench's validation is.
        eprintln!(
            "transformer-bench: VALIDATION FAILED: the packed model's initial loss {} differs from \
             the padded one's {}",
            packed.4, padded.4
        );
        std::process::exit(1);
    }
    println!(
        "packed over padded: training step {:.2}x, forward {:.2}x, memory {:.2}x",
        padded.1.median() / packed.1.median(),
        padded.2.median() / packed.2.median(),
        packed.3 / padded.3
    );
    if let Some(path) = &cli.json {
        let report = serde_json::json!({
            "adapter": ctx.report().to_string(),
            "config": format!("{config:?}"),
            "lens": lens,
            "tokens": rows,
            "padded_tokens": cli.batch * cli.seq,
            "clock": timer.clock().name(),
            "layouts": results.iter().map(|(layout, train, forward, memory_mib, loss)| serde_json::json!({
                "layout": layout,
                "train_step_ms": train.times_ms,
                "forward_ms": forward.times_ms,
                "tensor_memory_mib": memory_mib,
                "loss": loss,
            })).collect::<Vec<_>>(),
        });
        let path = report_path(cli, path, precision);
        wgpu_attention::bench::write_report(
            &path,
            &serde_json::to_string_pretty(&report).unwrap(),
        )?;
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
    if cli.vocab < 2 || cli.seq == 0 || cli.batch == 0 || cli.layers == 0 {
        eprintln!("transformer-bench: vocab must be >= 2 and seq, batch, layers positive");
        return ExitCode::from(2);
    }
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("transformer-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
