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
use crate::tensor::{GpuTensor, Region};

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
    for (arg, region) in args {
        if region.context.is_some_and(|c| c != ctx.id()) {
            return Err(Error::ForeignTensor {
                arg,
                adapter: ctx.report().name.clone(),
            });
        }
    }
    Ok(())
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
