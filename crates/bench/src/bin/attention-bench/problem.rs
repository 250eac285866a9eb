//! The problems a run measures: sizes, masks, modifiers, windows and element types, from the
//! suite and the options.

use wgpu_attention::{
    AttentionOptions, BiasView, Context, DType, GpuTensor, KernelFamily, RelativeBuckets, SeqLens,
};

use crate::cases::COSINE_SCALE;
use crate::cli::{Cli, Mask, Modifier, PathKind, Suite};

/// One problem size and mask; every (path, pass) of it is a measured case.
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) q_len: usize,
    pub(crate) kv_len: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    pub(crate) mask: Mask,
    pub(crate) modifier: Modifier,
    pub(crate) window: Option<usize>,
    pub(crate) dtype: DType,
}

impl Problem {
    pub(crate) fn label(&self) -> String {
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

    /// The (path, kernel family) runs of this problem: f16 runs the GPU family for the CPU-driver one.
    /// The (path, family) runs of this problem: `None` is the unfused path's, and on the fused
    /// path (with `tuned`) the autotuner's choice.
    pub(crate) fn runs(
        &self,
        paths: &[PathKind],
        families: &[KernelFamily],
        tuned: bool,
    ) -> Vec<(PathKind, Option<KernelFamily>)> {
        let mut runs = Vec::new();
        for &path in paths {
            match path {
                // f16 runs the GPU family in place of the CPU-driver one (which is f32 only).
                PathKind::Fused if self.dtype == DType::F16 => {
                    for &family in families {
                        let family = match family {
                            KernelFamily::CpuDriver => KernelFamily::Gpu,
                            other => other,
                        };
                        if !runs.contains(&(path, Some(family))) {
                            runs.push((path, Some(family)));
                        }
                    }
                }
                PathKind::Fused => runs.extend(families.iter().map(|&f| (path, Some(f)))),
                // The unfused baseline has no score modifiers, no f16 and no packed batches.
                PathKind::Unfused if self.modifier != Modifier::None || self.packed() => {}
                PathKind::Unfused if self.dtype == DType::F16 => {}
                PathKind::Unfused => runs.push((path, None)),
            }
            if tuned && path == PathKind::Fused {
                runs.push((path, None));
            }
        }
        runs
    }

    /// FLOPs of the case: `masked` (the customary count, causal halved), or under a window `full` times
    /// the fraction of (query, key) pairs the window leaves, so GFLOP/s counts only work that exists.
    pub(crate) fn counted_flops(&self, masked: f64, full: f64) -> f64 {
        // Variable lengths: the pairs of each sequence's own queries and keys.
        if let (Some(q), Some(kv)) = (self.q_lens(), self.kv_lens()) {
            let pairs: usize = q.iter().zip(&kv).map(|(&a, &b)| (a * b) as usize).sum();
            let share = pairs as f64 / (self.batch * self.q_len * self.kv_len) as f64;
            return masked * share;
        }
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
    pub(crate) fn mask_label(&self) -> String {
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

    pub(crate) fn causal(&self) -> bool {
        matches!(
            self.mask,
            Mask::Causal | Mask::CausalPadding | Mask::CausalVarlen | Mask::CausalPacked
        )
    }

    /// Whether the sequences are packed (`packed` masks): `[rows, H, D]` tensors.
    pub(crate) fn packed(&self) -> bool {
        matches!(self.mask, Mask::Packed | Mask::CausalPacked)
    }

    /// Per-sequence query lengths (variable-length and packed batches).
    pub(crate) fn q_lens(&self) -> Option<Vec<u32>> {
        let varlen = matches!(
            self.mask,
            Mask::Varlen | Mask::CausalVarlen | Mask::Packed | Mask::CausalPacked
        );
        varlen.then(|| self.quarter_lens(self.q_len))
    }

    pub(crate) fn kv_lens(&self) -> Option<Vec<u32>> {
        (self.mask != Mask::None && self.mask != Mask::Causal)
            .then(|| self.quarter_lens(self.kv_len))
    }

    /// `len * (4 - b % 4) / 4` for sequence b (at least 1).
    fn quarter_lens(&self, len: usize) -> Vec<u32> {
        (0..self.batch)
            .map(|b| (len * (4 - b % 4) / 4).max(1) as u32)
            .collect()
    }

    /// The problem's lengths on the GPU: packed, query and key, or key lengths, per its mask.
    pub(crate) fn seq_lens(&self, ctx: &Context) -> wgpu_attention::Result<Option<SeqLens>> {
        match (self.q_lens(), self.kv_lens()) {
            (Some(q), Some(kv)) if self.packed() => SeqLens::packed(ctx, &q, &kv).map(Some),
            (None, None) => Ok(None),
            (q, kv) => SeqLens::new(ctx, q.as_deref(), kv.as_deref()).map(Some),
        }
    }

    /// The T5 relative buckets of the `relative` modifier: 32 buckets to distance 128, one-directional
    /// when causal.
    pub(crate) fn relative_buckets(&self) -> RelativeBuckets {
        RelativeBuckets::new(RELATIVE_BUCKETS, 128, !self.causal())
    }

    /// The attention options of this problem over the tensors its mask and modifier need (those
    /// it does not need may be `None`): what a timed run and `--compile-only` both pass.
    pub(crate) fn options<'a>(&self, tensors: OptionTensors<'a>) -> AttentionOptions<'a> {
        let mut opts = AttentionOptions::new()
            .causal(self.causal())
            .alibi(self.modifier.alibi());
        if let Some(cap) = self.modifier.softcap() {
            opts = opts.softcap(cap);
        }
        if let Some(w) = self.window {
            opts = opts.window(w, 0);
        }
        if let Some(lens) = tensors.seq_lens {
            opts = opts.seq_lens(lens);
        }
        match self.modifier {
            Modifier::Bias => opts = opts.bias(tensors.bias.expect("a bias view")),
            Modifier::Relative => {
                let (table, grad) = tensors.relative.expect("a relative table and its gradient");
                opts = opts.relative_buckets_learned(self.relative_buckets(), table, grad);
            }
            Modifier::Sinks => opts = opts.sinks(tensors.sinks.expect("sink logits")),
            Modifier::Cosine => opts = opts.cosine(COSINE_SCALE),
            Modifier::Clip => opts = opts.key_norm_clip((self.dk as f32).sqrt()),
            _ => {}
        }
        opts
    }

    pub(crate) fn macs(&self) -> u64 {
        (self.batch * self.heads * self.q_len * self.kv_len * self.dk.max(self.dv)) as u64
    }
}

/// Buckets of the `relative` modifier's table.
pub(crate) const RELATIVE_BUCKETS: usize = 32;

/// The tensors a problem's options borrow (see [`Problem::options`]).
#[derive(Clone, Copy, Default)]
pub(crate) struct OptionTensors<'a> {
    pub(crate) seq_lens: Option<&'a SeqLens>,
    pub(crate) bias: Option<&'a BiasView>,
    /// The relative table and where its gradient goes.
    pub(crate) relative: Option<(&'a GpuTensor, &'a GpuTensor)>,
    pub(crate) sinks: Option<&'a GpuTensor>,
}

