//! Running one problem: inputs and their reference results, then every (path, family, pass) case,
//! timed and validated.

use wgpu_attention::bench::{measure, Samples, Timer};
use wgpu_attention::reference::attention as reference;
use wgpu_attention::reference::attention::{Bias, Masks};
use wgpu_attention::reference::compare::{
    compare, BACKWARD_ATOL, BACKWARD_RTOL, F16_BACKWARD_ATOL, F16_FORWARD_ATOL, F16_RTOL,
    FORWARD_ATOL, FORWARD_RTOL, TENSOR_CORE_ATOL, TENSOR_CORE_RTOL,
};
use wgpu_attention::{
    attention_backward_into, attention_backward_plan, attention_backward_unfused,
    attention_backward_workspace, attention_bias_backward_into, attention_forward_into,
    attention_forward_plan, attention_forward_unfused, attention_sinks_backward_into,
    AttentionOptions, AttentionShape, BackwardViews, BiasView, Context, DType, Error, ForwardViews,
    GpuTensor, GpuTensorF16, HeadsView, KernelFamily, PackedSide, RelativeBuckets, SeqLens,
    TuningMode,
};
use wgpu_attention_transformer::layer_case::LayerCase;
use wgpu_attention_transformer::reference::transformer_layer as reference_layer;
use wgpu_attention_transformer::reference::transformer_layer::TransformerLayerConfig;

use crate::cli::{Modifier, Pass, PathKind};
use crate::problem::{OptionTensors, Problem, RELATIVE_BUCKETS};
use crate::Progress;

/// Scale of the cosine-scores cases.
pub(crate) const COSINE_SCALE: f32 = 10.0;

/// Zero-filled outputs of either element type, kept alive (and counted) while viewed.
pub(crate) enum Outputs {
    F32(GpuTensor),
    F16(GpuTensorF16),
}

impl Outputs {
    pub(crate) fn zeros(
        ctx: &Context,
        shape: &[usize],
        dtype: DType,
    ) -> wgpu_attention::Result<Self> {
        Ok(match dtype {
            DType::F32 => Outputs::F32(GpuTensor::zeros(ctx, shape)?),
            DType::F16 => Outputs::F16(GpuTensorF16::zeros(ctx, shape)?),
        })
    }

    pub(crate) fn heads(&self) -> wgpu_attention::Result<HeadsView> {
        match self {
            Outputs::F32(t) => t.heads(),
            Outputs::F16(t) => t.heads(),
        }
    }

    /// Zeros of a `[B, L, heads, dim]` output, or of its packed `[rows, heads, dim]` form where the
    /// problem is packed (by `lens`, on `side`).
    pub(crate) fn zeros_like(
        ctx: &Context,
        [batch, len, heads, dim]: [usize; 4],
        packed: Option<(&SeqLens, PackedSide)>,
        dtype: DType,
    ) -> wgpu_attention::Result<Self> {
        match packed {
            Some((lens, side)) => Self::zeros(ctx, &[lens.packed_total(side), heads, dim], dtype),
            None => Self::zeros(ctx, &[batch, len, heads, dim], dtype),
        }
    }

    /// The output's view: packed by `lens` on `side` where given.
    pub(crate) fn view(
        &self,
        packed: Option<(&SeqLens, PackedSide)>,
    ) -> wgpu_attention::Result<HeadsView> {
        match (self, packed) {
            (_, None) => self.heads(),
            (Outputs::F32(t), Some((lens, side))) => t.packed_heads(lens, side),
            (Outputs::F16(t), Some((lens, side))) => t.packed_heads(lens, side),
        }
    }

    pub(crate) fn to_vec(&self, ctx: &Context) -> wgpu_attention::Result<Vec<f32>> {
        match self {
            Outputs::F32(t) => t.to_vec(ctx),
            Outputs::F16(t) => t.to_vec(ctx),
        }
    }
}

/// What one (problem, path, pass) produced.
pub(crate) struct CaseResult {
    pub(crate) id: String,
    pub(crate) problem: Problem,
    pub(crate) path: PathKind,
    /// `fused-gpu`, `fused-cpu` or `unfused`.
    pub(crate) path_label: String,
    /// The fused forward's plan (family, tiles, splits); empty on the unfused path.
    pub(crate) kernel: String,
    pub(crate) pass: Pass,
    pub(crate) outcome: std::result::Result<Measured, String>,
}

