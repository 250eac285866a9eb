//! Additive attention's autotuning ([`crate::TuningMode`]): a key per call, as the dot-product
//! attention's (`additive_forward` or `additive_backward`, the score and value dims, the length and
//! batch x heads classes, the masks; `kernels::attention::tune`), whose candidates are the fused
//! kernels (the static choice) and the unfused path, the scores materialised `[B, H, Lq, Lk]` in the
//! context's scratch, where they fit a binding. On an H100 (2026-11-26, BENCHMARKS.md) the fused
//! kernels ran at 0.17-0.26x the unfused path's speed; a context that tunes takes whichever is
//! faster on its GPU. Before it is timed, the unfused candidate must match the fused kernels'
//! results on a small problem with random values.

use crate::device::{Context, KernelChoice, KernelFamily, Search};
use crate::error::Result;
use crate::kernels::attention::tune::{check_shape, compare, qualification_values, tuned_call};
use crate::kernels::attention::unfused::scores_shape;
use crate::kernels::attention::{AttentionOptions, BackwardViews, ForwardViews};
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, HeadsView};

use super::backward::{additive_backward_workspace, record_backward};
use super::call::AdditiveScores;
use super::forward::record_forward;

/// The additive kernels that tune.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tuned {
    Forward,
    Backward,
}

impl Tuned {
    fn name(self) -> &'static str {
        match self {
            Tuned::Forward => "additive_forward",
            Tuned::Backward => "additive_backward",
        }
    }
}

/// The choice a checked call of `kernel` for `s` runs: the context's settings over its key's tuned
/// choice (tuned here at the key's first call where the context tunes).
fn call_choice(
    ctx: &Context,
    kernel: Tuned,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
) -> Result<KernelChoice> {
    tuned_call(
        ctx,
        kernel.name(),
        (s, DType::F32, false),
        opts,
        |search, opts, settings| search_unfused(ctx, kernel, search, s, opts, settings),
    )
}

/// Whether the unfused path holds `s`: its scores `[B, H, Lq, Lk]` within one binding.
fn unfused_fits(ctx: &Context, s: &AttentionShape) -> bool {
    scores_shape(ctx, s).is_ok()
}

/// Whether a checked call of `kernel` for `s` takes the unfused path: `choice` (the context's,
/// tuned at the key's first call, where `None`) names it and its scores fit.
pub(super) fn runs_unfused(
    ctx: &Context,
    kernel: Tuned,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    choice: Option<KernelChoice>,
) -> Result<bool> {
    let choice = match choice {
        Some(choice) => choice,
        None => call_choice(ctx, kernel, s, opts)?,
    };
    Ok(choice.unfused == Some(true) && unfused_fits(ctx, s))
}

/// Times the fused kernels (the static choice) and, where it fits, the unfused path.
fn search_unfused(
    ctx: &Context,
    kernel: Tuned,
    search: &mut Search<'_>,
    s: &AttentionShape,
    opts: &AttentionOptions<'_>,
    settings: KernelChoice,
) -> Result<()> {
    let backward = kernel == Tuned::Backward;
    let timed = Problem::new(ctx, s, false, backward)?;
    let checked = Problem::new(ctx, &check_shape(s), true, backward)?;
    let reference = checked.results(ctx, kernel, opts, settings)?;
    let unfused = KernelChoice {
        unfused: Some(true),
        ..settings
    };
    let mut candidates = vec![settings];
    if unfused_fits(ctx, s) {
        candidates.push(unfused);
    }
    for choice in candidates {
        let check = || {
            if choice == settings {
                return Ok(None);
            }
            let results = checked.results(ctx, kernel, opts, choice)?;
            // Both paths compute in f32 and differ in summation order only: f32's bound.
            let what = match kernel {
                Tuned::Forward => "O or lse",
                Tuned::Backward => "da, db, dv, dw or dbias",
            };
            Ok(compare(
                what,
                &results,
                &reference,
                KernelFamily::Gpu,
                DType::F32,
            ))
        };
        search.measure(choice, check, |encoder| {
            timed.record(ctx, encoder, kernel, opts, choice)
        })?;
    }
    Ok(())
}

