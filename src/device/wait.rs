//! Waiting on the GPU from synchronous code: every blocking call wraps its `_async` form here.

use std::future::Future;

#[cfg(target_arch = "wasm32")]
use crate::error::Error;
use crate::error::Result;

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
