//! Rotary position embeddings (RoFormer, Su et al. 2021; `shaders/rope.wgsl`): the query and key
//! heads are rotated in place, pair by pair, by angles that grow with the position, so their dot
//! products depend on relative positions. The backward rotates the gradient back (in place). Works on
//! strided head views, so Q and K inside a packed QKV projection are rotated where they lie.
//! cos and sin come from a [`RopeTable`] computed once in f64.
//! CPU reference: [`crate::reference::rope`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::check_binding;
use crate::kernels::dispatch::{encode, grid_x, SimpleKernel};
pub use crate::spec::{RopeLayout, RopeScaling};
use crate::tensor::{GpuTensor, HeadsView, PackedSide, SeqLens};

const ROPE: &str = include_str!("../../shaders/rope.wgsl");

/// The rotary shader by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![("rope", ROPE.to_string())]
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RopeParams {
    batch: u32,
    seq: u32,
    heads: u32,
    pairs: u32,
    offset: u32,
    interleaved: u32,
    sign: f32,
    grid_x: u32,
    view_offset: u32,
    stride_b: u32,
    stride_s: u32,
    stride_h: u32,
    max_positions: u32,
    per_sequence: u32,
    packed: u32,
    pad: u32,
}

/// The cos and sin of every (position, pair) angle `p * base^(-2k / rotary_dim)` for positions below
/// `max_positions`, computed in f64 and stored as `[2, max_positions, rotary_dim / 2]` f32.
#[derive(Clone, Debug)]
pub struct RopeTable {
    table: GpuTensor,
    /// The angle base (10000 in RoFormer and LLaMA).
    pub base: f64,
    /// Leading dims of each head that rotate (even, at most the head dim).
    pub rotary_dim: usize,
    /// How the rotated dims are paired.
    pub layout: RopeLayout,
    /// Positions the table covers.
    pub max_positions: usize,
    /// How the frequencies are stretched, if they are.
    pub scaling: Option<RopeScaling>,
}

impl RopeTable {
    /// `base` 10000 in most models (larger for long contexts); `rotary_dim` even, at most the head
    /// dim (the first `rotary_dim` dims of each head rotate, the rest pass: "partial rotary").
    pub fn new(
        ctx: &Context,
        base: f64,
        rotary_dim: usize,
        layout: RopeLayout,
        max_positions: usize,
    ) -> Result<Self> {
        Self::scaled(ctx, base, rotary_dim, layout, None, max_positions)
    }

    /// [`RopeTable::new`] with the frequencies stretched by `scaling` (Hugging Face's
    /// `rope_scaling`: `linear`, `llama3`).
    pub fn scaled(
        ctx: &Context,
        base: f64,
        rotary_dim: usize,
        layout: RopeLayout,
        scaling: Option<RopeScaling>,
        max_positions: usize,
    ) -> Result<Self> {
        if let Some(scaling) = scaling {
            scaling.check()?;
        }
        if !(base.is_finite() && base > 1.0) {
            return Err(Error::shape(
                "rope base",
                format!("is {base}; it must be finite and above 1 (10000 in most models)"),
            ));
        }
        if rotary_dim < 2 || !rotary_dim.is_multiple_of(2) {
            return Err(Error::shape(
                "rotary_dim",
                format!("is {rotary_dim}; it must be even and at least 2"),
            ));
        }
        if max_positions == 0 || max_positions > u32::MAX as usize / 2 {
            return Err(Error::shape(
                "max_positions",
                format!("is {max_positions}; it must be at least 1 and fit in 31 bits"),
            ));
        }
        let pairs = rotary_dim / 2;
        let mut values = vec![0.0f32; 2 * max_positions * pairs];
        for p in 0..max_positions {
            for k in 0..pairs {
                let (s, c) = (p as f64 * frequency(k, base, rotary_dim, scaling)).sin_cos();
                values[p * pairs + k] = c as f32;
                values[(max_positions + p) * pairs + k] = s as f32;
            }
        }
        Ok(Self {
            table: GpuTensor::from_slice(ctx, &values, &[2, max_positions, pairs])?,
            base,
            rotary_dim,
            layout,
            max_positions,
            scaling,
        })
    }
}

