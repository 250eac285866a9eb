//! The fused attention's autotuning ([`crate::TuningMode`]): the tuning key of a call, the
//! candidates each key has, and how one is checked and timed. The context keeps the winners and
//! the cache (`device::autotune`).
//!
//! A key is the kernel (forward or backward), head dims, the power-of-two classes of the query and
//! key lengths and of batch x heads, the GQA group, the dtype and the masks and modifiers that
//! change the work (causal, window, softcap, ALiBi). The first call of a key is timed on a problem
//! of its own shape (zero-filled tensors: the kernels' time does not depend on the values), with
//! the call's scalar options only: tensors in the options (lengths, biases, relative tables, sinks)
//! do not enter the key, and packed calls run the static choice. The search is a coordinate
//! descent over what the context leaves unset: the family (CPU-driver or GPU; the tensor-core
//! family only where the context runs it or lets tuning pick it, `tune_tensor_cores`, as it rounds
//! inputs to f16; such keys end in ` tc`), then the winner's own shape: the CPU-driver family's
//! workgroup width, the tensor-core forward's tile groups and key tiles, or the GPU family's tile
//! shapes and then the forward's split-KV count, each step keeping the fastest so far (where the
//! context allows atomic gradients, the backward's dQ kernel against dQ added with atomics; such
//! backward keys end in ` atomic`). Before it
//! is timed, each candidate other than the static choice runs a small problem with random values
//! and must match the static choice's result there.

use super::backward::{attention_backward_workspace, encode_backward_core};
use super::binding::workgroup_size;
use super::call::{BackwardViews, ForwardViews};
use super::coop::CoopForward;
use super::forward::record_forward;
use super::gpu::{GpuDkDv, GpuDq, GpuForward};
use super::options::AttentionOptions;
use super::shape::check_options;
use crate::device::{
    Context, KernelChoice, KernelFamily, Search, TuningMode, ATTENTION_WORKGROUPS,
};
use crate::error::Result;
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, GpuTensorF16, HeadsView};

/// The fused kernels that tune.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tuned {
    Forward,
    Backward,
}

impl Tuned {
    fn name(self) -> &'static str {
        match self {
            Tuned::Forward => "attention_forward",
            Tuned::Backward => "attention_backward",
        }
    }
}

/// The choice a call of `kernel` on Q and K views `qk` runs: the context's settings over the tuned
/// choice of its key (tuned here at the key's first call where the context tunes; packed calls
/// are not).
pub(super) fn call_choice(
    ctx: &Context,
    kernel: Tuned,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    dtype: DType,
    qk: [&HeadsView; 2],
) -> Result<KernelChoice> {
    let packed = qk.iter().any(|view| view.packed_rows().is_some());
    tuned_call(
        ctx,
        kernel.name(),
        (s, dtype, packed),
        opts,
        |search, opts, settings| match kernel {
            Tuned::Forward => search_forward(ctx, search, s, opts, dtype, settings),
            Tuned::Backward => search_backward(ctx, search, s, opts, dtype, settings),
        },
    )
}

/// The choice a call of the kernel named `kernel` (shape `s`, `dtype` inputs) runs: the context's
/// settings over the tuned choice of its key, which `search` makes at the key's first call where
/// the context tunes (given the call's scalar options and the settings); packed calls run the
/// settings. Shared by every kernel that tunes (the attention's, the additive attention's).
pub(crate) fn tuned_call(
    ctx: &Context,
    kernel: &str,
    (s, dtype, packed): (&AttentionShape, DType, bool),
    opts: &AttentionOptions<'_>,
    search: impl FnOnce(&mut Search<'_>, &AttentionOptions<'_>, KernelChoice) -> Result<()>,
) -> Result<KernelChoice> {
    let settings = ctx.kernel_settings();
    if ctx.tuning_mode() == TuningMode::Off || packed || ctx.is_tuning_thread() {
        return Ok(settings);
    }
    let key = tuning_key(ctx, kernel, s, opts, dtype);
    let tuned = ctx.tuned_choice(&key, |search_state| {
        search(search_state, &scalar_options(opts), settings)
    })?;
    Ok(settings.or(tuned.unwrap_or_default()))
}

