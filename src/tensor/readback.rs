//! Copies from GPU buffers back to the host: the one readback path of tensors, profiles and timers.

use super::*;

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

/// Maps a whole `MAP_READ` buffer once the submitted work is done and copies it out as `T`s: the
/// one readback path (tensors, profiler timestamps, bench timer).
pub async fn read_mapped<T: bytemuck::Pod>(ctx: &Context, buffer: &wgpu::Buffer) -> Result<Vec<T>> {
    let slice = buffer.slice(..);
    let (sender, receiver) = futures_intrusive::channel::shared::oneshot_channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = sender.send(r);
    });
    ctx.synchronize()?;
    let mapped = receiver.receive().await;
    // A browser reports a device error (a shader its compiler refused, a validation error) to the
    // uncaptured-error handler asynchronously: by the time the map resolves it has, and the data
    // read would be what the failed work never wrote.
    #[cfg(target_arch = "wasm32")]
    ctx.take_device_error()?;
    match mapped {
        Some(Ok(())) => {}
        Some(Err(e)) => return Err(Error::Readback(e.to_string())),
        None => return Err(Error::Readback("map callback dropped".into())),
    }
    let data = {
        let view = slice
            .get_mapped_range()
            .map_err(|e| Error::Readback(e.to_string()))?;
        bytemuck::pod_collect_to_vec(&view[..])
    };
    buffer.unmap();
    Ok(data)
}