/// The tensors of a tuning problem: a, b, v, w, bias, O, lse; for a backward also dO, da, db, dv,
/// dw, dbias and the workspace.
struct Problem {
    tensors: Vec<GpuTensor>,
    views: Vec<HeadsView>,
    workspace: Option<GpuTensor>,
}

impl Problem {
    /// Random values in [-1, 1) where `random` (the check), zeros otherwise (the timed problem).
    fn new(ctx: &Context, s: &AttentionShape, random: bool, backward: bool) -> Result<Self> {
        let (b, lq, lk, h, da, dv) = (
            s.batch,
            s.q_seq,
            s.kv_seq,
            s.heads,
            s.head_dim_qk,
            s.head_dim_v,
        );
        let shapes: [&[usize]; 13] = [
            &[b, lq, h, da],
            &[b, lk, h, da],
            &[b, lk, h, dv],
            &[h, da],
            &[h, da],
            &[b, lq, h, dv],
            &[b, h, lq],
            &[b, lq, h, dv],
            &[b, lq, h, da],
            &[b, lk, h, da],
            &[b, lk, h, dv],
            &[h, da],
            &[h, da],
        ];
        let count = if backward { shapes.len() } else { 7 };
        let mut tensors = Vec::new();
        for (i, shape) in shapes.iter().take(count).enumerate() {
            let n = shape.iter().product();
            tensors.push(match random {
                true => GpuTensor::from_slice(ctx, &qualification_values(n, i as u32 + 1), shape)?,
                false => GpuTensor::zeros(ctx, shape)?,
            });
        }
        let views = [0, 1, 2, 5, 7, 8, 9, 10]
            .iter()
            .filter(|&&i| i < count)
            .map(|&i| tensors[i].heads())
            .collect::<Result<_>>()?;
        let workspace = match backward {
            true => Some(additive_backward_workspace(ctx, s)?),
            false => None,
        };
        Ok(Self {
            tensors,
            views,
            workspace,
        })
    }

    fn scores(&self) -> AdditiveScores<'_> {
        AdditiveScores {
            w: &self.tensors[3],
            bias: &self.tensors[4],
        }
    }

    fn forward(&self) -> ForwardViews<'_> {
        ForwardViews {
            q: &self.views[0],
            k: &self.views[1],
            v: &self.views[2],
            out: &self.views[3],
            lse: &self.tensors[6],
        }
    }

    /// One call of `kernel` under `choice` into `encoder` (a backward's forward outputs are
    /// whatever the problem holds: zeros, or the check's forward).
    fn record(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        kernel: Tuned,
        opts: &AttentionOptions<'_>,
        choice: KernelChoice,
    ) -> Result<()> {
        let scores = self.scores();
        match kernel {
            Tuned::Forward => record_forward(ctx, encoder, &self.forward(), scores, opts, choice),
            Tuned::Backward => {
                let workspace = self.workspace.as_ref().expect("a backward problem");
                let views = BackwardViews {
                    q: &self.views[0],
                    k: &self.views[1],
                    v: &self.views[2],
                    out: &self.views[3],
                    lse: &self.tensors[6],
                    d_out: &self.views[4],
                    dq: &self.views[5],
                    dk: &self.views[6],
                    dv: &self.views[7],
                    workspace,
                };
                let grads = [&self.tensors[11], &self.tensors[12]];
                record_backward(ctx, encoder, &views, scores, grads, opts, choice)
            }
        }
    }

    /// The results of `kernel` under `choice`: O and lse, or (after the fused forward) da, db, dv,
    /// dw and dbias.
    fn results(
        &self,
        ctx: &Context,
        kernel: Tuned,
        opts: &AttentionOptions<'_>,
        choice: KernelChoice,
    ) -> Result<Vec<f32>> {
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        if kernel == Tuned::Backward {
            let fused = KernelChoice::default();
            record_forward(
                ctx,
                &mut encoder,
                &self.forward(),
                self.scores(),
                opts,
                fused,
            )?;
        }
        self.record(ctx, &mut encoder, kernel, opts, choice)?;
        ctx.submit(encoder)?;
        let read = match kernel {
            Tuned::Forward => [5, 6].as_slice(),
            Tuned::Backward => [8, 9, 10, 11, 12].as_slice(),
        };
        let mut out = Vec::new();
        for &i in read {
            out.extend(self.tensors[i].to_vec(ctx)?);
        }
        Ok(out)
    }
}