/// [`call_choice`] of an unmasked `dtype` call of `kernel` for `s` where the context has made it,
/// without tuning: what [`super::attention_forward_plan`] and
/// [`super::attention_backward_plan`] report.
pub(super) fn choice_so_far(
    ctx: &Context,
    kernel: Tuned,
    s: &AttentionShape,
    dtype: DType,
) -> KernelChoice {
    let key = tuning_key(ctx, kernel.name(), s, &AttentionOptions::new(), dtype);
    let tuned = ctx.tuned_choice_made(&key).unwrap_or_default();
    ctx.kernel_settings().or(tuned)
}

/// `attention_forward d64x64 q1024 k1024 bh8 f32 causal`: see the module's documentation.
fn tuning_key(
    ctx: &Context,
    kernel: &str,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    dtype: DType,
) -> String {
    let class = |n: usize| n.max(1).next_power_of_two();
    let mut key = format!(
        "{kernel} d{}x{} q{} k{} bh{}",
        s.head_dim_qk,
        s.head_dim_v,
        class(s.q_seq),
        class(s.kv_seq),
        class(s.batch * s.heads)
    );
    if s.heads > s.kv_heads {
        key += &format!(" gqa{}", s.heads / s.kv_heads);
    }
    key += match dtype {
        DType::F32 => " f32",
        DType::F16 => " f16",
    };
    let masks = [
        (opts.causal, " causal"),
        (opts.window.is_some(), " window"),
        (opts.softcap.is_some(), " softcap"),
        (opts.alibi || opts.alibi_slopes.is_some(), " alibi"),
    ];
    for (on, name) in masks {
        if on {
            key += name;
        }
    }
    // Choices that may be the tensor-core family's (its accuracy) are never another context's.
    if ctx.tunes_tensor_cores() {
        key += " tc";
    }
    // Nor backward choices made where dQ may be added with atomics (not bitwise repeatable).
    if kernel == Tuned::Backward.name() && ctx.atomic_gradients() {
        key += " atomic";
    }
    key
}

/// The options a tuning problem runs with: the call's masks and score modifiers, without the
/// tensors it names (lengths, biases, tables, sinks) or the Q/K transforms (which run before the
/// fused kernel and do not depend on its configuration).
fn scalar_options<'a>(opts: &AttentionOptions<'a>) -> AttentionOptions<'a> {
    AttentionOptions {
        scale: opts.scale,
        temperature: opts.temperature,
        causal: opts.causal,
        softcap: opts.softcap,
        alibi: opts.alibi,
        alibi_slopes: opts.alibi_slopes,
        window: opts.window,
        ..AttentionOptions::default()
    }
}

/// Families worth timing for `dtype`, the static one first: only it where the context sets one;
/// else the GPU and CPU-driver families for f32, the GPU family for f16 (the CPU-driver kernels
/// are f32 only), and the tensor-core family where the context lets tuning pick it
/// (`tune_tensor_cores`): it rounds inputs to f16, an accuracy the caller chooses, not a speed.
fn families(ctx: &Context, settings: &KernelChoice, dtype: DType) -> Vec<Option<KernelFamily>> {
    let fixed = settings.family.is_some();
    let first = match (settings.family_on(ctx), dtype) {
        (KernelFamily::CpuDriver, DType::F16) => KernelFamily::Gpu,
        (family, _) => family,
    };
    let mut families = vec![Some(first)];
    if !fixed {
        let others: &[KernelFamily] = match dtype {
            DType::F32 => &[KernelFamily::Gpu, KernelFamily::CpuDriver],
            DType::F16 => &[KernelFamily::Gpu],
        };
        families.extend(others.iter().filter(|&&f| f != first).map(|&f| Some(f)));
        if ctx.tunes_tensor_cores() && first != KernelFamily::Coop {
            families.push(Some(KernelFamily::Coop));
        }
    }
    families
}

/// Input and output tensors of a tuning problem, kept alive with their views.
struct Problem {
    views: Vec<HeadsView>,
    _f32: Vec<GpuTensor>,
    _f16: Vec<GpuTensorF16>,
    lse: GpuTensor,
    workspace: Option<GpuTensor>,
}

