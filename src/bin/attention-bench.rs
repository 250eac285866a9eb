//! `attention-bench`: validated, reproducible attention benchmarks on any adapter.
//!
//!     cargo run --release --bin attention-bench                 # default suite
//!     cargo run --release --bin attention-bench -- --quick      # under a minute on lavapipe
//!     cargo run --release --bin attention-bench -- --suite scaling --json scaling.json --plot scaling.svg
//!     cargo run --release --bin attention-bench -- --list-adapters
//!
//! Every case is first checked against the CPU reference where that is affordable; a failed check is
//! printed loudly and makes the exit code 1. Bad arguments exit with code 2 and a one-line message.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use serde_json::{json, Value};
use wgpu_attention::bench::fma::fma_peak_gflops;
use wgpu_attention::bench::layer::LayerCase;
use wgpu_attention::bench::{measure, Samples, Timer};
use wgpu_attention::reference::attention::{self as reference, Bias, Masks};
use wgpu_attention::reference::compare::{
    compare, BACKWARD_ATOL, BACKWARD_RTOL, F16_BACKWARD_ATOL, F16_FORWARD_ATOL, F16_RTOL,
    FORWARD_ATOL, FORWARD_RTOL,
};
use wgpu_attention::reference::transformer_layer::{
    self as reference_layer, TransformerLayerConfig,
};
use wgpu_attention::{
    attention_backward_into, attention_backward_unfused, attention_backward_workspace,
    attention_bias_backward_into, attention_forward_into, attention_forward_plan,
    attention_forward_unfused, attention_sinks_backward_into, enumerate_adapters, parse_backends,
    AttentionOptions, AttentionShape, BiasView, Context, ContextOptions, DType, Error, GpuTensor,
    GpuTensorF16, HeadsView, KernelFamily, RelativeBuckets, SeqLens,
};

/// Scale of the cosine-scores cases.
const COSINE_SCALE: f32 = 10.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Suite {
    /// B=1, H=8, D=64, L in 256..1024, no mask and causal, fused and unfused, forward and backward.
    Default,
    /// A small preset that finishes in under a minute on lavapipe.
    Quick,
    /// Forward B=1, H=8, D=64 from L=1024 to 16384, fused and unfused (reported as skipped where
    /// its scores exceed the binding limit): time vs L^2, memory vs L. Long on CPU drivers.
    Scaling,
    /// For real GPUs: B=1 H=8 D=64 and B=4 H=16 D=128, L = 1024 to 16384, no mask and causal,
    /// forward and backward, both fused kernel families and the unfused path, f32 and f16.
    Gpu,
}

/// Element type of Q, K, V, O and the gradients (`--dtypes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Dtype {
    F32,
    /// f16 storage, f32 arithmetic: the GPU kernel family, fused path only (needs SHADER_F16).
    F16,
}

impl Dtype {
    fn dtype(self) -> DType {
        match self {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
        }
    }
}

/// Zero-filled outputs of either element type, kept alive (and counted) while viewed.
enum Outputs {
    F32(GpuTensor),
    F16(GpuTensorF16),
}

impl Outputs {
    fn zeros(ctx: &Context, shape: &[usize], dtype: DType) -> wgpu_attention::Result<Self> {
        Ok(match dtype {
            DType::F32 => Outputs::F32(GpuTensor::zeros(ctx, shape)?),
            DType::F16 => Outputs::F16(GpuTensorF16::zeros(ctx, shape)?),
        })
    }

    fn heads(&self) -> wgpu_attention::Result<HeadsView> {
        match self {
            Outputs::F32(t) => t.heads(),
            Outputs::F16(t) => t.heads(),
        }
    }

    fn to_vec(&self, ctx: &Context) -> wgpu_attention::Result<Vec<f32>> {
        match self {
            Outputs::F32(t) => t.to_vec(ctx),
            Outputs::F16(t) => t.to_vec(ctx),
        }
    }
}

/// A fused kernel family to run (`--kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Kernels {
    /// The CPU-driver family (rows in vec4 lanes, head-dim-sized registers).
    Cpu,
    /// The GPU family (tiles in workgroup memory, register micro-tiles, split-KV).
    Gpu,
}