pub(crate) struct Measured {
    pub(crate) samples: Samples,
    pub(crate) gflops: f64,
    pub(crate) peak_bytes: u64,
    /// (checked, passed, worst ratio to tolerance, detail)
    pub(crate) validation: Option<(bool, f64, String)>,
    /// With `--profile`, the fused case's compute passes by label: (label, GPU ms, passes), in
    /// the order first recorded.
    pub(crate) profile: Vec<(&'static str, f64, usize)>,
}

/// `work` run once more with every compute pass timed ([`Context::start_profiling`]), the passes
/// summed by label; empty where the adapter has no timestamp queries.
fn profile_passes(
    ctx: &Context,
    work: &mut dyn FnMut() -> wgpu_attention::Result<()>,
) -> wgpu_attention::Result<Vec<(&'static str, f64, usize)>> {
    if ctx.start_profiling().is_err() {
        return Ok(Vec::new());
    }
    work()?;
    let mut by_label: Vec<(&'static str, f64, usize)> = Vec::new();
    for (label, ms) in ctx.finish_profiling()? {
        match by_label.iter_mut().find(|(l, _, _)| *l == label) {
            Some(entry) => {
                entry.1 += ms;
                entry.2 += 1;
            }
            None => by_label.push((label, ms, 1)),
        }
    }
    Ok(by_label)
}

/// GPU inputs of one problem and their CPU copies.
pub(crate) struct Inputs {
    pub(crate) q: HeadsView,
    pub(crate) k: HeadsView,
    pub(crate) v: HeadsView,
    pub(crate) d_out: HeadsView,
    pub(crate) host: [Vec<f32>; 4],
    pub(crate) seq_lens: Option<SeqLens>,
    /// The case's learned score terms: bias `[1, H, Lq, Lk]`, relative table `[H, 32]`, sinks `[H]`
    /// (values and, in the backward, gradient tensors).
    pub(crate) bias: Option<(BiasView, Vec<f32>, GpuTensor)>,
    pub(crate) relative: Option<(RelativeBuckets, GpuTensor, Vec<f32>, GpuTensor)>,
    pub(crate) sinks: Option<(GpuTensor, Vec<f32>, GpuTensor)>,
}

/// How every case is measured: the timer, the timed runs per case, and the largest problem (in
/// multiply-adds) validated against the reference.
#[derive(Clone, Copy)]
pub(crate) struct Measurement<'a> {
    pub(crate) timer: &'a Timer,
    pub(crate) reps: usize,
    pub(crate) validate_limit: u64,
    /// One more run of each fused case timed per compute pass (`--profile`).
    pub(crate) profile: bool,
}

/// Which cases run for each problem: paths, fused kernel families and passes.
#[derive(Clone, Copy)]
pub(crate) struct Selection<'a> {
    pub(crate) paths: &'a [PathKind],
    pub(crate) families: &'a [KernelFamily],
    pub(crate) passes: &'a [Pass],
    /// The fused path's autotuned runs too (`--tune`).
    pub(crate) tuned: bool,
}

/// A problem ready to run: its shape, inputs and options, and the reference results where it is
/// validated.
struct Prepared<'a> {
    shape: &'a AttentionShape,
    inputs: &'a Inputs,
    opts: &'a AttentionOptions<'a>,
    reference_forward: Option<&'a (Vec<f64>, Vec<f64>)>,
    reference_backward: Option<&'a reference::Grads>,
}