impl Problem {
    /// Views of `dims` (`[B, L, H, D]` each) of `dtype`: random values in [-1, 1) (seeded by
    /// position) where `random`, zeros otherwise; `lse` and, for a backward, the workspace.
    fn new(
        ctx: &Context,
        s: &AttentionShape,
        dtype: DType,
        dims: &[[usize; 4]],
        random: bool,
        backward: bool,
    ) -> Result<Self> {
        let mut problem = Self {
            views: Vec::new(),
            _f32: Vec::new(),
            _f16: Vec::new(),
            lse: GpuTensor::zeros(ctx, &[s.batch, s.heads, s.q_seq])?,
            workspace: match backward {
                true => Some(attention_backward_workspace(ctx, s)?),
                false => None,
            },
        };
        for (i, shape) in dims.iter().enumerate() {
            let n: usize = shape.iter().product();
            // Zeros are allocated on the device: a timed problem is never uploaded.
            let data = random.then(|| qualification_values(n, i as u32 + 1));
            let view = match dtype {
                DType::F32 => {
                    let tensor = match &data {
                        Some(data) => GpuTensor::from_slice(ctx, data, shape)?,
                        None => GpuTensor::zeros(ctx, shape)?,
                    };
                    let view = tensor.heads()?;
                    problem._f32.push(tensor);
                    view
                }
                DType::F16 => {
                    let tensor = match &data {
                        Some(data) => GpuTensorF16::from_f32(ctx, data, shape)?,
                        None => GpuTensorF16::zeros(ctx, shape)?,
                    };
                    let view = tensor.heads()?;
                    problem._f16.push(tensor);
                    view
                }
            };
            problem.views.push(view);
        }
        Ok(problem)
    }

    fn forward(&self) -> ForwardViews<'_> {
        ForwardViews {
            q: &self.views[0],
            k: &self.views[1],
            v: &self.views[2],
            out: &self.views[3],
            lse: &self.lse,
        }
    }

    fn backward(&self) -> BackwardViews<'_> {
        BackwardViews {
            q: &self.views[0],
            k: &self.views[1],
            v: &self.views[2],
            out: &self.views[3],
            lse: &self.lse,
            d_out: &self.views[4],
            dq: &self.views[5],
            dk: &self.views[6],
            dv: &self.views[7],
            workspace: self.workspace.as_ref().expect("a backward problem"),
        }
    }
}

/// Deterministic values in [-1, 1): the inputs of the problems kernels are qualified on (here and
/// the tensor-core build's, `coop::qualify_matrix_build`).
pub(crate) fn qualification_values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// Q, K, V and O dims of `s`; with dO, dQ, dK, dV for a backward.
fn dims(s: &AttentionShape, backward: bool) -> Vec<[usize; 4]> {
    let q = [s.batch, s.q_seq, s.heads, s.head_dim_qk];
    let k = [s.batch, s.kv_seq, s.kv_heads, s.head_dim_qk];
    let v = [s.batch, s.kv_seq, s.kv_heads, s.head_dim_v];
    let o = [s.batch, s.q_seq, s.heads, s.head_dim_v];
    match backward {
        false => vec![q, k, v, o],
        true => vec![q, k, v, o, o, q, k, v],
    }
}

/// The small problem a candidate must pass before it is timed: one batch, at most two KV heads
/// (the call's GQA group kept), at most 70 queries and 150 keys (several tiles, the last partial),
/// the call's head dims.
pub(crate) fn check_shape(s: &AttentionShape) -> AttentionShape {
    let kv_heads = s.kv_heads.min(2);
    AttentionShape {
        batch: 1,
        q_seq: s.q_seq.min(70),
        kv_seq: s.kv_seq.min(150),
        heads: kv_heads * (s.heads / s.kv_heads),
        kv_heads,
        head_dim_qk: s.head_dim_qk,
        head_dim_v: s.head_dim_v,
    }
}

/// The largest difference of two results, relative to `1 + |reference|` (0 where both are the
/// same infinity, infinite where one is not finite and the other differs).
fn worst_difference(candidate: &[f32], reference: &[f32]) -> f32 {
    candidate
        .iter()
        .zip(reference)
        .map(|(&x, &y)| match x == y {
            true => 0.0,
            false if x.is_finite() && y.is_finite() => (x - y).abs() / (1.0 + y.abs()),
            false => f32::INFINITY,
        })
        .fold(0.0, f32::max)
}

