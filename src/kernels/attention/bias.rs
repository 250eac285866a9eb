//! Additive score terms: a bias tensor (`AttentionOptions::bias`) and T5 relative-position buckets
//! (`AttentionOptions::relative_buckets`). Every fused kernel adds them in `modify_scores`
//! (`shaders/attention/common.wgsl`). The bias's gradient comes from
//! `shaders/attention/bias_backward.wgsl`; the relative table's from the dQ kernels of both
//! families, which sum each query row's share per bucket as they go ([`RelativeRows`]), then
//! `column_sum.wgsl`. CPU reference: [`crate::reference::attention`] (`Bias`,
//! `relative_position_bucket`).

use super::binding::{
    base_params, bind_backward_inputs, bind_tensor, encode_chunks, set_grid, unused_writable,
    Binding, Bound, Kernel, Shared,
};
use super::call::BackwardViews;
use super::header::with_common;
use super::options::AttentionOptions;
use super::qk_norm;
use super::shape::{check_distinct, check_options, check_tensor, check_view};
use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_f32};
use crate::kernels::dispatch::{grid_x, loop_chunks};
use crate::kernels::linear::encode_column_sum;
use crate::spec::{AttentionShape, RelativeBuckets};
use crate::tensor::GpuTensor;

pub(super) const BACKWARD: &str = include_str!("../../../shaders/attention/bias_backward.wgsl");

/// Query rows and keys of one workgroup's tile in the gradient kernel (`BM`, `BN`).
const TILE: usize = 32;
/// Invocations of the gradient kernel.
const BACKWARD_WG: u32 = 64;
/// The backward kernel's only specialisation: its pipeline is the same for every problem.
const BACKWARD_CONSTANTS: [(&str, u32); 1] = [("WG", BACKWARD_WG)];

/// Compiles the backward kernel's pipeline ([`super::attention_precompile`]).
pub(super) fn precompile_backward(ctx: &Context) {
    ctx.pipeline(
        "attention_bias_backward",
        || with_common(BACKWARD, true),
        &BACKWARD_CONSTANTS,
    );
}

impl RelativeBuckets {
    /// Most buckets per direction: the kernels keep the log-spaced buckets' thresholds in their
    /// parameter block (32 of them).
    pub const MAX_PER_DIRECTION: usize = 66;

    /// The bucket of the relative position `delta = key - aligned query position`, as Hugging
    /// Face's `T5Attention._relative_position_bucket` computes it (the log in f32): the host's
    /// statement of the rule, from which the kernels' thresholds come. The reference states it
    /// separately (`reference::attention::relative_position_bucket`); a test compares the two at
    /// every distance.
    pub fn bucket(&self, delta: i64) -> usize {
        let (half, offset, n) = match self.bidirectional {
            true => {
                let half = self.buckets / 2;
                (half, if delta > 0 { half } else { 0 }, delta.unsigned_abs())
            }
            false => (self.buckets, 0, (-delta).max(0) as u64),
        };
        let exact = half / 2;
        if (n as usize) < exact {
            return offset + n as usize;
        }
        let ratio = ((self.max_distance as f64 / exact as f64).ln()) as f32;
        let log_spaced = (n as f32 / exact as f32).ln() / ratio * (half - exact) as f32;
        offset + (exact + log_spaced as usize).min(half - 1)
    }

    pub(super) fn per_direction(&self) -> usize {
        if self.bidirectional {
            self.buckets / 2
        } else {
            self.buckets
        }
    }

    pub(super) fn exact(&self) -> usize {
        self.per_direction() / 2
    }