impl Kernels {
    fn family(self) -> KernelFamily {
        match self {
            Kernels::Cpu => KernelFamily::CpuDriver,
            Kernels::Gpu => KernelFamily::Gpu,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mask {
    None,
    Causal,
    /// Per-batch key lengths: batch b keeps Lk * (4 - b % 4) / 4 keys.
    Padding,
    CausalPadding,
}

/// Score modifiers of a case (fused path only; the unfused baseline has none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Modifier {
    None,
    /// `30 tanh(s / 30)` (Gemma 2's cap).
    Softcap,
    Alibi,
    SoftcapAlibi,
    /// A learnable `[1, H, Lq, Lk]` bias; the backward includes its gradient (`d_bias`).
    Bias,
    /// T5 relative buckets (32, max distance 128; one-directional when causal) with the table's
    /// gradient in the backward.
    Relative,
    /// Attention sinks, with their gradient in the backward.
    Sinks,
    /// Cosine scores, scale 10.
    Cosine,
    /// Key-norm clipping at sqrt(Dk).
    Clip,
}

impl Modifier {
    fn softcap(self) -> Option<f32> {
        matches!(self, Modifier::Softcap | Modifier::SoftcapAlibi).then_some(30.0)
    }

    fn alibi(self) -> bool {
        matches!(self, Modifier::Alibi | Modifier::SoftcapAlibi)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PathKind {
    Fused,
    Unfused,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Pass {
    Forward,
    Backward,
    /// A pre-LN Transformer encoder layer (d_model = H * D, d_ff = 4 * d_model, GELU), forward and
    /// backward, fused attention. In the preset suites it runs at the shortest length only.
    Layer,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
            Pass::Layer => "layer fwd+bwd",
        }
    }
}

impl PathKind {
    fn name(self) -> &'static str {
        match self {
            PathKind::Fused => "fused",
            PathKind::Unfused => "unfused",
        }
    }
}

/// Validated attention benchmarks on any wgpu adapter.
#[derive(Parser, Debug)]
#[command(name = "attention-bench", version)]
struct Cli {
    /// List the adapters of every back end and exit.
    #[arg(long)]
    list_adapters: bool,
    /// Back end: vulkan, gl, metal, dx12 (default: WGPU_BACKEND, else all).
    #[arg(long)]
    backend: Option<String>,
    /// Case-insensitive substring of the adapter name (default: WGPU_ADAPTER_NAME).
    #[arg(long)]
    adapter: Option<String>,
    /// The case preset.
    #[arg(long, value_enum, default_value = "default")]
    suite: Suite,
    /// Shorthand for --suite quick.
    #[arg(long)]
    quick: bool,
    /// Batch size B (overrides the suite).
    #[arg(long)]
    batch: Option<usize>,
    /// Query heads H.
    #[arg(long)]
    heads: Option<usize>,
    /// Key/value heads Hkv (H % Hkv == 0; default H).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Query lengths Lq, comma separated.
    #[arg(long, value_delimiter = ',')]
    lengths: Option<Vec<usize>>,
    /// Key lengths Lk, comma separated, one per query length (default: Lk = Lq).
    #[arg(long, value_delimiter = ',')]
    kv_lengths: Option<Vec<usize>>,
    /// Head dim of Q and K (Dk).
    #[arg(long)]
    head_dim: Option<usize>,
    /// Head dim of V (Dv, default Dk).
    #[arg(long)]
    head_dim_v: Option<usize>,
    /// Mask kinds, comma separated.
    #[arg(long, value_enum, value_delimiter = ',')]
    masks: Option<Vec<Mask>>,
    /// Sliding windows, comma separated: with W, each query sees the W keys before its aligned
    /// position and that position (`window(W, 0)`, the causal sliding window of Mistral and Gemma 2,
    /// with or without --masks causal); 0 is no window. Default: no window.
    #[arg(long, value_delimiter = ',')]
    windows: Option<Vec<usize>>,
    /// Score modifiers, comma separated (fused path only; default none).
    #[arg(long, value_enum, value_delimiter = ',')]
    modifiers: Option<Vec<Modifier>>,
    /// Paths, comma separated.
    #[arg(long, value_enum, value_delimiter = ',')]
    paths: Option<Vec<PathKind>>,
    /// Passes, comma separated.
    #[arg(long, value_enum, value_delimiter = ',')]
    passes: Option<Vec<Pass>>,
    /// Fused kernel families, comma separated (default: the adapter's own; the gpu suite runs both).
    #[arg(long, value_enum, value_delimiter = ',')]
    kernels: Option<Vec<Kernels>>,
    /// Element types, comma separated (default f32; the gpu suite runs both). f16 cases run the
    /// fused GPU family only.
    #[arg(long, value_enum, value_delimiter = ',')]
    dtypes: Option<Vec<Dtype>>,
    /// Timed runs per case (after warm-up runs filling at least 0.3 s).
    #[arg(long)]
    reps: Option<usize>,
    /// Validate against the CPU reference only up to this many B*H*Lq*Lk*D multiply-adds.
    #[arg(long, default_value_t = 1 << 30)]
    validate_limit: u64,
    /// Time with the host clock even where GPU timestamps exist.
    #[arg(long)]
    wall_clock: bool,
    /// Write adapter info, git revision, cases and every figure as JSON.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write an SVG chart of GFLOP/s against sequence length per variant.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Print ratios against an earlier --json report.
    #[arg(long)]
    compare: Option<std::path::PathBuf>,
}

/// One problem size and mask; every (path, pass) of it is a measured case.
#[derive(Clone, Debug)]
struct Problem {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    q_len: usize,
    kv_len: usize,
    dk: usize,
    dv: usize,
    mask: Mask,
    modifier: Modifier,
    window: Option<usize>,
    dtype: DType,
}

impl Problem {
    fn label(&self) -> String {
        format!(
            "B{} H{}/{} Lq{} Lk{} D{}/{} {}{}",
            self.batch,
            self.heads,
            self.kv_heads,
            self.q_len,
            self.kv_len,
            self.dk,
            self.dv,
            self.mask_label(),
            match self.dtype {
                DType::F32 => "",
                DType::F16 => " f16",
            }
        )
    }

    /// The (path, kernel family) runs of this problem: f16 runs only the fused GPU family.
    fn runs(
        &self,
        paths: &[PathKind],
        families: &[KernelFamily],
    ) -> Vec<(PathKind, Option<KernelFamily>)> {
        let mut runs = Vec::new();
        for &path in paths {
            match path {
                PathKind::Fused if self.dtype == DType::F16 => {
                    runs.push((path, Some(KernelFamily::Gpu)))
                }
                PathKind::Fused => runs.extend(families.iter().map(|&f| (path, Some(f)))),
                // The unfused baseline has no score modifiers and no f16.
                PathKind::Unfused if self.modifier != Modifier::None => {}
                PathKind::Unfused if self.dtype == DType::F16 => {}
                PathKind::Unfused => runs.push((path, None)),
            }
        }
        runs
    }

    /// FLOPs of the case: `masked` (the customary count, causal halved), or under a window `full` times
    /// the fraction of (query, key) pairs the window leaves, so GFLOP/s counts only work that exists.
    fn counted_flops(&self, masked: f64, full: f64) -> f64 {
        let Some(w) = self.window else {
            return masked;
        };
        let shift = self.kv_len as i64 - self.q_len as i64;
        let seen: i64 = (0..self.q_len as i64)
            .map(|i| {
                let p = i + shift;
                (p.min(self.kv_len as i64 - 1) - (p - w as i64).max(0) + 1).max(0)
            })
            .sum();
        full * seen as f64 / (self.q_len * self.kv_len) as f64
    }

    /// The mask, and the score modifiers if any (`causal+softcap`).
    fn mask_label(&self) -> String {
        let modifier = match self.modifier {
            Modifier::None => "",
            Modifier::Softcap => "+softcap",
            Modifier::Alibi => "+alibi",
            Modifier::SoftcapAlibi => "+softcap+alibi",
            Modifier::Bias => "+bias",
            Modifier::Relative => "+relative",
            Modifier::Sinks => "+sinks",
            Modifier::Cosine => "+cosine",
            Modifier::Clip => "+clip",
        };
        let window = self.window.map_or(String::new(), |w| format!("+window{w}"));
        format!("{}{modifier}{window}", mask_name(self.mask))
    }

    fn causal(&self) -> bool {
        matches!(self.mask, Mask::Causal | Mask::CausalPadding)
    }

    fn kv_lens(&self) -> Option<Vec<u32>> {
        matches!(self.mask, Mask::Padding | Mask::CausalPadding).then(|| {
            (0..self.batch)
                .map(|b| (self.kv_len * (4 - b % 4) / 4).max(1) as u32)
                .collect()
        })
    }

    fn macs(&self) -> u64 {
        (self.batch * self.heads * self.q_len * self.kv_len * self.dk.max(self.dv)) as u64
    }
}

fn mask_name(m: Mask) -> &'static str {
    match m {
        Mask::None => "none",
        Mask::Causal => "causal",
        Mask::Padding => "padding",
        Mask::CausalPadding => "causal+padding",
    }
}

/// What one (problem, path, pass) produced.
struct CaseResult {
    id: String,
    problem: Problem,
    path: PathKind,
    /// `fused-gpu`, `fused-cpu` or `unfused`.
    path_label: String,
    /// The fused forward's plan (family, tiles, splits); empty on the unfused path.
    kernel: String,
    pass: Pass,
    outcome: std::result::Result<Measured, String>,
}

struct Measured {
    samples: Samples,
    gflops: f64,
    peak_bytes: u64,
    /// (checked, passed, worst ratio to tolerance, detail)
    validation: Option<(bool, f64, String)>,
}

fn usage_error(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("attention-bench: {message}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    // Before any thread starts: it may set NODEVICE_SELECT (see its documentation).
    wgpu_attention::quiet_headless_start_up();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // clap's message, its list of possible values if any, on one line.
            let text = e.to_string();
            let mut line = text
                .lines()
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ")
                .to_string();
            if let Some(values) = text.lines().find(|l| l.contains("possible values")) {
                line = format!("{line} {}", values.trim());
            }
            return usage_error(line);
        }
    };
    let backends = match cli.backend.as_deref().map(parse_backends).transpose() {
        Ok(b) => b,
        Err(e) => return usage_error(format!("--backend: {e}")),
    };
    if cli.list_adapters {
        return match enumerate_adapters(backends) {
            Ok(list) => {
                for info in list {
                    println!(
                        "{} ({:?}, {:?}, driver {} {})",
                        info.name, info.backend, info.device_type, info.driver, info.driver_info
                    );
                }
                ExitCode::SUCCESS
            }
            Err(e) => usage_error(e),
        };
    }
    let problems = match problems(&cli) {
        Ok(p) => p,
        Err(e) => return usage_error(e),
    };
    let ctx = match Context::new_with(&ContextOptions {
        backends,
        adapter_name: cli.adapter.clone(),
    }) {
        Ok(ctx) => ctx,
        Err(e @ Error::NoAdapter { .. }) => {
            let arg = if cli.adapter.is_some() {
                "--adapter"
            } else {
                "--backend"
            };
            return usage_error(format!("{arg}: {e}"));
        }
        Err(e @ Error::UnknownBackend(..)) => return usage_error(format!("WGPU_BACKEND: {e}")),
        Err(e) => return usage_error(e),
    };
    let mut ctx = ctx;
    match run(&cli, &mut ctx, &problems) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("attention-bench: {e}");
            ExitCode::from(1)
        }
    }
}