/// Where the rows of a rotated view sit.
#[derive(Clone, Copy, Debug)]
enum Positions<'a> {
    /// Row `l` at `offset + l`.
    From(usize),
    /// Row `l` of sequence `b` at `kv_lens[b] - q_lens[b] + l`: new tokens after a cache.
    AfterCached(&'a SeqLens),
    /// A packed view's row `l` of sequence `b` at `offset + l` (`SeqLens::packed`).
    Packed(&'a SeqLens, usize),
}

/// Records the rotation of `x` (`[B, L, H, D]`, any strides) in place, positions `offset..offset + L`.
pub fn rope_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &HeadsView,
    table: &RopeTable,
    offset: usize,
) -> Result<()> {
    record(ctx, encoder, x, table, Positions::From(offset), 1.0)
}

/// Records the backward in place: `dx` (the gradient with respect to the rotated values) becomes the
/// gradient with respect to the inputs, the rotation by the negative angles.
pub fn rope_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    dx: &HeadsView,
    table: &RopeTable,
    offset: usize,
) -> Result<()> {
    record(ctx, encoder, dx, table, Positions::From(offset), -1.0)
}

/// Records the rotation of a packed view ([`HeadsView::packed`]) in place: each sequence's rows at
/// positions `offset..offset + len`, as a padded view's (`lens`: the packed lengths the view was
/// made with). The rows of other sequences are not touched.
pub fn rope_forward_packed_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &HeadsView,
    table: &RopeTable,
    lens: &SeqLens,
    offset: usize,
) -> Result<()> {
    record(ctx, encoder, x, table, Positions::Packed(lens, offset), 1.0)
}

/// The backward of [`rope_forward_packed_into`], in place.
pub fn rope_backward_packed_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    dx: &HeadsView,
    table: &RopeTable,
    lens: &SeqLens,
    offset: usize,
) -> Result<()> {
    record(
        ctx,
        encoder,
        dx,
        table,
        Positions::Packed(lens, offset),
        -1.0,
    )
}

/// Records the rotation of new tokens in place when decoding: row `l` of sequence `b` sits at
/// `kv_lens[b] - q_lens[b] + l` (`lens` as [`SeqLens::check_decode`] describes; rows past
/// `q_lens[b]` are rotated as padding). New rows packed on the queries' side of packed lengths (a
/// packed prefill) are rotated likewise, each sequence's own only.
pub fn rope_forward_cached_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &HeadsView,
    table: &RopeTable,
    lens: &SeqLens,
) -> Result<()> {
    record(ctx, encoder, x, table, Positions::AfterCached(lens), 1.0)
}