/// Largest relative difference a `family` candidate may show against the static choice on the
/// check problem: the families agree to a few f32 ulps per accumulated term (SPEC.md); f16 results
/// are rounded to f16 (2^-11) on each side; the tensor-core family's shapes round P at different
/// points (its tolerance, 2^-8).
fn check_tolerance(family: KernelFamily, dtype: DType) -> f32 {
    match (family, dtype) {
        // SPEC.md's tensor-core tolerance (`reference::compare::TENSOR_CORE_RTOL`).
        (KernelFamily::Coop, _) => 1.0 / 256.0,
        (_, DType::F32) => 1e-4,
        (_, DType::F16) => 1e-2,
    }
}

/// The forward's results on the check problem under `choice`: O then lse.
fn forward_results(
    ctx: &Context,
    problem: &Problem,
    opts: &AttentionOptions<'_>,
    choice: KernelChoice,
) -> Result<Vec<f32>> {
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    record_forward(ctx, &mut encoder, &problem.forward(), opts, Some(choice))?;
    ctx.submit(encoder)?;
    let mut out = problem.views[3].to_vec(ctx)?;
    out.extend(problem.lse.to_vec(ctx)?);
    Ok(out)
}

/// Whether `candidate`'s results match `reference`'s for a `family` candidate: `None` if so, else
/// what differed.
pub(crate) fn compare(
    what: &str,
    candidate: &[f32],
    reference: &[f32],
    family: KernelFamily,
    dtype: DType,
) -> Option<String> {
    let worst = worst_difference(candidate, reference);
    (worst > check_tolerance(family, dtype)).then(|| {
        format!(
            "its {what} differs from the static choice's by {worst:e} (relative) on a small problem"
        )
    })
}

fn search_forward(
    ctx: &Context,
    search: &mut Search<'_>,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    dtype: DType,
    settings: KernelChoice,
) -> Result<()> {
    let timed = Problem::new(ctx, s, dtype, &dims(s, false), false, false)?;
    let small = check_shape(s);
    check_options(ctx, &small, opts)?;
    let checked = Problem::new(ctx, &small, dtype, &dims(&small, false), true, false)?;
    let reference = forward_results(ctx, &checked, opts, settings)?;
    let measure = |search: &mut Search<'_>, choice: KernelChoice| {
        let check = || {
            if choice == settings {
                return Ok(None);
            }
            let results = forward_results(ctx, &checked, opts, choice)?;
            Ok(compare(
                "O or lse",
                &results,
                &reference,
                choice.family_on(ctx),
                dtype,
            ))
        };
        search.measure(choice, check, |encoder| {
            record_forward(ctx, encoder, &timed.forward(), opts, Some(choice))
        })
    };
    let gpu_static = GpuForward::choose(ctx, s, settings.tiles[0])?;
    let name_gpu = |choice: &mut KernelChoice| {
        choice.tiles[0] = Some((gpu_static.wg, gpu_static.block_m, gpu_static.block_n));
        choice.splits = Some(gpu_static.splits(ctx, s, settings.splits));
    };
    let steps = FamilySteps {
        settings,
        dtype,
        backward: false,
    };
    let gpu_best = steps.run(ctx, search, name_gpu, &measure)?;
    // The tensor-core family's shapes, where it won (the context runs it or lets tuning pick
    // it) and the context sets none.
    let coop_best = search
        .best()
        .filter(|b| b.family_on(ctx) == KernelFamily::Coop);
    if let Some(best) = coop_best.filter(|_| settings.coop_forward.is_none()) {
        let static_shape = CoopForward::choose(ctx, s, settings)?.map(|c| (c.groups, c.block_n));
        for shape in CoopForward::candidates(ctx, s)? {
            if Some(shape) != static_shape {
                let choice = KernelChoice {
                    coop_forward: Some(shape),
                    ..best
                };
                measure(search, choice)?;
            }
        }
    }
    let Some(best) = gpu_best else {
        return Ok(());
    };
    // 2. The GPU family's tiles, each at its own static split.
    if settings.tiles[0].is_none() {
        for tile in GpuForward::fitting(ctx, s) {
            let config = GpuForward::choose(ctx, s, Some(tile))?;
            let mut choice = best;
            choice.tiles[0] = Some(tile);
            choice.splits = Some(config.splits(ctx, s, settings.splits));
            measure(search, choice)?;
        }
    }
    // 3. The split count: none, and half and twice the best tile's.
    if settings.splits.is_none() {
        let best = search.best().unwrap_or(best);
        let config = GpuForward::choose(ctx, s, best.tiles[0])?;
        let kv_tiles = s.kv_seq.div_ceil(config.block_n as usize);
        let at = config.splits(ctx, s, None);
        let least = config.splits(ctx, s, Some(1));
        for splits in [least, at / 2, at * 2] {
            if splits >= least && splits <= kv_tiles && splits != at {
                measure(
                    search,
                    KernelChoice {
                        splits: Some(splits),
                        ..best
                    },
                )?;
            }
        }
    }
    Ok(())
}

