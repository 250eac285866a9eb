//! The command line: the option enums, `Cli`, and the repetitions per suite.

use clap::{Parser, ValueEnum};

use wgpu_attention::{DType, KernelFamily};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Suite {
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
pub(crate) enum Dtype {
    F32,
    /// f16 storage, f32 arithmetic: the GPU kernel family, fused path only (needs SHADER_F16).
    F16,
}

impl Dtype {
    pub(crate) fn dtype(self) -> DType {
        match self {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
        }
    }
}

/// A fused kernel family to run (`--kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Kernels {
    /// The CPU-driver family (rows in vec4 lanes, head-dim-sized registers).
    Cpu,
    /// The GPU family (tiles in workgroup memory, register micro-tiles, split-KV).
    Gpu,
    /// The tensor-core family (16x16 f16 tile multiply-adds; the portable build where the adapter
    /// has no cooperative matrices). f16 accuracy.
    Coop,
}

impl Kernels {
    pub(crate) fn family(self) -> KernelFamily {
        match self {
            Kernels::Cpu => KernelFamily::CpuDriver,
            Kernels::Gpu => KernelFamily::Gpu,
            Kernels::Coop => KernelFamily::Coop,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mask {
    None,
    Causal,
    /// Per-batch key lengths: batch b keeps Lk * (4 - b % 4) / 4 keys.
    Padding,
    CausalPadding,
    /// A variable-length batch, padded: sequence b has L * (4 - b % 4) / 4 queries and keys
    /// (`q_lens` and `kv_lens`; needs Lq = Lk).
    Varlen,
    CausalVarlen,
    /// The same sequences packed one after another (`SeqLens::packed`, `[rows, H, D]` tensors, no
    /// padding rows): compare with `varlen` in one run. Fused path only.
    Packed,
    CausalPacked,
}

/// Score modifiers of a case (fused path only; the unfused baseline has none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Modifier {
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
    pub(crate) fn softcap(self) -> Option<f32> {
        matches!(self, Modifier::Softcap | Modifier::SoftcapAlibi).then_some(30.0)
    }

    pub(crate) fn alibi(self) -> bool {
        matches!(self, Modifier::Alibi | Modifier::SoftcapAlibi)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum PathKind {
    Fused,
    Unfused,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Pass {
    Forward,
    Backward,
    /// A pre-LN Transformer encoder layer (d_model = H * D, d_ff = 4 * d_model, GELU), forward and
    /// backward, fused attention. In the preset suites it runs at the shortest length only.
    Layer,
}

impl Pass {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
            Pass::Layer => "layer fwd+bwd",
        }
    }
}

impl PathKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            PathKind::Fused => "fused",
            PathKind::Unfused => "unfused",
        }
    }
}

