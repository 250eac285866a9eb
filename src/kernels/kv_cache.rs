//! Key/value cache append (`shaders/kv_cache_append.wgsl`): a decoding step's new keys or values, a
//! strided `[B, L, H, D]` view (the K or V columns of a projection), copied into a cache
//! `[B, max_len, H, D]` after each sequence's cached tokens. The cache itself (per layer, with its
//! lengths) is [`crate::inference::KvCache`]. CPU reference: [`crate::reference::kv_cache`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::check_binding;
use crate::kernels::dispatch::{encode, grid_x};
use crate::tensor::{GpuTensor, HeadsView, SeqLens};

const APPEND: &str = include_str!("../../shaders/kv_cache_append.wgsl");

/// The append shader by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![("kv_cache_append", APPEND.to_string())]
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AppendParams {
    batch: u32,
    seq: u32,
    heads: u32,
    dim: u32,
    max_len: u32,
    grid_x: u32,
    view_offset: u32,
    stride_b: u32,
    stride_s: u32,
    stride_h: u32,
    pad: [u32; 2],
}

/// Records the copy of `new [B, L, H, D]` into `cache [B, max_len, H, D]`: row `l < q_lens[b]` of
/// sequence `b` to position `kv_lens[b] - q_lens[b] + l` (`lens` as [`SeqLens::check_decode`]
/// describes: `kv_lens` counts the new rows). Nothing is recorded if the input is rejected.
pub fn kv_cache_append_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    new: &HeadsView,
    cache: &GpuTensor,
    lens: &SeqLens,
) -> Result<()> {
    crate::kernels::attention::check_f32(&[("new", new)])?;
    let [b, l, h, d] = new.shape();
    let &[cb, max_len, ch, cd] = cache.shape() else {
        return Err(Error::shape(
            "cache",
            format!(
                "has shape {:?}; expected [batch, max_len, heads, head_dim]",
                cache.shape()
            ),
        ));
    };
    if [cb, ch, cd] != [b, h, d] {
        return Err(Error::shape(
            "cache",
            format!(
                "has shape {:?}; the new rows {:?} need [{b}, max_len, {h}, {d}]",
                cache.shape(),
                new.shape()
            ),
        ));
    }
    lens.check_decode(b, l, max_len)?;
    crate::kernels::arguments::check_call(
        ctx,
        &[("cache", cache.region())],
        &[("new", new.region()), ("seq_lens", lens.region())],
    )?;
    check_binding(ctx, "kv cache", cache.size_bytes())?;
    check_binding(ctx, "new kv rows", new.buffer().size())?;
    let narrow = |v: usize| {
        u32::try_from(v).map_err(|_| Error::Unsupported {
            arg: "new kv rows (offset or stride in elements)",
            value: v as u64,
            limit: u32::MAX as u64,
            hint: "",
        })
    };
    let [sb, ss, sh] = new.strides();
    let n = b * l * h * d;
    let params = AppendParams {
        batch: b as u32,
        seq: l as u32,
        heads: h as u32,
        dim: d as u32,
        max_len: max_len as u32,
        grid_x: grid_x(n),
        view_offset: narrow(new.offset())?,
        stride_b: narrow(sb)?,
        stride_s: narrow(ss)?,
        stride_h: narrow(sh)?,
        pad: [0; 2],
    };
    encode(
        ctx,
        encoder,
        "kv_cache_append",
        APPEND,
        &[],
        bytemuck::bytes_of(&params),
        &[new.buffer(), cache.buffer(), lens.buffer()],
        n,
    );
    Ok(())
}