/// Every case `selection` asks for of problem `p`, the layer case too when `with_layer`.
pub(crate) fn run_problem(
    ctx: &mut Context,
    m: Measurement<'_>,
    p: &Problem,
    selection: Selection<'_>,
    with_layer: bool,
    progress: &mut Progress,
) -> wgpu_attention::Result<Vec<CaseResult>> {
    let validate_limit = m.validate_limit;
    let Selection {
        paths,
        families,
        passes,
        tuned,
    } = selection;
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
    let seq_lens = p.seq_lens(ctx)?;
    // Padded [B, L, h, d] tensors, or, for packed problems, each sequence's rows one after another.
    let up = |data: &[f32], l: usize, h: usize, d: usize, side| {
        let (shape, data) = match (p.packed(), &seq_lens) {
            (true, Some(lens)) => {
                let lens = lens_of(lens, side);
                let packed = pack_rows(data, lens, l, h * d);
                (vec![packed.len() / (h * d), h, d], packed)
            }
            _ => (vec![p.batch, l, h, d], data.to_vec()),
        };
        let packing = seq_lens.as_ref().filter(|_| p.packed());
        match p.dtype {
            DType::F32 => GpuTensor::from_slice(ctx, &data, &shape).and_then(|t| match packing {
                Some(lens) => t.packed_heads(lens, side),
                None => t.heads(),
            }),
            DType::F16 => GpuTensorF16::from_f32(ctx, &data, &shape).and_then(|t| match packing {
                Some(lens) => t.packed_heads(lens, side),
                None => t.heads(),
            }),
        }
    };
    use PackedSide::{Keys, Queries};
    let inputs = Inputs {
        q: up(&host[0], p.q_len, p.heads, p.dk, Queries)?,
        k: up(&host[1], p.kv_len, p.kv_heads, p.dk, Keys)?,
        v: up(&host[2], p.kv_len, p.kv_heads, p.dv, Keys)?,
        d_out: up(&host[3], p.q_len, p.heads, p.dv, Queries)?,
        seq_lens,
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
            let buckets = p.relative_buckets();
            let values = random(h * RELATIVE_BUCKETS, 6);
            let table = GpuTensor::from_slice(ctx, &values, &[h, RELATIVE_BUCKETS])?;
            let grad = GpuTensor::zeros(ctx, &[h, RELATIVE_BUCKETS])?;
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
    let opts = p.options(OptionTensors {
        seq_lens: inputs.seq_lens.as_ref(),
        bias: inputs.bias.as_ref().map(|(view, _, _)| view),
        relative: inputs
            .relative
            .as_ref()
            .map(|(_, table, _, grad)| (table, grad)),
        sinks: inputs.sinks.as_ref().map(|(sinks, _, _)| sinks),
    });
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
            .map(|(buckets, _, values, _)| (*buckets, f64s(values))),
        sinks: inputs.sinks.as_ref().map(|(_, values, _)| f64s(values)),
        normalize_qk: p.modifier == Modifier::Cosine,
        key_clip: (p.modifier == Modifier::Clip).then(|| (p.dk as f64).sqrt()),
        causal: p.causal(),
        q_lens: p.q_lens(),
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
    // A packed problem's outputs hold the sequences' rows only (lse stays [B, H, Lq]).
    let (reference_forward, reference_backward) = match (&inputs.seq_lens, p.packed()) {
        (Some(lens), true) => {
            let (q_lens, kv_lens) = (lens_of(lens, Queries), lens_of(lens, Keys));
            let forward = reference_forward
                .map(|(out, lse)| (pack_rows(&out, q_lens, p.q_len, p.heads * p.dv), lse));
            let backward = reference_backward.map(|mut g| {
                g.dq = pack_rows(&g.dq, q_lens, p.q_len, p.heads * p.dk);
                g.dk = pack_rows(&g.dk, kv_lens, p.kv_len, p.kv_heads * p.dk);
                g.dv = pack_rows(&g.dv, kv_lens, p.kv_len, p.kv_heads * p.dv);
                g
            });
            (forward, backward)
        }
        _ => (reference_forward, reference_backward),
    };

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
    for (path, family) in p.runs(paths, families, tuned) {
        ctx.set_kernel_family(family);
        // The fused path without a family is the autotuner's; every other run the static choice.
        let tuning = path == PathKind::Fused && family.is_none();
        ctx.set_tuning_mode(match tuning {
            true => TuningMode::Tune,
            false => TuningMode::Off,
        });
        let ctx: &Context = ctx;
        let path_label = match (family, tuning) {
            (Some(f), _) => format!("{}-{}", path.name(), f.name()),
            (None, true) => format!("{}-tuned", path.name()),
            (None, false) => path.name().to_string(),
        };
        let kernel = match (family, tuning) {
            (Some(_), _) => attention_forward_plan(ctx, &shape)?.to_string(),
            (None, true) => "tuned (see the tuning report)".to_string(),
            (None, false) => String::new(),
        };
        // The backward's kernels are not the forward's (the tensor-core family's backward may run
        // the GPU family's); a shape the backward cannot take says why.
        let backward_kernel = match family {
            Some(_) if path == PathKind::Fused => attention_backward_plan(ctx, &shape, p.dtype)
                .map_or_else(|e| format!("({e})"), |plan| plan.to_string()),
            _ => kernel.clone(),
        };
        for &pass in passes {
            let layer = pass == Pass::Layer;
            if layer && (path != PathKind::Fused || !with_layer || p.packed()) {
                continue;
            }
            let id = format!("{} {} {}", pass.name(), path_label, p.label());
            progress.step(&id);
            let outcome = if layer {
                run_layer_case(ctx, m, p)
            } else {
                let prepared = Prepared {
                    shape: &shape,
                    inputs: &inputs,
                    opts: &opts,
                    reference_forward: reference_forward.as_ref(),
                    reference_backward: reference_backward.as_ref(),
                };
                run_case(ctx, m, p, &prepared, (path, pass))
            };
            let outcome = match outcome {
                Ok(m) => Ok(m),
                // Sizes, element types, features and combinations the path cannot run (binding or
                // buffer limits, f16 without SHADER_F16 or with an f32-only term, a bias gradient
                // of packed views) are reported in the table and skipped, not fatal.
                Err(
                    e @ (Error::BindingTooLarge { .. }
                    | Error::Shape { .. }
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
                kernel: match pass {
                    Pass::Backward => backward_kernel.clone(),
                    _ => kernel.clone(),
                },
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
pub(crate) fn run_layer_case(
    ctx: &Context,
    m: Measurement<'_>,
    p: &Problem,
) -> wgpu_attention::Result<Measured> {
    let Measurement {
        timer,
        reps,
        validate_limit,
        ..
    } = m;
    let d = p.heads * p.dk;
    let config = TransformerLayerConfig::default()
        .d_model(d)
        .heads(p.heads)
        .d_ff(4 * d)
        .causal(p.causal())
        .pre_ln(true);
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
        profile: Vec::new(),
    })
}

/// (name, GPU result, reference (empty if not validated), atol, rtol).
pub(crate) type Check<'a> = (&'static str, Vec<f32>, &'a [f64], f64, f64);

fn run_case(
    ctx: &Context,
    Measurement {
        timer,
        reps,
        profile,
        ..
    }: Measurement<'_>,
    p: &Problem,
    prepared: &Prepared<'_>,
    (path, pass): (PathKind, Pass),
) -> wgpu_attention::Result<Measured> {
    let &Prepared {
        shape,
        inputs: x,
        opts,
        reference_forward,
        reference_backward,
    } = prepared;
    let s = shape;
    let causal = opts.causal;
    // Peak memory counts every tensor the case allocates beyond Q, K, V and dO: outputs, the saved
    // forward (backward cases), workspaces and anything the call allocates itself.
    ctx.reset_peak_memory();
    let base = ctx.memory().current_bytes;
    // Outputs of the fused path are allocated once and reused by every run.
    let packing = |side| {
        x.seq_lens
            .as_ref()
            .filter(|_| p.packed())
            .map(|l| (l, side))
    };
    let (queries, keys) = (packing(PackedSide::Queries), packing(PackedSide::Keys));
    let out = Outputs::zeros_like(
        ctx,
        [s.batch, s.q_seq, s.heads, s.head_dim_v],
        queries,
        p.dtype,
    )?;
    let lse = GpuTensor::zeros(ctx, &[s.batch, s.heads, s.q_seq])?;
    let (mut forward_atol, mut forward_rtol, mut backward_atol, mut backward_rtol) = match p.dtype {
        DType::F32 => (FORWARD_ATOL, FORWARD_RTOL, BACKWARD_ATOL, BACKWARD_RTOL),
        DType::F16 => (F16_FORWARD_ATOL, F16_RTOL, F16_BACKWARD_ATOL, F16_RTOL),
    };
    let (mut lse_atol, mut lse_rtol) = (FORWARD_ATOL, FORWARD_RTOL);
    // The tensor-core family rounds Q, K, V and P to f16 (its backward starts from that forward):
    // where the context runs it, or where tuning may pick it.
    let tuned_coop = ctx.tuning_mode() != TuningMode::Off && ctx.tunes_tensor_cores();
    if path == PathKind::Fused && (ctx.kernel_family() == KernelFamily::Coop || tuned_coop) {
        (forward_atol, forward_rtol) = (TENSOR_CORE_ATOL, TENSOR_CORE_RTOL);
        (lse_atol, lse_rtol) = (TENSOR_CORE_ATOL, TENSOR_CORE_RTOL);
        backward_atol = backward_atol.max(TENSOR_CORE_ATOL);
        backward_rtol = backward_rtol.max(TENSOR_CORE_RTOL);
    }
    let fused_forward = || -> wgpu_attention::Result<()> {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        attention_forward_into(
            ctx,
            &mut encoder,
            &ForwardViews {
                q: &x.q,
                k: &x.k,
                v: &x.v,
                out: &out.view(queries)?,
                lse: &lse,
            },
            opts,
        )?;
        ctx.queue().submit([encoder.finish()]);
        Ok(())
    };
    let (mut checks, gflop, samples): (Vec<Check<'_>>, f64, Samples);
    let mut passes = Vec::new();
    match pass {
        Pass::Forward => {
            gflop = p.counted_flops(s.forward_flops(causal), s.forward_flops(false)) / 1e9;
            match path {
                PathKind::Fused => {
                    samples = measure(ctx, timer, reps, fused_forward)?;
                    if profile {
                        passes = profile_passes(ctx, &mut || fused_forward())?;
                    }
                    checks = vec![
                        ("out", out.to_vec(ctx)?, &[], forward_atol, forward_rtol),
                        ("lse", lse.to_vec(ctx)?, &[], lse_atol, lse_rtol),
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
            let dq_shape = [s.batch, s.q_seq, s.heads, s.head_dim_qk];
            let dq = Outputs::zeros_like(ctx, dq_shape, queries, p.dtype)?;
            let dk_shape = [s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk];
            let dk = Outputs::zeros_like(ctx, dk_shape, keys, p.dtype)?;
            let dv_shape = [s.batch, s.kv_seq, s.kv_heads, s.head_dim_v];
            let dv = Outputs::zeros_like(ctx, dv_shape, keys, p.dtype)?;
            let workspace = attention_backward_workspace(ctx, s)?;
            let grads = match path {
                PathKind::Fused => {
                    let out_view = out.view(queries)?;
                    let grad_views = [dq.view(queries)?, dk.view(keys)?, dv.view(keys)?];
                    let views = BackwardViews {
                        q: &x.q,
                        k: &x.k,
                        v: &x.v,
                        out: &out_view,
                        lse: &lse,
                        d_out: &x.d_out,
                        dq: &grad_views[0],
                        dk: &grad_views[1],
                        dv: &grad_views[2],
                        workspace: &workspace,
                    };
                    let mut backward = || {
                        let mut encoder = ctx.device().create_command_encoder(&Default::default());
                        attention_backward_into(ctx, &mut encoder, &views, opts)?;
                        // The learned score terms' gradients belong to the backward (the
                        // relative table's is written by attention_backward_into itself).
                        if let Some((_, _, grad)) = &x.bias {
                            attention_bias_backward_into(ctx, &mut encoder, &views, grad, opts)?;
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
                    };
                    samples = measure(ctx, timer, reps, &mut backward)?;
                    if profile {
                        passes = profile_passes(ctx, &mut backward)?;
                    }
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
        profile: passes,
    })
}

/// The lengths of a packed batch's `side`.
fn lens_of(lens: &SeqLens, side: PackedSide) -> &[u32] {
    lens.lens(side).expect("packed lengths hold both sides")
}

/// The first `lens[b]` rows (of `width` values) of each sequence of padded `[B, seq, width]` data,
/// one sequence after another.
fn pack_rows<T: Copy>(data: &[T], lens: &[u32], seq: usize, width: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(lens.iter().sum::<u32>() as usize * width);
    for (b, &len) in lens.iter().enumerate() {
        out.extend_from_slice(&data[b * seq * width..][..len as usize * width]);
    }
    out
}

pub(crate) fn random(n: usize, seed: u32) -> Vec<f32> {
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
