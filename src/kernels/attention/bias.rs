//! Additive score terms: a bias tensor (`AttentionOptions::bias`) and T5 relative-position buckets
//! (`AttentionOptions::relative_buckets`). Every fused kernel adds them in `modify_scores`
//! (`shaders/attention_common.wgsl`); their gradients come from `shaders/attention_bias_backward.wgsl`
//! (the table's through `column_sum.wgsl`). CPU reference: [`crate::reference::attention`]
//! (`Bias`, [`relative_position_bucket`]).

use super::*;
use crate::kernels::linear::encode_column_sum;
use crate::reference::attention::{relative_position_bucket, RelativeConfig};

pub(super) const BACKWARD: &str = include_str!("../../../shaders/attention_bias_backward.wgsl");

/// Query rows and keys of one workgroup's tile in the gradient kernel (`BM`, `BN`).
const TILE: usize = 32;
/// Invocations of the gradient kernel.
const BACKWARD_WG: u32 = 64;

/// T5 relative-position buckets (Raffel et al. 2020): `buckets` in all (half per direction when
/// `bidirectional`); in each direction distances below a quarter (half, one-directional) of the
/// buckets get one each and larger ones log-spaced buckets up to `max_distance`, beyond which they
/// share the last. T5 uses `RelativeBuckets::new(32, 128, true)` in the encoder and
/// `(32, 128, false)` in the decoder's self-attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelativeBuckets {
    pub buckets: usize,
    pub max_distance: usize,
    pub bidirectional: bool,
}

impl RelativeBuckets {
    /// Most buckets per direction: the kernels keep the log-spaced buckets' thresholds in their
    /// parameter block (32 of them).
    pub const MAX_PER_DIRECTION: usize = 66;

    pub fn new(buckets: usize, max_distance: usize, bidirectional: bool) -> Self {
        Self {
            buckets,
            max_distance,
            bidirectional,
        }
    }

    /// The bucket of the relative position `delta = key - aligned query position`.
    pub fn bucket(&self, delta: i64) -> usize {
        relative_position_bucket(delta, self.reference())
    }

    /// The same configuration for the CPU reference.
    pub fn reference(&self) -> RelativeConfig {
        RelativeConfig {
            buckets: self.buckets,
            max_distance: self.max_distance,
            bidirectional: self.bidirectional,
        }
    }

    fn per_direction(&self) -> usize {
        if self.bidirectional {
            self.buckets / 2
        } else {
            self.buckets
        }
    }

    fn exact(&self) -> usize {
        self.per_direction() / 2
    }

