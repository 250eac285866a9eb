//! Waiting on the GPU: every blocking call wraps its `_async` form here, and every readback maps its
//! buffer through [`read_mapped`].

use super::Context;
use crate::error::{Error, Result};
use std::future::Future;

/// Runs `future` to completion. Natively it blocks the thread (pollster). In a browser, where the
/// page's thread must never block, a future that is ready at its first poll (one that waits for
/// nothing: a decoding step without sampling, a prefill) completes, and one that would wait is
/// refused with [`Error::WouldBlock`](crate::Error::WouldBlock) naming `call`, whose `_async` form is what a page uses.
pub fn block_on<T>(call: &'static str, future: impl Future<Output = Result<T>>) -> Result<T> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = call;
        pollster::block_on(future)
    }
    #[cfg(target_arch = "wasm32")]
    {
        let mut future = std::pin::pin!(future);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match future.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => Err(Error::WouldBlock { call }),
        }
    }
}

/// Maps a whole `MAP_READ` buffer once the submitted work is done and copies it out as `T`s: the
/// one readback path (tensors, profiler timestamps, bench timer, sampled tokens).
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