pub(crate) fn mask_name(m: Mask) -> &'static str {
    match m {
        Mask::None => "none",
        Mask::Causal => "causal",
        Mask::Padding => "padding",
        Mask::CausalPadding => "causal+padding",
        Mask::Varlen => "varlen",
        Mask::CausalVarlen => "causal+varlen",
        Mask::Packed => "packed",
        Mask::CausalPacked => "causal+packed",
    }
}

pub(crate) fn problems(cli: &Cli) -> std::result::Result<Vec<Problem>, String> {
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
        let varlen = [
            Mask::Varlen,
            Mask::CausalVarlen,
            Mask::Packed,
            Mask::CausalPacked,
        ];
        if masks.iter().any(|m| varlen.contains(m)) && kv != &lengths {
            return Err(
                "--masks varlen and packed: each sequence's queries are its keys, so \
                        --kv-lengths must equal --lengths"
                    .into(),
            );
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
        let sizes = (batch, heads, kv_heads, dk, dv);
        push_problems(&mut out, cli, &lengths, masks.clone(), &dtypes, sizes);
    }
    Ok(out)
}

/// Every problem of `lengths`, `masks` and `dtypes` (and the modifiers and windows `cli` gives) at
/// `(batch, heads, kv_heads, dk, dv)`.
fn push_problems(
    out: &mut Vec<Problem>,
    cli: &Cli,
    lengths: &[usize],
    masks: Vec<Mask>,
    dtypes: &[DType],
    (batch, heads, kv_heads, dk, dv): (usize, usize, usize, usize, usize),
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