    pub(crate) fn check(&self) -> Result<()> {
        let half = self.per_direction();
        let need = if self.bidirectional { 4 } else { 2 };
        if self.buckets < need || (self.bidirectional && !self.buckets.is_multiple_of(2)) {
            return Err(Error::shape(
                "relative_buckets",
                format!(
                    "{} buckets: at least {need}{}",
                    self.buckets,
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

/// Validates the bias and relative options against the problem.
pub(super) fn check(shape: &AttentionShape, opts: &AttentionOptions<'_>) -> Result<()> {
    if opts.bias.is_some() && opts.relative.is_some() {
        return Err(Error::shape(
            "bias/relative_buckets",
            "one additive score term per call: add the relative-position bias into the bias tensor, or pass padding through seq_lens",
        ));
    }
    if let Some(bias) = opts.bias {
        let [bb, hb, lq, lk] = bias.view.shape();
        if !(bb == 1 || bb == shape.batch)
            || !(hb == 1 || hb == shape.heads)
            || lq != shape.q_seq
            || lk != shape.kv_seq
        {
            return Err(Error::shape(
                "bias",
                format!(
                    "has shape {:?}; expected [{} or 1, {} or 1, {}, {}] (batch, query heads, Lq, Lk)",
                    bias.view.shape(),
                    shape.batch,
                    shape.heads,
                    shape.q_seq,
                    shape.kv_seq
                ),
            ));
        }
        if bias.view.end_element() > u32::MAX as usize {
            return Err(Error::Unsupported {
                arg: "bias (last element index)",
                value: bias.view.end_element() as u64,
                limit: u32::MAX as u64,
                hint: "; bind a smaller view",
            });
        }
    }
    if let Some((buckets, table)) = opts.relative {
        buckets.check()?;
        check_tensor("relative table", table, &[shape.heads, buckets.buckets])?;
    }
    Ok(())
}

/// The parameter-block fields of the bias or relative table (called by `base_params`).
pub(super) fn fill_params(params: &mut Params, opts: &AttentionOptions<'_>) {
    params.bias_batch = 1;
    params.bias_heads = 1;
    if let Some(bias) = opts.bias {
        params.flags |= FLAG_BIAS;
        // Bound from element 0 of its buffer; check() kept every index within u32.
        params.bias_offset = bias.view.offset() as u32;
        params.bias_strides = bias.view.strides().map(|x| x as u32);
        let [bb, hb, _, _] = bias.view.shape();
        params.bias_batch = bb as u32;
        params.bias_heads = hb as u32;
    }
    if let Some((buckets, _)) = opts.relative {
        params.flags |= FLAG_RELATIVE;
        if buckets.bidirectional {
            params.flags |= FLAG_REL_BIDIRECTIONAL;
        }
        params.rel_buckets = buckets.per_direction() as u32;
        params.rel_exact = buckets.exact() as u32;
        params.rel_table_stride = buckets.buckets as u32;
        let thresholds = buckets.thresholds();
        params.rel_threshold_vec4s = thresholds.len().div_ceil(4) as u32;
        let mut packed = [u32::MAX; MAX_REL_THRESHOLDS];
        packed[..thresholds.len()].copy_from_slice(&thresholds);
        for (slot, chunk) in params.rel_thresholds.iter_mut().zip(packed.chunks(4)) {
            slot.copy_from_slice(chunk);
        }
        // The table's gradient slices are the query heads.
        params.bias_heads = params.heads;
    }
}

/// What score kernels bind at `SCORE_BIAS_BINDING`: the bias's buffer from element 0 to its last
/// element, the relative table, or the context's dummy.
pub(super) fn score_bias_binding<'a>(
    ctx: &'a Context,
    opts: &AttentionOptions<'a>,
) -> Result<Binding<'a>> {
    if let Some(bias) = opts.bias {
        let size_bytes = bias.view.end_element() as u64 * 4;
        check_binding(ctx, "bias", size_bytes)?;
        return Ok(Binding {
            buffer: bias.view.buffer(),
            offset_bytes: 0,
            size_bytes,
        });
    }
    if let Some((_, table)) = opts.relative {
        return bind_tensor(ctx, "relative table", table);
    }
    Ok(Binding {
        buffer: ctx.empty_storage(),
        offset_bytes: 0,
        size_bytes: ctx.empty_storage().size(),
    })
}

/// Records the gradients of the options' additive score terms after [`attention_backward_into`]
/// recorded the backward of the same call (whose `workspace` holds the `(lse, D)` stats it needs):
/// `d_bias`, shaped like the bias view (`[bias batch, bias heads, Lq, Lk]`, contiguous), summed over
/// the view's broadcast dimensions, batch-major, in a fixed order; or, with relative buckets, the
/// table's gradient `[H, buckets]`. Every element is written (zeros where masked). Deterministic;
/// nothing is recorded if the input is rejected.
#[allow(clippy::too_many_arguments)]
pub fn attention_bias_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    q: &HeadsView,
    k: &HeadsView,
    v: &HeadsView,
    d_out: &HeadsView,
    workspace: &GpuTensor,
    grad: &GpuTensor,
    opts: &AttentionOptions<'_>,
) -> Result<()> {
    let s = AttentionShape::of(q, k, v)?;
    let scale = check_options(&s, opts)?;
    check_view("d_out", d_out, [s.batch, s.q_seq, s.heads, s.head_dim_v])?;
    check_tensor("workspace", workspace, &[s.batch, s.heads, s.q_seq, 2])?;
    let (slices, expected, arg) = match (opts.bias, opts.relative) {
        (Some(bias), _) => {
            let [bb, hb, lq, lk] = bias.view.shape();
            (bb * hb, vec![bb, hb, lq, lk], "d_bias")
        }
        (None, Some((buckets, _))) => (s.heads, vec![s.heads, buckets.buckets], "d_relative"),
        (None, None) => {
            return Err(Error::shape(
                "bias/relative_buckets",
                "the options have no bias and no relative buckets: nothing has a gradient",
            ))
        }
    };
    check_tensor(arg, grad, &expected)?;
    let mut inputs = vec![
        q.buffer().as_ref(),
        k.buffer(),
        v.buffer(),
        d_out.buffer(),
        workspace.buffer(),
    ];
    if let Some(bias) = opts.bias {
        inputs.push(bias.view.buffer());
    }
    if let Some((_, table)) = opts.relative {
        inputs.push(table.buffer());
    }
    check_distinct(&[(arg, grad.buffer())], &inputs)?;
    let relative = opts.bias.is_none();
    let members = if relative {
        s.batch
    } else {
        (s.batch * s.heads) / slices
    };

    let row_blocks = s.q_seq.div_ceil(TILE);
    let key_tiles = s.kv_seq.div_ceil(TILE);
    // Loop iterations of one (key tile, member) and of one key tile's epilogue (see the shader).
    let chunks_of = |dim: usize| dim.div_ceil(4).div_ceil(8);
    let per_member = (chunks_of(s.head_dim_qk) + chunks_of(s.head_dim_v)) * 90 + 40;
    let per_tile = if relative { 300 } else { 40 };
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
    let width = s.heads * opts.relative.map_or(0, |(b, _)| b.buckets);
    let partial_rows = row_blocks * splits;
    let scratch = if relative {
        let bytes = (partial_rows * width * 4) as u64;
        check_binding(ctx, "relative table partial sums", bytes)?;
        Some(ctx.scratch_buffer("relative table partial sums", bytes)?)
    } else {
        None
    };
    bindings.push(match &scratch {
        Some(scratch) => Binding {
            buffer: scratch,
            offset_bytes: 0,
            size_bytes: (partial_rows * width * 4) as u64,
        },
        None => bind_tensor(ctx, arg, grad)?,
    });
    let grid = set_grid(&mut params, row_blocks * splits, slices)?;
    let chunks = loop_chunks(
        ctx,
        members,
        per_member * tiles_per_split,
        per_tile * tiles_per_split + 400,
        1,
    );
    {
        let mut pass = ctx.begin_pass(encoder, "attention_bias_backward");
        // The grid is linearised as (slice, row block, split); `blocks` counts row blocks.
        params.blocks = row_blocks as u32;
        encode_chunks(
            ctx,
            &mut pass,
            "attention_bias_backward",
            || with_common(BACKWARD),
            &[("WG", BACKWARD_WG)],
            &mut params,
            Shared::scores(ctx, opts)?,
            &bindings,
            grid,
            &chunks,
        );
    }
    if let Some(scratch) = &scratch {
        encode_column_sum(ctx, encoder, scratch.as_ref(), partial_rows, width, grad);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::RelativeBuckets;

    /// The kernels' rule (exact below `exact`, then `exact + #{thresholds <= n}`) gives the
    /// reference's bucket at every distance, for T5's tables and small odd ones.
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
            assert!(thresholds.len() <= super::MAX_REL_THRESHOLDS);
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
            }
        }
    }
}