fn record(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &HeadsView,
    table: &RopeTable,
    positions: Positions<'_>,
    sign: f32,
) -> Result<()> {
    crate::kernels::arguments::check_f32(&[("x", x)])?;
    let [b, l, h, d] = x.shape();
    if table.rotary_dim > d {
        return Err(Error::shape(
            "rotary_dim",
            format!(
                "is {} but the heads have {d} dims; it must be at most the head dim",
                table.rotary_dim
            ),
        ));
    }
    let packed = match (x.packed_side(), positions) {
        (None, Positions::Packed(..)) => {
            return Err(Error::shape(
                "x",
                "is not packed; rotate a padded view with rope_forward_into",
            ))
        }
        (Some(_), Positions::From(_)) => {
            return Err(Error::shape(
                "x",
                "is packed; rotate it with rope_forward_packed_into and its lengths",
            ))
        }
        (Some(side), Positions::Packed(lens, _)) => {
            crate::kernels::arguments::check_packed_view("x", x, lens)?;
            Some(side)
        }
        // New tokens after a cache, packed: a packed prefill.
        (Some(side), Positions::AfterCached(lens)) => {
            crate::kernels::arguments::check_packed_queries(&[("x", x)], Some(lens))?;
            Some(side)
        }
        (None, _) => None,
    };
    // Rows from an offset (padded or packed) fit the table whole; new tokens after a cache by their
    // lengths.
    let (offset, lens) = match positions {
        Positions::From(offset) => (Some(offset), None),
        Positions::Packed(lens, offset) => (Some(offset), Some(lens)),
        Positions::AfterCached(lens) => {
            lens.check_decode(b, l, table.max_positions)?;
            (None, Some(lens))
        }
    };
    if let Some(offset) = offset.filter(|offset| offset + l > table.max_positions) {
        return Err(Error::shape(
            "rope positions",
            format!(
                "offset {offset} + length {l} exceeds the table's {} positions; build the RopeTable with more",
                table.max_positions
            ),
        ));
    }
    let offset = offset.unwrap_or(0);
    let mut inputs = vec![("rope table", table.table.region())];
    inputs.extend(lens.map(|l| ("seq_lens", l.region())));
    crate::kernels::arguments::check_call(ctx, &[("x", x.region())], &inputs)?;
    check_binding(ctx, "rope x", x.buffer().size())?;
    let narrow = |v: usize| {
        u32::try_from(v).map_err(|_| Error::Unsupported {
            arg: "rope view (offset or stride in elements)",
            value: v as u64,
            limit: u32::MAX as u64,
            hint: "",
        })
    };
    let [sb, ss, sh] = x.strides();
    let pairs = table.rotary_dim / 2;
    let invocations = b * l * h * pairs;
    let params = RopeParams {
        batch: b as u32,
        seq: l as u32,
        heads: h as u32,
        pairs: pairs as u32,
        offset: offset as u32,
        interleaved: (table.layout == RopeLayout::Interleaved) as u32,
        sign,
        grid_x: grid_x(ctx, invocations)?,
        view_offset: narrow(x.offset())?,
        stride_b: narrow(sb)?,
        stride_s: narrow(ss)?,
        stride_h: narrow(sh)?,
        max_positions: table.max_positions as u32,
        // 2: a tree step, rows at their depths.
        per_sequence: match (positions, lens) {
            (Positions::AfterCached(_), Some(lens)) => 1 + lens.check_tree_slots(l)? as u32,
            _ => 0,
        },
        packed: match packed {
            None => 0,
            Some(PackedSide::Queries) => 1,
            Some(PackedSide::Keys) => 2,
        },
        pad: 0,
    };
    let lens = lens.map_or(ctx.empty_storage(), SeqLens::buffer);
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "rope",
            source: ROPE,
            constants: &[],
        },
        bytemuck::bytes_of(&params),
        &[table.table.buffer(), x.buffer(), lens],
        invocations,
    )
}

/// The angular frequency of pair `k`, `base^(-2k / rotary_dim)` stretched by `scaling` (the host's
/// statement; the reference has its own).
fn frequency(k: usize, base: f64, rotary_dim: usize, scaling: Option<RopeScaling>) -> f64 {
    let inv = base.powf(-2.0 * k as f64 / rotary_dim as f64);
    match scaling {
        None => inv,
        Some(RopeScaling::Linear { factor }) => inv / f64::from(factor),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_positions,
        }) => {
            let wavelength = std::f64::consts::TAU / inv;
            let original = original_max_positions as f64;
            let (low, high) = (f64::from(low_freq_factor), f64::from(high_freq_factor));
            let scaled = inv / f64::from(factor);
            if wavelength < original / high {
                inv
            } else if wavelength > original / low {
                scaled
            } else {
                let smooth = (original / wavelength - low) / (high - low);
                (1.0 - smooth) * scaled + smooth * inv
            }
        }
    }
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    vec![uniform_layout!(
        "rope",
        "Params",
        RopeParams {
            batch,
            seq,
            heads,
            pairs,
            offset,
            interleaved,
            sign,
            grid_x,
            view_offset,
            stride_b,
            stride_s,
            stride_h,
            max_positions,
            per_sequence,
            packed,
            pad,
        }
    )]
}