/// Validated attention benchmarks on any wgpu adapter.
#[derive(Parser, Debug)]
#[command(name = "attention-bench", version)]
pub(crate) struct Cli {
    /// List the adapters of every back end and exit.
    #[arg(long)]
    pub(crate) list_adapters: bool,
    /// Back end: vulkan, gl, metal, dx12 (default: WGPU_BACKEND, else all).
    #[arg(long)]
    pub(crate) backend: Option<String>,
    /// Case-insensitive substring of the adapter name (default: WGPU_ADAPTER_NAME).
    #[arg(long)]
    pub(crate) adapter: Option<String>,
    /// The case preset.
    #[arg(long, value_enum, default_value = "default")]
    pub(crate) suite: Suite,
    /// Shorthand for --suite quick.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Batch size B (overrides the suite).
    #[arg(long)]
    pub(crate) batch: Option<usize>,
    /// Query heads H.
    #[arg(long)]
    pub(crate) heads: Option<usize>,
    /// Key/value heads Hkv (H % Hkv == 0; default H).
    #[arg(long)]
    pub(crate) kv_heads: Option<usize>,
    /// Query lengths Lq, comma separated.
    #[arg(long, value_delimiter = ',')]
    pub(crate) lengths: Option<Vec<usize>>,
    /// Key lengths Lk, comma separated, one per query length (default: Lk = Lq).
    #[arg(long, value_delimiter = ',')]
    pub(crate) kv_lengths: Option<Vec<usize>>,
    /// Head dim of Q and K (Dk).
    #[arg(long)]
    pub(crate) head_dim: Option<usize>,
    /// Head dim of V (Dv, default Dk).
    #[arg(long)]
    pub(crate) head_dim_v: Option<usize>,
    /// Mask kinds, comma separated.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) masks: Option<Vec<Mask>>,
    /// Sliding windows, comma separated: with W, each query sees the W keys before its aligned
    /// position and that position (`window(W, 0)`, the causal sliding window of Mistral and Gemma 2,
    /// with or without --masks causal); 0 is no window. Default: no window.
    #[arg(long, value_delimiter = ',')]
    pub(crate) windows: Option<Vec<usize>>,
    /// Score modifiers, comma separated (fused path only; default none).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) modifiers: Option<Vec<Modifier>>,
    /// Paths, comma separated.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) paths: Option<Vec<PathKind>>,
    /// Passes, comma separated.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) passes: Option<Vec<Pass>>,
    /// Fused kernel families, comma separated (default: the adapter's own; the gpu suite runs both).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) kernels: Option<Vec<Kernels>>,
    /// Element types, comma separated (default f32; the gpu suite runs both). f16 cases run the
    /// fused GPU family only.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) dtypes: Option<Vec<Dtype>>,
    /// Timed runs per case (after warm-up runs filling at least 0.3 s).
    #[arg(long)]
    pub(crate) reps: Option<usize>,
    /// Validate against the CPU reference only up to this many B*H*Lq*Lk*D multiply-adds.
    #[arg(long, default_value_t = 1 << 30)]
    pub(crate) validate_limit: u64,
    /// Time with the host clock even where GPU timestamps exist.
    #[arg(long)]
    pub(crate) wall_clock: bool,
    /// Write adapter info, git revision, cases and every figure as JSON.
    #[arg(long)]
    pub(crate) json: Option<std::path::PathBuf>,
    /// Write an SVG chart of GFLOP/s against sequence length per variant.
    #[arg(long)]
    pub(crate) plot: Option<std::path::PathBuf>,
    /// Build every fused-path pipeline the run would use, for each problem, kernel family and pass,
    /// and exit without running or validating anything (with WGPU_ATTENTION_DUMP_PIPELINES=DIR,
    /// this writes the suite's kernel set for gpu-compile-report). The unfused baseline and the
    /// layer case are not built (transformer-bench --compile-only builds the layer kernels).
    #[arg(long)]
    pub(crate) compile_only: bool,
    /// Also run every fused case with the configuration the autotuner picks on this adapter (the
    /// `fused-tuned` rows, beside the static choice's in the same process): each case's first call
    /// tunes its key (family, GPU tiles, split-KV), and the tuning report (every key's candidates,
    /// their times and the winner) is printed at the end and written to --json.
    #[arg(long)]
    pub(crate) tune: bool,
    /// With --tune: read tuned choices from this file and add new ones to it (keys found there are
    /// not timed again).
    #[arg(long, requires = "tune")]
    pub(crate) tuning_cache: Option<std::path::PathBuf>,
    /// With --tune: seconds each key's candidates may take (default 10; the whole run may take
    /// 12 times as long).
    #[arg(long, requires = "tune")]
    pub(crate) tuning_budget: Option<f64>,
    /// With --tune: let the tuner pick the tensor-core family where it is faster (its results have
    /// the tensor-core tolerances; ContextOptions::tune_tensor_cores)
    #[arg(long, requires = "tune")]
    pub(crate) tune_tensor_cores: bool,
    /// The GPU family's backward adds dQ with f32 atomics from its dK/dV kernel instead of running
    /// the dQ kernel, where the device has them (ContextOptions::atomic_gradients: dQ is then not
    /// bitwise repeatable)
    #[arg(long)]
    pub(crate) atomic_gradients: bool,
    /// Time one more run of each fused case per compute pass (GPU timestamps, TIMESTAMP_QUERY):
    /// the forward's passes, and the backward's preprocess, dK/dV and dQ apart; printed after the
    /// table and written to --json as each case's `profile`.
    #[arg(long)]
    pub(crate) profile: bool,
    /// Print ratios against an earlier --json report.
    #[arg(long)]
    pub(crate) compare: Option<std::path::PathBuf>,
}

pub(crate) fn reps(cli: &Cli) -> usize {
    let suite = if cli.quick { Suite::Quick } else { cli.suite };
    cli.reps.unwrap_or(match suite {
        Suite::Default => 5,
        Suite::Quick => 3,
        Suite::Scaling | Suite::Gpu => 2,
    })
}