fn problems(cli: &Cli) -> std::result::Result<Vec<Problem>, String> {
    let suite = if cli.quick { Suite::Quick } else { cli.suite };
    let (lengths, heads, dk, masks): (Vec<usize>, usize, usize, Vec<Mask>) = match suite {
        Suite::Default => (vec![256, 512, 1024], 8, 64, vec![Mask::None, Mask::Causal]),
        Suite::Quick => (vec![128, 256], 4, 64, vec![Mask::None, Mask::Causal]),
        Suite::Scaling => (vec![1024, 2048, 4096, 8192, 16384], 8, 64, vec![Mask::None]),
        Suite::Gpu => (
            vec![1024, 2048, 4096, 8192, 16384],
            8,
            64,
            vec![Mask::None, Mask::Causal],
        ),
    };
    let lengths = cli.lengths.clone().unwrap_or(lengths);
    let heads = cli.heads.unwrap_or(heads);
    let kv_heads = cli.kv_heads.unwrap_or(heads);
    let batch = cli.batch.unwrap_or(1);
    let dk = cli.head_dim.unwrap_or(dk);
    let dv = cli.head_dim_v.unwrap_or(dk);
    let masks = cli.masks.clone().unwrap_or(masks);
    let dtypes: Vec<DType> = match (&cli.dtypes, suite) {
        (Some(d), _) => d.iter().map(|d| d.dtype()).collect(),
        (None, Suite::Gpu) => vec![DType::F32, DType::F16],
        (None, _) => vec![DType::F32],
    };
    if let Some(kv) = &cli.kv_lengths {
        if kv.len() != lengths.len() {
            return Err(format!(
                "--kv-lengths: {} values for {} --lengths; give one per query length",
                kv.len(),
                lengths.len()
            ));
        }
    }
    for (arg, v) in [
        ("--batch", batch),
        ("--heads", heads),
        ("--kv-heads", kv_heads),
        ("--head-dim", dk),
        ("--head-dim-v", dv),
    ] {
        if v == 0 {
            return Err(format!("{arg}: must be at least 1"));
        }
    }
    if !heads.is_multiple_of(kv_heads) {
        return Err(format!(
            "--kv-heads: {heads} query heads are not a multiple of {kv_heads} kv heads (H % Hkv must be 0)"
        ));
    }
    if let Some(l) = lengths
        .iter()
        .chain(cli.kv_lengths.iter().flatten())
        .find(|&&l| l == 0)
    {
        return Err(format!("--lengths: {l} is not a valid sequence length"));
    }
    let mut out = Vec::new();
    // The gpu suite adds B4 H16 D128 unless the sizes are given.
    let shapes = if suite == Suite::Gpu && cli.heads.is_none() && cli.head_dim.is_none() {
        vec![(batch, heads, kv_heads, dk, dv), (4, 16, 16, 128, 128)]
    } else {
        vec![(batch, heads, kv_heads, dk, dv)]
    };
    for (batch, heads, kv_heads, dk, dv) in shapes {
        push_problems(
            &mut out,
            cli,
            &lengths,
            masks.clone(),
            &dtypes,
            batch,
            heads,
            kv_heads,
            dk,
            dv,
        );
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn push_problems(
    out: &mut Vec<Problem>,
    cli: &Cli,
    lengths: &[usize],
    masks: Vec<Mask>,
    dtypes: &[DType],
    batch: usize,
    heads: usize,
    kv_heads: usize,
    dk: usize,
    dv: usize,
) {
    for (i, &q_len) in lengths.iter().enumerate() {
        let kv_len = cli.kv_lengths.as_ref().map_or(q_len, |kv| kv[i]);
        for &mask in &masks {
            for &modifier in cli.modifiers.as_deref().unwrap_or(&[Modifier::None]) {
                for &window in cli.windows.as_deref().unwrap_or(&[0]) {
                    for &dtype in dtypes {
                        out.push(Problem {
                            batch,
                            heads,
                            kv_heads,
                            q_len,
                            kv_len,
                            dk,
                            dv,
                            mask,
                            modifier,
                            window: (window > 0).then_some(window),
                            dtype,
                        });
                    }
                }
            }
        }
    }
}

fn reps(cli: &Cli) -> usize {
    let suite = if cli.quick { Suite::Quick } else { cli.suite };
    cli.reps.unwrap_or(match suite {
        Suite::Default => 5,
        Suite::Quick => 3,
        Suite::Scaling | Suite::Gpu => 2,
    })
}

fn random(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

struct Progress {
    total: usize,
    done: usize,
    tty: bool,
}

impl Progress {
    fn step(&mut self, what: &str) {
        self.done += 1;
        let line = format!("[{}/{}] {what}", self.done, self.total);
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }

    /// A line that stays (a skipped path, say), on stderr.
    fn note(&self, what: &str) {
        let mut err = std::io::stderr();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K");
        }
        let _ = writeln!(err, "note: {what}");
    }

    fn finish(&self) {
        if self.tty {
            eprint!("\r\x1b[2K");
        }
    }
}

fn run(cli: &Cli, ctx: &mut Context, problems: &[Problem]) -> wgpu_attention::Result<bool> {
    let timer = Timer::new(ctx, cli.wall_clock);
    let reps = reps(cli);
    let report = ctx.report();
    println!("adapter: {report}");
    let peak = fma_peak_gflops(ctx, &timer)?;
    println!(
        "clock: {}; {reps} timed runs per case after a warm-up; FMA peak {peak:.1} GFLOP/s (measured)",
        timer.clock().name()
    );
    let paths = cli
        .paths
        .clone()
        .unwrap_or(vec![PathKind::Fused, PathKind::Unfused]);
    let suite = if cli.quick { Suite::Quick } else { cli.suite };
    let passes = cli.passes.clone().unwrap_or(match suite {
        // The scaling study is about the fused forward's time and memory against L.
        Suite::Scaling => vec![Pass::Forward],
        _ => vec![Pass::Forward, Pass::Backward, Pass::Layer],
    });
    // The layer case runs at the shortest length of a preset suite, at every one when asked for.
    let shortest = problems.iter().map(|p| p.q_len).min().unwrap_or(0);
    let families: Vec<KernelFamily> = match (&cli.kernels, suite) {
        (Some(k), _) => k.iter().map(|k| k.family()).collect(),
        (None, Suite::Gpu) => vec![KernelFamily::CpuDriver, KernelFamily::Gpu],
        (None, _) => vec![ctx.kernel_family()],
    };
    let layer_at = |p: &Problem| {
        (cli.passes.is_some() || p.q_len == shortest)
            && matches!(p.mask, Mask::None | Mask::Causal)
            && p.modifier == Modifier::None
            && p.window.is_none()
            && p.q_len == p.kv_len
            && p.heads == p.kv_heads
            && p.dk == p.dv
            && p.dtype == DType::F32
    };
    let total = problems
        .iter()
        .map(|p| {
            let runs = p.runs(&paths, &families).len();
            runs * passes.iter().filter(|&&x| x != Pass::Layer).count()
                + families.len() * usize::from(passes.contains(&Pass::Layer) && layer_at(p))
        })
        .sum();
    let mut progress = Progress {
        total,
        done: 0,
        tty: std::io::stderr().is_terminal(),
    };
    let mut results = Vec::new();
    for problem in problems {
        results.extend(run_problem(
            ctx,
            &timer,
            reps,
            cli.validate_limit,
            layer_at(problem),
            problem,
            &paths,
            &families,
            &passes,
            &mut progress,
        )?);
    }
    progress.finish();

    print_table(&results, peak);
    let failed: Vec<&CaseResult> = results
        .iter()
        .filter(|r| {
            matches!(
                &r.outcome,
                Ok(Measured {
                    validation: Some((false, _, _)),
                    ..
                })
            )
        })
        .collect();
    let base = match &cli.compare {
        Some(path) => Some(read_json(path)?),
        None => None,
    };
    if let Some(base) = &base {
        print_comparison(&results, base);
    }
    ctx.set_kernel_family(None);
    let doc = report_json(ctx, &timer, peak, reps, &results);
    if let Some(path) = &cli.json {
        wgpu_attention::bench::write_report(
            path,
            &serde_json::to_string_pretty(&doc).unwrap_or_default(),
        )?;
    }
    if let Some(path) = &cli.plot {
        wgpu_attention::bench::write_report(path, &svg_plot(&results))?;
    }
    if failed.is_empty() {
        Ok(true)
    } else {
        eprintln!("\n!!!!!!!! VALIDATION FAILED !!!!!!!!");
        for r in failed {
            if let Ok(Measured {
                validation: Some((_, ratio, detail)),
                ..
            }) = &r.outcome
            {
                eprintln!(
                    "  {}: worst error {ratio:.2}x the tolerance ({detail})",
                    r.id
                );
            }
        }
        Ok(false)
    }
}

/// GPU inputs of one problem and their CPU copies.
struct Inputs {
    q: HeadsView,
    k: HeadsView,
    v: HeadsView,
    d_out: HeadsView,
    host: [Vec<f32>; 4],
    seq_lens: Option<SeqLens>,
    /// The case's learned score terms: bias `[1, H, Lq, Lk]`, relative table `[H, 32]`, sinks `[H]`
    /// (values and, in the backward, gradient tensors).
    bias: Option<(BiasView, Vec<f32>, GpuTensor)>,
    relative: Option<(RelativeBuckets, GpuTensor, Vec<f32>, GpuTensor)>,
    sinks: Option<(GpuTensor, Vec<f32>, GpuTensor)>,
}

#[allow(clippy::too_many_arguments)]
fn run_problem(
    ctx: &mut Context,
    timer: &Timer,
    reps: usize,
    validate_limit: u64,
    with_layer: bool,
    p: &Problem,
    paths: &[PathKind],
    families: &[KernelFamily],
    passes: &[Pass],
    progress: &mut Progress,
) -> wgpu_attention::Result<Vec<CaseResult>> {
    let n_q = p.batch * p.q_len * p.heads;
    let n_kv = p.batch * p.kv_len * p.kv_heads;
    // f16 cases: the reference sees the f16-rounded inputs the GPU reads.
    let round = |x: Vec<f32>| match p.dtype {
        DType::F32 => x,
        DType::F16 => x
            .into_iter()
            .map(|v| half::f16::from_f32(v).to_f32())
            .collect(),
    };
    let host = [
        round(random(n_q * p.dk, 1)),
        round(random(n_kv * p.dk, 2)),
        round(random(n_kv * p.dv, 3)),
        round(random(n_q * p.dv, 4)),
    ];
    let up = |data: &[f32], l: usize, h: usize, d: usize| match p.dtype {
        DType::F32 => GpuTensor::from_slice(ctx, data, &[p.batch, l, h, d]).and_then(|t| t.heads()),
        DType::F16 => {
            GpuTensorF16::from_f32(ctx, data, &[p.batch, l, h, d]).and_then(|t| t.heads())
        }
    };
    let inputs = Inputs {
        q: up(&host[0], p.q_len, p.heads, p.dk)?,
        k: up(&host[1], p.kv_len, p.kv_heads, p.dk)?,
        v: up(&host[2], p.kv_len, p.kv_heads, p.dv)?,
        d_out: up(&host[3], p.q_len, p.heads, p.dv)?,
        seq_lens: p
            .kv_lens()
            .map(|kv| SeqLens::new(ctx, None, Some(&kv)))
            .transpose()?,
        host,
        bias: None,
        relative: None,
        sinks: None,
    };
    let mut inputs = inputs;
    let h = p.heads;
    match p.modifier {
        Modifier::Bias => {
            let shape = [1, h, p.q_len, p.kv_len];
            let values = random(h * p.q_len * p.kv_len, 5);
            let t = GpuTensor::from_slice(ctx, &values, &shape)?;
            inputs.bias = Some((BiasView::of(&t)?, values, GpuTensor::zeros(ctx, &shape)?));
        }
        Modifier::Relative => {
            let buckets = RelativeBuckets::new(32, 128, !p.causal());
            let values = random(h * 32, 6);
            let table = GpuTensor::from_slice(ctx, &values, &[h, 32])?;
            let grad = GpuTensor::zeros(ctx, &[h, 32])?;
            inputs.relative = Some((buckets, table, values, grad));
        }
        Modifier::Sinks => {
            let values = random(h, 7);
            let sinks = GpuTensor::from_slice(ctx, &values, &[h])?;
            inputs.sinks = Some((sinks, values, GpuTensor::zeros(ctx, &[h])?));
        }
        _ => {}
    }
    let inputs = inputs;
    let shape = AttentionShape::of(&inputs.q, &inputs.k, &inputs.v)?;
    let mut opts = AttentionOptions::new()
        .causal(p.causal())
        .alibi(p.modifier.alibi());
    if let Some(cap) = p.modifier.softcap() {
        opts = opts.softcap(cap);
    }
    if let Some(w) = p.window {
        opts = opts.window(w, 0);
    }
    if let Some(lens) = &inputs.seq_lens {
        opts = opts.seq_lens(lens);
    }
    if let Some((bias, _, _)) = &inputs.bias {
        opts = opts.bias(bias);
    }
    if let Some((buckets, table, _, grad)) = &inputs.relative {
        opts = opts.relative_buckets_learned(*buckets, table, grad);
    }
    if let Some((sinks, _, _)) = &inputs.sinks {
        opts = opts.sinks(sinks);
    }
    if p.modifier == Modifier::Cosine {
        opts = opts.cosine(COSINE_SCALE);
    }
    if p.modifier == Modifier::Clip {
        opts = opts.key_norm_clip((p.dk as f32).sqrt());
    }
    let validate = p.macs() <= validate_limit;
    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let masks = Masks {
        scale: match p.modifier {
            Modifier::Cosine => COSINE_SCALE as f64,
            _ => 1.0 / (p.dk as f64).sqrt(),
        },
        bias: inputs.bias.as_ref().map(|(_, values, _)| Bias {
            values: f64s(values),
            batch: 1,
            heads: p.heads,
        }),
        relative: inputs
            .relative
            .as_ref()
            .map(|(buckets, _, values, _)| (buckets.reference(), f64s(values))),
        sinks: inputs.sinks.as_ref().map(|(_, values, _)| f64s(values)),
        normalize_qk: p.modifier == Modifier::Cosine,
        key_clip: (p.modifier == Modifier::Clip).then(|| (p.dk as f64).sqrt()),
        causal: p.causal(),
        q_lens: None,
        kv_lens: p.kv_lens(),
        softcap: p.modifier.softcap().map(f64::from),
        alibi: p.modifier.alibi(),
        window: p.window.map(|w| (w, 0)),
        ..Default::default()
    };
    let reference_forward = validate.then(|| {
        reference::attention_forward(
            &shape,
            &f64s(&inputs.host[0]),
            &f64s(&inputs.host[1]),
            &f64s(&inputs.host[2]),
            &masks,
        )
    });
    let reference_backward = (validate && passes.contains(&Pass::Backward)).then(|| {
        reference::attention_backward(
            &shape,
            &f64s(&inputs.host[0]),
            &f64s(&inputs.host[1]),
            &f64s(&inputs.host[2]),
            &f64s(&inputs.host[3]),
            &masks,
        )
    });

    let mut results = Vec::new();
    if paths.contains(&PathKind::Unfused) && p.modifier != Modifier::None {
        progress.note(&format!(
            "unfused baseline skipped for {}: it has no score modifiers (it refuses them by name)",
            p.label()
        ));
    } else if paths.contains(&PathKind::Unfused) && p.dtype == DType::F16 {
        progress.note(&format!(
            "unfused baseline skipped for {}: it is f32 only",
            p.label()
        ));
    }
    for (path, family) in p.runs(paths, families) {
        ctx.set_kernel_family(family);
        let ctx: &Context = ctx;
        let path_label = match family {
            Some(f) => format!("{}-{}", path.name(), f.name()),
            None => path.name().to_string(),
        };
        let kernel = match family {
            Some(_) => attention_forward_plan(ctx, &shape)?.to_string(),
            None => String::new(),
        };
        for &pass in passes {
            let layer = pass == Pass::Layer;
            if layer && (path != PathKind::Fused || !with_layer) {
                continue;
            }
            let id = format!("{} {} {}", pass.name(), path_label, p.label());
            progress.step(&id);
            let outcome = if layer {
                run_layer_case(ctx, timer, reps, validate_limit, p)
            } else {
                run_case(
                    ctx,
                    timer,
                    reps,
                    p,
                    &shape,
                    &inputs,
                    &opts,
                    path,
                    pass,
                    reference_forward.as_ref(),
                    reference_backward.as_ref(),
                )
            };
            let outcome = match outcome {
                Ok(m) => Ok(m),
                // Sizes, element types and features the path cannot run (binding or buffer limits,
                // f16 without SHADER_F16 or with an f32-only term) are reported, not fatal.
                Err(
                    e @ (Error::BindingTooLarge { .. }
                    | Error::Unsupported { .. }
                    | Error::DType { .. }
                    | Error::MissingFeature { .. }),
                ) => Err(e.to_string()),
                Err(e) => return Err(e),
            };
            results.push(CaseResult {
                id,
                problem: p.clone(),
                path,
                path_label: path_label.clone(),
                kernel: kernel.clone(),
                pass,
                outcome,
            });
        }
    }
    Ok(results)
}

/// A pre-LN Transformer layer ([`LayerCase`]: the library's `EncoderLayer`, causal in causal cases)
/// of width H * D over the problem's batch and length, forward and backward with every gradient in
/// one submission, validated against the reference layer where affordable.
fn run_layer_case(
    ctx: &Context,
    timer: &Timer,
    reps: usize,
    validate_limit: u64,
    p: &Problem,
) -> wgpu_attention::Result<Measured> {
    let d = p.heads * p.dk;
    let config = TransformerLayerConfig {
        d_model: d,
        heads: p.heads,
        d_ff: 4 * d,
        causal: p.causal(),
        pre_ln: true,
    };
    let n = p.batch * p.q_len * d;
    let (x, dy) = (random(n, 5), random(n, 6));
    ctx.reset_peak_memory();
    let base = ctx.memory().current_bytes;
    let layer = LayerCase::new(ctx, config, p.batch, p.q_len, &x, &dy, 1)?;
    let samples = measure(ctx, timer, reps, || layer.run(ctx))?;
    let peak_bytes = ctx.memory().peak_bytes.saturating_sub(base);
    let tokens = (p.batch * p.q_len) as f64;
    let matmul = 2.0 * tokens * (4.0 * (d * d) as f64 + 2.0 * (d * config.d_ff) as f64);
    let attention = 4.0 * (p.batch * p.heads) as f64 * (p.q_len * p.q_len * p.dk) as f64
        / if p.causal() { 2.0 } else { 1.0 };
    // Forward products once, their two backward products, attention forward and its 2.5x backward.
    let gflop = (3.0 * matmul + 3.5 * attention) / 1e9;
    let layer_macs = (tokens as u64) * (4 * d * d + 2 * d * config.d_ff) as u64 + p.macs();
    let validation = if layer_macs <= validate_limit {
        let got = layer.results(ctx)?;
        let p64 = layer.reference_params(ctx)?;
        let (x64, dy64): (Vec<f64>, Vec<f64>) = (
            x.iter().map(|&v| v as f64).collect(),
            dy.iter().map(|&v| v as f64).collect(),
        );
        let ry = reference_layer::forward(&config, &p64, &x64, p.batch, p.q_len);
        let (rdx, rgrads) = reference_layer::backward(&config, &p64, &x64, &dy64, p.batch, p.q_len);
        let mut worst = (0.0f64, String::new());
        let mut check = |name: &str, gpu: Vec<f32>, r: &[f64], atol: f64, rtol: f64| {
            let c = compare(&gpu, r, atol, rtol);
            if c.worst_ratio >= worst.0 || worst.1.is_empty() {
                worst = (
                    c.worst_ratio,
                    format!("{name}[{}]: |gpu - ref| = {:.3e}", c.index, c.worst_abs),
                );
            }
        };
        check("y", got.y, &ry, FORWARD_ATOL, FORWARD_RTOL);
        check("dx", got.dx, &rdx, BACKWARD_ATOL, BACKWARD_RTOL);
        let names = reference_layer::param_shapes(&config);
        for (((name, _), g), r) in names.iter().zip(got.grads).zip(&rgrads) {
            check(name, g, r, BACKWARD_ATOL, BACKWARD_RTOL);
        }
        Some((worst.0 <= 1.0, worst.0, worst.1))
    } else {
        None
    };
    Ok(Measured {
        gflops: gflop / (samples.median() * 1e-3),
        samples,
        peak_bytes,
        validation,
    })
}

/// (name, GPU result, reference (empty if not validated), atol, rtol).
type Check<'a> = (&'static str, Vec<f32>, &'a [f64], f64, f64);

#[allow(clippy::too_many_arguments)]
fn run_case(
    ctx: &Context,
    timer: &Timer,
    reps: usize,
    p: &Problem,
    shape: &AttentionShape,
    x: &Inputs,
    opts: &AttentionOptions<'_>,
    path: PathKind,
    pass: Pass,
    reference_forward: Option<&(Vec<f64>, Vec<f64>)>,
    reference_backward: Option<&reference::Grads>,
) -> wgpu_attention::Result<Measured> {
    let s = shape;
    let causal = opts.causal;
    // Peak memory counts every tensor the case allocates beyond Q, K, V and dO: outputs, the saved
    // forward (backward cases), workspaces and anything the call allocates itself.
    ctx.reset_peak_memory();
    let base = ctx.memory().current_bytes;
    // Outputs of the fused path are allocated once and reused by every run.
    let out = Outputs::zeros(ctx, &[s.batch, s.q_seq, s.heads, s.head_dim_v], p.dtype)?;
    let lse = GpuTensor::zeros(ctx, &[s.batch, s.heads, s.q_seq])?;
    let (forward_atol, forward_rtol, backward_atol, backward_rtol) = match p.dtype {
        DType::F32 => (FORWARD_ATOL, FORWARD_RTOL, BACKWARD_ATOL, BACKWARD_RTOL),
        DType::F16 => (F16_FORWARD_ATOL, F16_RTOL, F16_BACKWARD_ATOL, F16_RTOL),
    };
    let fused_forward = || -> wgpu_attention::Result<()> {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        attention_forward_into(
            ctx,
            &mut encoder,
            &x.q,
            &x.k,
            &x.v,
            &out.heads()?,
            &lse,
            opts,
        )?;
        ctx.queue().submit([encoder.finish()]);
        Ok(())
    };
    let (mut checks, gflop, samples): (Vec<Check<'_>>, f64, Samples);
    match pass {
        Pass::Forward => {
            gflop = p.counted_flops(s.forward_flops(causal), s.forward_flops(false)) / 1e9;
            match path {
                PathKind::Fused => {
                    samples = measure(ctx, timer, reps, fused_forward)?;
                    checks = vec![
                        ("out", out.to_vec(ctx)?, &[], forward_atol, forward_rtol),
                        ("lse", lse.to_vec(ctx)?, &[], FORWARD_ATOL, FORWARD_RTOL),
                    ];
                }
                PathKind::Unfused => {
                    let mut last = None;
                    samples = measure(ctx, timer, reps, || {
                        last = Some(attention_forward_unfused(ctx, &x.q, &x.k, &x.v, opts)?);
                        Ok(())
                    })?;
                    let last = last.expect("measured at least once");
                    checks = vec![
                        (
                            "out",
                            last.out.to_vec(ctx)?,
                            &[],
                            FORWARD_ATOL,
                            FORWARD_RTOL,
                        ),
                        (
                            "lse",
                            last.lse.to_vec(ctx)?,
                            &[],
                            FORWARD_ATOL,
                            FORWARD_RTOL,
                        ),
                    ];
                }
            }
            if let Some((r_out, r_lse)) = reference_forward {
                checks[0].2 = r_out;
                checks[1].2 = r_lse;
            }
        }
        // Layer cases are measured by run_layer_case and never reach here.
        Pass::Backward | Pass::Layer => {
            gflop = p.counted_flops(s.backward_flops(causal), s.backward_flops(false)) / 1e9;
            fused_forward()?;
            let dq = Outputs::zeros(ctx, &[s.batch, s.q_seq, s.heads, s.head_dim_qk], p.dtype)?;
            let dk_shape = [s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk];
            let dk = Outputs::zeros(ctx, &dk_shape, p.dtype)?;
            let dv_shape = [s.batch, s.kv_seq, s.kv_heads, s.head_dim_v];
            let dv = Outputs::zeros(ctx, &dv_shape, p.dtype)?;
            let workspace = attention_backward_workspace(ctx, s)?;
            let grads = match path {
                PathKind::Fused => {
                    samples = measure(ctx, timer, reps, || {
                        let mut encoder = ctx.device().create_command_encoder(&Default::default());
                        attention_backward_into(
                            ctx,
                            &mut encoder,
                            &x.q,
                            &x.k,
                            &x.v,
                            &out.heads()?,
                            &lse,
                            &x.d_out,
                            &dq.heads()?,
                            &dk.heads()?,
                            &dv.heads()?,
                            &workspace,
                            opts,
                        )?;
                        // The learned score terms' gradients belong to the backward (the
                        // relative table's is written by attention_backward_into itself).
                        if let Some((_, _, grad)) = &x.bias {
                            attention_bias_backward_into(
                                ctx,
                                &mut encoder,
                                &x.q,
                                &x.k,
                                &x.v,
                                &x.d_out,
                                &workspace,
                                grad,
                                opts,
                            )?;
                        }
                        if let Some((sinks, _, d_sinks)) = &x.sinks {
                            attention_sinks_backward_into(
                                ctx,
                                &mut encoder,
                                s,
                                sinks,
                                &workspace,
                                d_sinks,
                                opts,
                            )?;
                        }
                        ctx.queue().submit([encoder.finish()]);
                        Ok(())
                    })?;
                    [dq.to_vec(ctx)?, dk.to_vec(ctx)?, dv.to_vec(ctx)?]
                }
                PathKind::Unfused => {
                    let mut last = None;
                    samples = measure(ctx, timer, reps, || {
                        last = Some(attention_backward_unfused(
                            ctx, &x.q, &x.k, &x.v, &x.d_out, opts,
                        )?);
                        Ok(())
                    })?;
                    let g = last.expect("measured at least once");
                    [g.dq.to_vec(ctx)?, g.dk.to_vec(ctx)?, g.dv.to_vec(ctx)?]
                }
            };
            let [gq, gk, gv] = grads;
            checks = vec![
                ("dq", gq, &[], backward_atol, backward_rtol),
                ("dk", gk, &[], backward_atol, backward_rtol),
                ("dv", gv, &[], backward_atol, backward_rtol),
            ];
            if let Some(r) = reference_backward {
                checks[0].2 = &r.dq;
                checks[1].2 = &r.dk;
                checks[2].2 = &r.dv;
            }
        }
    }
    let peak_bytes = ctx.memory().peak_bytes.saturating_sub(base);
    let validated = checks.iter().all(|c| !c.2.is_empty());
    let validation = validated.then(|| {
        let mut worst = (0.0f64, String::new());
        for (name, gpu, reference, atol, rtol) in &checks {
            let c = compare(gpu, reference, *atol, *rtol);
            if c.worst_ratio >= worst.0 || worst.1.is_empty() {
                worst = (
                    c.worst_ratio,
                    format!("{name}[{}]: |gpu - ref| = {:.3e}", c.index, c.worst_abs),
                );
            }
        }
        (worst.0 <= 1.0, worst.0, worst.1)
    });
    Ok(Measured {
        gflops: gflop / (samples.median() * 1e-3),
        samples,
        peak_bytes,
        validation,
    })
}

fn print_table(results: &[CaseResult], peak: f64) {
    println!();
    println!("| pass | path | dtype | kernel | mask | B | H/Hkv | Lq | Lk | Dk/Dv | median ms | min-max ms | GFLOP/s | % of FMA peak | peak MiB | validation |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in results {
        let p = &r.problem;
        let head = format!(
            "| {} | {} | {} | {} | {} | {} | {}/{} | {} | {} | {}/{} |",
            r.pass.name(),
            r.path_label,
            p.dtype.name(),
            r.kernel,
            p.mask_label(),
            p.batch,
            p.heads,
            p.kv_heads,
            p.q_len,
            p.kv_len,
            p.dk,
            p.dv
        );
        match &r.outcome {
            Ok(m) => println!(
                "{head} {:.2} | {:.2}-{:.2} | {:.2} | {:.1}% | {:.2} | {} |",
                m.samples.median(),
                m.samples.min(),
                m.samples.max(),
                m.gflops,
                100.0 * m.gflops / peak,
                m.peak_bytes as f64 / (1024.0 * 1024.0),
                match &m.validation {
                    None => "not checked (size)".to_string(),
                    Some((true, ratio, _)) => format!("ok ({:.1}% of tol)", ratio * 100.0),
                    Some((false, ratio, _)) => format!("**FAILED** ({ratio:.1}x tol)"),
                }
            ),
            Err(e) => println!("{head} skipped: {e} | | | | | |"),
        }
    }
    // Fused vs unfused and backward vs forward, where both were measured.
    let find = |id: String| {
        results
            .iter()
            .find(|r| r.id == id)
            .and_then(|r| r.outcome.as_ref().ok())
            .map(|m| m.samples.median())
    };
    let mut lines = Vec::new();
    for r in results.iter().filter(|r| r.path == PathKind::Fused) {
        let label = r.problem.label();
        let pass = r.pass.name();
        let path = &r.path_label;
        let fused = find(format!("{pass} {path} {label}"));
        let unfused = find(format!("{pass} unfused {label}"));
        let ratio_bf = (r.pass == Pass::Backward)
            .then(|| {
                Some(
                    find(format!("backward {path} {label}"))?
                        / find(format!("forward {path} {label}"))?,
                )
            })
            .flatten();
        if let (Some(f), Some(u)) = (fused, unfused) {
            lines.push(format!(
                "| {pass} | {path} | {label} | {:.2}x | {} |",
                u / f,
                ratio_bf.map_or("".into(), |x| format!("{x:.2}"))
            ));
        } else if let Some(x) = ratio_bf {
            lines.push(format!("| {pass} | {path} | {label} | | {x:.2} |"));
        }
    }
    if !lines.is_empty() {
        println!(
            "\n| pass | path | problem | fused speed-up over unfused | fused backward / fused forward |"
        );
        println!("|---|---|---|---|---|");
        for l in lines {
            println!("{l}");
        }
    }
}

/// The checked-out revision, `-dirty` when the tree has uncommitted changes.
fn git_revision() -> String {
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn report_json(
    ctx: &Context,
    timer: &Timer,
    peak: f64,
    reps: usize,
    results: &[CaseResult],
) -> Value {
    let r = ctx.report();
    let l = &r.limits;
    let cases: Vec<Value> = results
        .iter()
        .map(|c| {
            let p = &c.problem;
            let mut v = json!({
                "id": c.id,
                "pass": c.pass.name(),
                "path": c.path_label,
                "kernel": c.kernel,
                "dtype": p.dtype.name(),
                "mask": mask_name(p.mask),
                "modifier": format!("{:?}", p.modifier).to_lowercase(),
                "window": p.window,
                "batch": p.batch, "heads": p.heads, "kv_heads": p.kv_heads,
                "q_len": p.q_len, "kv_len": p.kv_len,
                "head_dim_qk": p.dk, "head_dim_v": p.dv,
                "kv_lens": p.kv_lens(),
            });
            match &c.outcome {
                Ok(m) => {
                    v["times_ms"] = json!(m.samples.times_ms);
                    v["median_ms"] = json!(m.samples.median());
                    v["min_ms"] = json!(m.samples.min());
                    v["max_ms"] = json!(m.samples.max());
                    v["gflops"] = json!(m.gflops);
                    v["fraction_of_fma_peak"] = json!(m.gflops / peak);
                    v["peak_memory_bytes"] = json!(m.peak_bytes);
                    v["validation"] = match &m.validation {
                        None => json!({"checked": false}),
                        Some((passed, ratio, detail)) => json!({
                            "checked": true, "passed": passed,
                            "worst_ratio_to_tolerance": ratio, "worst": detail
                        }),
                    };
                }
                Err(e) => v["skipped"] = json!(e),
            }
            v
        })
        .collect();
    json!({
        "tool": "attention-bench",
        "version": env!("CARGO_PKG_VERSION"),
        "git_revision": git_revision(),
        "adapter": {
            "name": r.name,
            "backend": format!("{:?}", r.backend),
            "device_type": format!("{:?}", r.device_type),
            "driver": r.driver,
            "driver_info": r.driver_info,
            "features": format!("{:?}", r.features),
            "limits": {
                "max_compute_workgroup_storage_size": l.max_compute_workgroup_storage_size,
                "max_compute_invocations_per_workgroup": l.max_compute_invocations_per_workgroup,
                "max_storage_buffer_binding_size": l.max_storage_buffer_binding_size,
                "max_buffer_size": l.max_buffer_size,
                "max_storage_buffers_per_shader_stage": l.max_storage_buffers_per_shader_stage,
                "max_compute_workgroups_per_dimension": l.max_compute_workgroups_per_dimension,
            },
            "loop_budget": ctx.loop_budget(),
        },
        "clock": timer.clock().name(),
        "reps": reps,
        "fma_peak_gflops": peak,
        "cases": cases,
    })
}

fn read_json(path: &std::path::Path) -> wgpu_attention::Result<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Device(format!("--compare {}: {e}", path.display())))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Device(format!("--compare {}: not a report: {e}", path.display())))
}

fn print_comparison(results: &[CaseResult], base: &Value) {
    let empty = Vec::new();
    let base_cases = base["cases"].as_array().unwrap_or(&empty);
    println!(
        "\nvs {} on {} (speed-up = base median / this median):",
        base["git_revision"].as_str().unwrap_or("?"),
        base["adapter"]["name"].as_str().unwrap_or("?")
    );
    println!("| case | base ms | this ms | speed-up |");
    println!("|---|---|---|---|");
    for r in results {
        let Ok(m) = &r.outcome else { continue };
        let base_ms = base_cases
            .iter()
            .find(|c| c["id"].as_str() == Some(r.id.as_str()))
            .and_then(|c| c["median_ms"].as_f64());
        match base_ms {
            Some(b) => println!(
                "| {} | {b:.2} | {:.2} | {:.2}x |",
                r.id,
                m.samples.median(),
                b / m.samples.median()
            ),
            None => println!("| {} | - | {:.2} | not in base |", r.id, m.samples.median()),
        }
    }
}

/// GFLOP/s against Lq (log2 axis), one line per (pass, path, mask) variant.
fn svg_plot(results: &[CaseResult]) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in results {
        if let Ok(m) = &r.outcome {
            let name = format!(
                "{} {} {}",
                r.pass.name(),
                r.path_label,
                r.problem.mask_label()
            );
            series
                .entry(name)
                .or_default()
                .push((r.problem.q_len as f64, m.gflops));
        }
    }
    let (w, h, left, right, top, bottom) = (760.0, 440.0, 70.0, 230.0, 30.0, 50.0);
    let points: Vec<(f64, f64)> = series.values().flatten().copied().collect();
    let x_min = points
        .iter()
        .map(|p| p.0.log2())
        .fold(f64::INFINITY, f64::min);
    let x_max = points
        .iter()
        .map(|p| p.0.log2())
        .fold(f64::NEG_INFINITY, f64::max);
    let y_max = points.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
    let x_span = (x_max - x_min).max(1.0);
    let px = |l: f64| left + (l.log2() - x_min) / x_span * (w - left - right);
    let py = |g: f64| h - bottom - g / y_max * (h - top - bottom);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{left}" y="18" font-size="14">attention-bench: GFLOP/s vs sequence length</text>"#
    );
    let (x0, y0, x1, y1) = (left, h - bottom, w - right, top);
    let _ = writeln!(
        svg,
        r#"<path d="M{x0},{y1} L{x0},{y0} L{x1},{y0}" stroke="black" fill="none"/>"#
    );
    for i in 0..=4 {
        let g = y_max * i as f64 / 4.0;
        let y = py(g);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{g:.1}</text>"##,
            x0 - 6.0,
            y + 4.0
        );
    }
    let mut lengths: Vec<f64> = points.iter().map(|p| p.0).collect();
    lengths.sort_by(f64::total_cmp);
    lengths.dedup();
    for l in lengths {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{l}</text>"#,
            px(l),
            y0 + 18.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">Lq (log scale)</text>"#,
        (x0 + x1) / 2.0,
        h - 10.0
    );
    let colors = [
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
        "#bcbd22", "#17becf",
    ];
    for (i, (name, mut pts)) in series.into_iter().enumerate() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = colors[i % colors.len()];
        let d: Vec<String> = pts
            .iter()
            .map(|&(l, g)| format!("{:.1},{:.1}", px(l), py(g)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            d.join(" ")
        );
        for &(l, g) in &pts {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                px(l),
                py(g)
            );
        }
        let ly = top + 16.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{name}</text>"#,
            x1 + 10.0,
            x1 + 30.0,
            x1 + 36.0,
            ly + 4.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}