/// The search's first steps, which the forward and backward share: the family, each at its static
/// configuration (named in full, so that the later steps do not time it again: `name_gpu` names
/// the GPU family's shapes), then, where the CPU-driver family wins, its workgroup widths unless
/// the context sets one.
struct FamilySteps {
    settings: KernelChoice,
    dtype: DType,
    backward: bool,
}

impl FamilySteps {
    /// Runs the steps: the best choice where the GPU family won (its own steps come next), else
    /// `None`.
    fn run(
        &self,
        ctx: &Context,
        search: &mut Search<'_>,
        name_gpu: impl Fn(&mut KernelChoice),
        measure: &impl Fn(&mut Search<'_>, KernelChoice) -> Result<()>,
    ) -> Result<Option<KernelChoice>> {
        let Self {
            settings,
            dtype,
            backward,
        } = *self;
        let cpu = |family: KernelFamily| family == KernelFamily::CpuDriver && dtype == DType::F32;
        for family in families(ctx, &settings, dtype) {
            let mut choice = KernelChoice { family, ..settings };
            match family {
                Some(KernelFamily::Gpu) => name_gpu(&mut choice),
                Some(f) if cpu(f) => {
                    choice.workgroup = Some(workgroup_size(ctx, backward, settings.workgroup))
                }
                _ => {}
            }
            measure(search, choice)?;
        }
        let Some(best) = search.best() else {
            return Ok(None);
        };
        if cpu(best.family_on(ctx)) && settings.workgroup.is_none() {
            let widest = ctx.limits().max_compute_invocations_per_workgroup;
            for wg in ATTENTION_WORKGROUPS.into_iter().filter(|&wg| wg <= widest) {
                measure(
                    search,
                    KernelChoice {
                        workgroup: Some(wg),
                        ..best
                    },
                )?;
            }
        }
        Ok((best.family_on(ctx) == KernelFamily::Gpu).then_some(best))
    }
}

/// The backward's results on the check problem under `choice`: dQ, dK, dV.
fn backward_results(
    ctx: &Context,
    problem: &Problem,
    opts: &AttentionOptions<'_>,
    choice: KernelChoice,
) -> Result<Vec<f32>> {
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    encode_backward_core(ctx, &mut encoder, problem.backward(), opts, Some(choice))?;
    ctx.submit(encoder)?;
    let mut out = problem.views[5].to_vec(ctx)?;
    out.extend(problem.views[6].to_vec(ctx)?);
    out.extend(problem.views[7].to_vec(ctx)?);
    Ok(out)
}

fn search_backward(
    ctx: &Context,
    search: &mut Search<'_>,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    dtype: DType,
    settings: KernelChoice,
) -> Result<()> {
    let timed = Problem::new(ctx, s, dtype, &dims(s, true), false, true)?;
    let small = check_shape(s);
    check_options(ctx, &small, opts)?;
    let checked = Problem::new(ctx, &small, dtype, &dims(&small, true), true, true)?;
    // O and lse of the check problem, so that its gradients are those of a real forward.
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    record_forward(ctx, &mut encoder, &checked.forward(), opts, Some(settings))?;
    ctx.submit(encoder)?;
    let reference = backward_results(ctx, &checked, opts, settings)?;
    let measure = |search: &mut Search<'_>, choice: KernelChoice| {
        let check = || {
            if choice == settings {
                return Ok(None);
            }
            let results = backward_results(ctx, &checked, opts, choice)?;
            Ok(compare(
                "dQ, dK or dV",
                &results,
                &reference,
                choice.family_on(ctx),
                dtype,
            ))
        };
        search.measure(choice, check, |encoder| {
            encode_backward_core(ctx, encoder, timed.backward(), opts, Some(choice))
        })
    };
    let dkdv = GpuDkDv::fitting(ctx, s);
    let dq = GpuDq::fitting(ctx, s);
    let name_gpu = |choice: &mut KernelChoice| {
        choice.tiles[1] = settings.tiles[1].or(dkdv.first().copied());
        choice.tiles[2] = settings.tiles[2].or(dq.first().copied());
    };
    let steps = FamilySteps {
        settings,
        dtype,
        backward: true,
    };
    let Some(best) = steps.run(ctx, search, name_gpu, &measure)? else {
        return Ok(());
    };
    // 2. dK/dV's tiles.
    if settings.tiles[1].is_none() {
        for tile in dkdv {
            let mut choice = best;
            choice.tiles[1] = Some(tile);
            measure(search, choice)?;
        }
    }
    // 3. dQ's tiles with the best dK/dV. Where the context allows atomics, the static choice adds
    // dQ with them in the dK/dV kernel: the dQ kernel, with each of its tiles, is the alternative.
    let atomic = ctx.atomic_gradients();
    if settings.tiles[2].is_none() || atomic {
        let best = search.best().unwrap_or(best);
        let tiles = match settings.tiles[2] {
            Some(tile) => vec![tile],
            None => dq,
        };
        for tile in tiles {
            let mut choice = best;
            choice.tiles[2] = Some(tile);
            if atomic {
                choice.dq_atomic = Some(false);
            }
            measure(search, choice)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{ContextOptions, TuningBudget, TuningSource};
    use std::time::Duration;

    /// The search keeps the faster of two candidates whose speeds differ by construction: one runs
    /// the static forward once per timed call, the other eight times. On the first back end of
    /// `WGPU_ATTENTION_TEST_BACKENDS` (default Vulkan: lavapipe in CI), as the integration tests.
    #[test]
    fn the_search_keeps_the_faster_of_two_candidates() {
        let first =
            std::env::var("WGPU_ATTENTION_TEST_BACKENDS").unwrap_or_else(|_| "vulkan".into());
        let backend = first.split(',').next().unwrap_or("vulkan");
        let options = ContextOptions::new()
            .backends(crate::parse_backends(backend).expect("a back end's name"))
            .tuning(TuningMode::Tune)
            .tuning_budget(TuningBudget::new(
                Duration::from_secs(120),
                Duration::from_secs(120),
            ));
        let ctx = match Context::new_with(&options) {
            Ok(ctx) => ctx,
            Err(e) if std::env::var("WGPU_ATTENTION_ALLOW_NO_GPU").is_ok_and(|v| v == "1") => {
                eprintln!("skipping: no {backend} adapter: {e}");
                return;
            }
            Err(e) => panic!("no {backend} adapter (lavapipe in CI): {e}"),
        };
        let s = AttentionShape {
            batch: 1,
            q_seq: 64,
            kv_seq: 64,
            heads: 2,
            kv_heads: 2,
            head_dim_qk: 16,
            head_dim_v: 16,
        };
        let problem = Problem::new(&ctx, &s, DType::F32, &dims(&s, false), false, false).unwrap();
        let opts = AttentionOptions::new();
        let once = KernelChoice::default();
        let eight = KernelChoice {
            splits: Some(1),
            ..once
        };
        let choice = ctx
            .tuned_choice("constructed", |search| {
                for (choice, times) in [(eight, 8), (once, 1)] {
                    search.measure(
                        choice,
                        || Ok(None),
                        |encoder| {
                            for _ in 0..times {
                                record_forward(
                                    &ctx,
                                    encoder,
                                    &problem.forward(),
                                    &opts,
                                    Some(once),
                                )?;
                            }
                            Ok(())
                        },
                    )?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(choice, Some(once));
        let report = ctx.tuning_report();
        assert_eq!(report.len(), 1);
        assert_eq!(report[0].source, TuningSource::Tuned);
        let [slow, fast] = &report[0].candidates[..] else {
            panic!("two candidates: {report:?}")
        };
        assert_eq!(fast.verdict, "winner");
        assert!(slow.verdict.starts_with("slower by"), "{}", slow.verdict);
        assert!(
            slow.seconds.unwrap() > 2.0 * fast.seconds.unwrap(),
            "{}",
            report[0]
        );
    }
}