    /// Refuses bucket counts the kernels cannot split (fewer than 2 per direction, an odd count
    /// when bidirectional).
    pub fn check(&self) -> Result<()> {
        let half = self.per_direction();
        let need = if self.bidirectional { 4 } else { 2 };
        if self.buckets < need || (self.bidirectional && !self.buckets.is_multiple_of(2)) {
            return Err(Error::shape(
                "relative_buckets",
                format!(
                    "{} bucket{}: at least {need}{}",
                    self.buckets,
                    if self.buckets == 1 { "" } else { "s" },
                    if self.bidirectional {
                        ", and an even number (half per direction)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if half > Self::MAX_PER_DIRECTION {
            return Err(Error::Unsupported {
                arg: "relative_buckets (buckets per direction)",
                value: half as u64,
                limit: Self::MAX_PER_DIRECTION as u64,
                hint: "",
            });
        }
        if self.max_distance <= self.exact() || self.max_distance > u32::MAX as usize / 2 {
            return Err(Error::shape(
                "relative_buckets max_distance",
                format!(
                    "is {}; it must exceed the {} exact buckets per direction (and fit in 31 bits)",
                    self.max_distance,
                    self.exact()
                ),
            ));
        }
        Ok(())
    }

    /// The smallest distance of each log-spaced bucket after the first: a distance `n` at or past
    /// `exact` lies in bucket `exact + #{thresholds <= n}` (what the kernels compute).
    pub(crate) fn thresholds(&self) -> Vec<u32> {
        let exact = self.exact() as i64;
        // Keys before the query: the lower half of a bidirectional table, all of a causal one.
        let within = |n: i64| self.bucket(-n) as i64;
        let last = self.per_direction() as i64 - 1;
        (exact + 1..=last)
            .map(|target| {
                // Buckets grow with the distance and reach the last by max_distance.
                let (mut lo, mut hi) = (exact, self.max_distance as i64);
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    if within(mid) >= target {
                        hi = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                lo as u32
            })
            .collect()
    }
}

/// The per-row shares of the relative table's gradient that the dQ kernels write
/// (`[B * Lq, H * buckets]`, the context's scratch), or a dummy binding when no gradient is wanted.
pub(super) struct RelativeRows {
    buckets: usize,
    buffer: wgpu::Buffer,
    bytes: u64,
}

impl RelativeRows {
    /// Buckets of the learned relative table whose gradient the call asks for (0: none).
    pub(super) fn buckets_of(opts: &AttentionOptions<'_>) -> u32 {
        opts.relative
            .zip(opts.relative_grad)
            .map_or(0, |((buckets, _), _)| buckets.buckets as u32)
    }

    pub(super) fn new(
        ctx: &Context,
        s: &AttentionShape,
        opts: &AttentionOptions<'_>,
    ) -> Result<Self> {
        let buckets = Self::buckets_of(opts) as usize;
        if buckets == 0 {
            return Ok(Self {
                buckets: 0,
                buffer: unused_writable(ctx)?,
                bytes: 4,
            });
        }
        let bytes = (s.batch * s.q_seq * s.heads * buckets * 4) as u64;
        check_binding(ctx, "relative table row shares", bytes)?;
        // The column sums' grid, checked before the backward records anything.
        grid_x(ctx, s.heads * buckets)?;
        Ok(Self {
            buckets,
            buffer: ctx.scratch_buffer("relative table row shares", bytes)?,
            bytes,
        })
    }

    pub(super) fn binding(&self) -> Binding<'_> {
        Binding {
            buffer: &self.buffer,
            offset_bytes: 0,
            size_bytes: self.bytes,
        }
    }

    /// The dQ pipelines' `REL_BUCKETS` constant (0: no gradient, the code folds away).
    pub(super) fn constant(&self) -> (&'static str, u32) {
        ("REL_BUCKETS", self.buckets as u32)
    }

    /// Buckets whose gradient the dQ pipelines accumulate (0: none).
    pub(super) fn buckets(&self) -> u32 {
        self.buckets as u32
    }

    /// Records the column sums of the row shares into the caller's gradient tensor.
    pub(super) fn encode_sums(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        s: &AttentionShape,
        opts: &AttentionOptions<'_>,
    ) -> Result<()> {
        if let (true, Some(grad)) = (self.buckets > 0, opts.relative_grad) {
            let rows = s.batch * s.q_seq;
            encode_column_sum(
                ctx,
                encoder,
                &self.buffer,
                rows,
                s.heads * self.buckets,
                grad,
            )?;
        }
        Ok(())
    }
}

/// Records the gradient of the options' learnable bias after
/// [`attention_backward_into`](super::attention_backward_into) recorded the backward of the same
/// call, with the same `views` (it reads Q, K, V, dO and the workspace, which holds the `(lse, D)`
/// stats it needs): `d_bias`, shaped like the bias
/// view (`[bias batch, bias heads, Lq, Lk]`, contiguous), summed over the view's broadcast
/// dimensions, batch-major, in a fixed order. Every element is written (zeros where masked).
/// Deterministic; nothing is recorded if the input is rejected. (The relative table's gradient
/// comes from the backward itself: `AttentionOptions::relative_buckets_learned`.)
pub fn attention_bias_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    views: &BackwardViews<'_>,
    d_bias: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let &BackwardViews {
        q,
        k,
        v,
        d_out,
        workspace,
        ..
    } = views;
    let s = AttentionShape::of(q, k, v)?;
    check_f32(&[("q", q), ("k", k), ("v", v)])?;
    let scale = check_options(ctx, &s, opts)?;
    check_view("d_out", d_out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    check_tensor("workspace", workspace, &[s.batch, s.heads, s.q_seq, 2])?;
    let Some(bias) = opts.bias else {
        return Err(Error::shape(
            "bias",
            "the options have no bias: nothing has a gradient here (relative tables get theirs from attention_backward_into with relative_buckets_learned)",
        ));
    };
    let [bb, hb, lq, lk] = bias.view.shape();
    check_tensor("d_bias", d_bias, &[bb, hb, lq, lk])?;
    check_distinct(
        ctx,
        opts,
        &[("d_bias", d_bias.region())],
        &[
            ("q", q.region()),
            ("k", k.region()),
            ("v", v.region()),
            ("d_out", d_out.region()),
            ("workspace", workspace.region()),
        ],
    )?;
    let slices = bb * hb;
    let members = (s.batch * s.heads) / slices;

    let row_blocks = s.q_seq.div_ceil(TILE);
    let key_tiles = s.kv_seq.div_ceil(TILE);
    // Loop iterations of one (key tile, member) and of one key tile's output (see the shader).
    let chunks_of = |dim: usize| dim.div_ceil(4).div_ceil(8);
    let per_member = (chunks_of(s.head_dim_qk) + chunks_of(s.head_dim_v)) * 90 + 40;
    let per_tile = 40;
    // Key splits: enough workgroups to fill a GPU, and few enough tiles per workgroup for the
    // driver's loop budget.
    let mut splits = key_tiles.min(512usize.div_ceil(slices * row_blocks)).max(1);
    if let Some(budget) = ctx.loop_budget() {
        let tiles_fit = (budget as usize / 2 / (per_member + per_tile)).max(1);
        splits = splits.max(key_tiles.div_ceil(tiles_fit));
    }
    let tiles_per_split = key_tiles.div_ceil(splits);
    let splits = key_tiles.div_ceil(tiles_per_split);

    // Q and K as the scores see them (cosine scores, key clipping).
    let (q, k) = qk_norm::encode_inputs(ctx, encoder, q, k, opts)?;
    let mut params = base_params(&s, scale, opts);
    params.splits = splits as u32;
    let mut bindings = bind_backward_inputs(ctx, &mut params, [&q, &k, v, d_out], workspace)?;
    bindings.push(bind_tensor(ctx, "d_bias", d_bias)?);
    let grid = set_grid(ctx, &mut params, row_blocks * splits, slices)?;
    // The grid is linearised as (slice, row block, split); `blocks` counts row blocks.
    params.blocks = row_blocks as u32;
    let chunks = loop_chunks(
        ctx,
        members,
        per_member * tiles_per_split,
        per_tile * tiles_per_split + 400,
        1,
    );
    let mut pass = ctx.begin_pass(encoder, "attention_bias_backward");
    encode_chunks(
        ctx,
        &mut pass,
        Kernel {
            name: "attention_bias_backward",
            source: |score_bias| with_common(BACKWARD, score_bias),
            constants: &BACKWARD_CONSTANTS,
        },
        &mut params,
        Bound {
            shared: Shared::scores(ctx, opts)?,
            bindings: &bindings,
            grid,
        },
        &chunks,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::RelativeBuckets;

    /// The kernels' rule (exact below `exact`, then `exact + #{thresholds <= n}`) gives the host's
    /// bucket, and the host's statement of T5's rule the reference's (stated separately), at
    /// every distance, for T5's tables and small odd ones.
    #[test]
    fn thresholds_reproduce_every_bucket() {
        for buckets in [
            RelativeBuckets::new(32, 128, true),
            RelativeBuckets::new(32, 128, false),
            RelativeBuckets::new(8, 20, false),
            RelativeBuckets::new(6, 5, true),
            RelativeBuckets::new(132, 1000, true),
            RelativeBuckets::new(66, 70, false),
        ] {
            buckets.check().unwrap();
            let thresholds = buckets.thresholds();
            assert!(thresholds.len() <= super::super::binding::MAX_REL_THRESHOLDS);
            let (exact, half) = (buckets.exact(), buckets.per_direction());
            for delta in -3 * buckets.max_distance as i64..=3 * buckets.max_distance as i64 {
                let (offset, n) = match buckets.bidirectional {
                    true => ((delta > 0) as usize * half, delta.unsigned_abs() as usize),
                    false => (0, (-delta).max(0) as usize),
                };
                let kernel = if n < exact {
                    offset + n
                } else {
                    offset + exact + thresholds.iter().filter(|&&t| t as usize <= n).count()
                };
                assert_eq!(kernel, buckets.bucket(delta), "{buckets:?} delta {delta}");
                let reference =
                    crate::reference::attention::relative_position_bucket(delta, buckets);
                assert_eq!(kernel, reference, "{buckets:?} delta {delta}: reference");
            }
        }
    }
}
