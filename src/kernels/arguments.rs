//! Argument checks every kernel's host wrapper runs before it records anything: what wgpu would
//! otherwise reject inside the user's `queue.submit` (a panic on their device), stated once.
//!
//! The rules (also in the README's "Buffers and aliasing"):
//! - every tensor of a call belongs to the call's [`Context`] (tensors carry the context that
//!   allocated them; buffers the application wraps are taken as the context's);
//! - an output shares no *buffer* with an input of the same call: wgpu tracks usage per buffer, not
//!   per range, and a buffer bound read-only and read-write in one dispatch is a usage conflict,
//!   even where the ranges are disjoint;
//! - outputs do not overlap each other (several outputs in one buffer, like a packed dQKV, are
//!   fine at disjoint ranges);
//! - a storage binding fits the device's `max_storage_buffer_binding_size`.

use crate::device::Context;
use crate::error::{Error, Result};
use crate::tensor::{DType, GpuTensor, HeadsView, PackedSide, Region, SeqLens};

/// Refuses a storage binding of `bytes` over the device's limit.
pub(crate) fn check_binding(ctx: &Context, arg: &'static str, bytes: u64) -> Result<()> {
    let limit = ctx.limits().max_storage_buffer_binding_size;
    if bytes > limit {
        return Err(Error::BindingTooLarge { arg, bytes, limit });
    }
    Ok(())
}

/// Refuses tensors of another context: their buffers live on another device (or, for two
/// contexts of one device, in another pipeline and memory account).
pub(crate) fn check_context(ctx: &Context, args: &[(&'static str, Region<'_>)]) -> Result<()> {
    args.iter()
        .try_for_each(|(arg, region)| ctx.check_owns(arg, region.context))
}

/// The aliasing rules of one call (module docs): every argument of `ctx`, no output in the buffer
/// of an input, no two outputs overlapping.
pub(crate) fn check_call(
    ctx: &Context,
    outputs: &[(&'static str, Region<'_>)],
    inputs: &[(&'static str, Region<'_>)],
) -> Result<()> {
    check_context(ctx, outputs)?;
    check_context(ctx, inputs)?;
    for (i, (arg, out)) in outputs.iter().enumerate() {
        if let Some((other, _)) = inputs.iter().find(|(_, x)| x.buffer == out.buffer) {
            return Err(Error::Aliasing {
                arg,
                other,
                rule: "an output may not share a buffer with an input of the same call (wgpu \
                       tracks usage per buffer: read-only and read-write bindings of one buffer \
                       conflict even at disjoint ranges); write it to a separate buffer",
            });
        }
        if let Some((other, _)) = outputs[..i].iter().find(|(_, o)| o.overlaps(out)) {
            return Err(Error::Aliasing {
                arg,
                other,
                rule: "two outputs of one call may not overlap (one would overwrite the other); \
                       give each its own tensor or a disjoint range",
            });
        }
    }
    Ok(())
}

/// [`check_call`] on whole tensors.
pub(crate) fn check_tensors(
    ctx: &Context,
    outputs: &[(&'static str, &GpuTensor)],
    inputs: &[(&'static str, &GpuTensor)],
) -> Result<()> {
    fn regions<'a>(args: &[(&'static str, &'a GpuTensor)]) -> Vec<(&'static str, Region<'a>)> {
        args.iter().map(|(arg, t)| (*arg, t.region())).collect()
    }
    check_call(ctx, &regions(outputs), &regions(inputs))
}

/// Refuses f16 views in the ops that take only f32.
pub(crate) fn check_f32(views: &[(&'static str, &HeadsView)]) -> Result<()> {
    for &(arg, view) in views {
        if view.dtype() != DType::F32 {
            return Err(Error::DType {
                arg,
                found: view.dtype().name(),
                message: "this operation takes f32 views; f16 runs in the fused \
                          attention_forward_into and attention_backward_into"
                    .into(),
            });
        }
    }
    Ok(())
}

/// The error of packed views without the packed lengths they were made with.
pub(crate) fn packed_lens_missing() -> Error {
    Error::shape(
        "seq_lens",
        "packed views need the packed batch's lengths: pass the SeqLens::packed the views were made with",
    )
}

/// Checks a packed view against the packed lengths `lens` a kernel reads it by: the same sequences,
/// each within the view's longest, all within its rows.
pub(crate) fn check_packed_view(arg: &'static str, view: &HeadsView, lens: &SeqLens) -> Result<()> {
    let (Some(rows), Some(side)) = (view.packed_rows(), view.packed_side()) else {
        return Ok(());
    };
    if !lens.is_packed() {
        return Err(packed_lens_missing());
    }
    let [batch, longest, _, _] = view.shape();
    let lengths = lens.lens(side).unwrap_or(&[]);
    let total = lens.packed_total(side);
    if batch != lens.batch() || lengths.iter().any(|&l| l as usize > longest) || total > rows {
        return Err(Error::shape(
            arg,
            format!(
                "is packed for {batch} sequences of at most {longest} rows in {rows} rows; the \
                 lengths have {} sequences, {total} rows ({side:?}: {lengths:?})",
                lens.batch()
            ),
        ));
    }
    Ok(())
}

/// Checks packed new rows of a decoding step (a packed prefill: each sequence's new tokens one
/// after another, packed on the queries' side of `lens`: `q_lens` new, `kv_lens` cached); returns
/// whether any view is packed.
pub(crate) fn check_packed_queries(
    views: &[(&'static str, &HeadsView)],
    lens: Option<&SeqLens>,
) -> Result<bool> {
    let mut packed = false;
    for &(arg, view) in views {
        match (view.packed_side(), lens) {
            (None, _) => {}
            (Some(PackedSide::Keys), _) => {
                return Err(Error::shape(
                    arg,
                    "is packed on the keys' lengths; new rows are packed on the queries' (q_lens: \
                     the new tokens of each sequence)",
                ))
            }
            (Some(PackedSide::Queries), None) => return Err(packed_lens_missing()),
            (Some(PackedSide::Queries), Some(lens)) => {
                check_packed_view(arg, view, lens)?;
                packed = true;
            }
        }
    }
    Ok(packed)
}
