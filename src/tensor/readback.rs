//! Copies from GPU buffers back to the host, through [`crate::device::read_mapped`].

use super::F32;
use crate::device::{read_mapped, Context};
use crate::error::{Error, Result};

/// Copies `len` f32 values starting at element `offset` of `buffer` back to the host.
pub(crate) async fn read_buffer(
    ctx: &Context,
    buffer: &wgpu::Buffer,
    offset: usize,
    len: usize,
) -> Result<Vec<f32>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if !buffer.usage().contains(wgpu::BufferUsages::COPY_SRC) {
        return Err(Error::Readback("the buffer lacks COPY_SRC usage".into()));
    }
    let bytes = len as u64 * F32;
    let staging = ctx.create_uncounted_buffer(
        "readback",
        bytes,
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
    )?;
    let mut encoder = ctx
        .device()
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("readback"),
        });
    encoder.copy_buffer_to_buffer(buffer, offset as u64 * F32, &staging, 0, bytes);
    ctx.submit(encoder)?;

    read_mapped(ctx, &staging).await
}

/// Reads `len` f16 elements of `buffer` from element `offset` (even; whole words are copied).
pub(crate) async fn read_f16(
    ctx: &Context,
    buffer: &wgpu::Buffer,
    offset: usize,
    len: usize,
) -> Result<Vec<half::f16>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let words = read_buffer(ctx, buffer, offset / 2, len.div_ceil(2)).await?;
    let mut halves: Vec<half::f16> = bytemuck::cast_slice(&words).to_vec();
    halves.truncate(len);
    Ok(halves)
}
