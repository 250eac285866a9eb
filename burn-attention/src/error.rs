//! Typed errors, and the slot that carries a kernel call's error across burn's dispatch.

use std::cell::RefCell;

/// What went wrong, with the argument and the value where an argument is at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor is on a device the fused kernels cannot reach: another back end, another wgpu
    /// device than the other arguments, or a wgpu device not registered with
    /// [`init`](crate::init) / [`register_setup`](crate::register_setup).
    #[error("{arg} is on {found}: {message}")]
    Device {
        /// The argument.
        arg: &'static str,
        /// Its device.
        found: String,
        /// Why it cannot be used.
        message: String,
    },
    /// A shape the op does not take.
    #[error("{arg} has shape {found:?}: {message}")]
    Shape {
        /// The argument.
        arg: &'static str,
        /// Its shape.
        found: Vec<usize>,
        /// What was expected.
        message: String,
    },
    /// An element type the kernels do not take.
    #[error("{arg} is {found}: {message}")]
    DType {
        /// The argument.
        arg: &'static str,
        /// Its element type.
        found: String,
        /// What was expected.
        message: String,
    },
    /// The device was registered once already (burn keeps one runtime per device).
    #[error("{0} was already brought up by burn; register it before its first use")]
    AlreadyInitialised(String),
    /// burn or its runtime refused (device setup, a buffer it could not hand over).
    #[error("burn: {0}")]
    Burn(String),
    /// The attention library refused the call or the device failed: its own typed error.
    #[error(transparent)]
    Attention(#[from] wgpu_attention::Error),
}

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;

thread_local! {
    /// The error of the last kernel call on this thread. burn's dispatch returns tensors, not
    /// results, so a kernel call that fails leaves its error here and placeholders in its outputs;
    /// the public entry points take it right after the call (same thread, no fusion: the call ran
    /// before dispatch returned) and return it instead of the placeholders.
    static FAILURE: RefCell<Option<Error>> = const { RefCell::new(None) };
}

/// Leaves `error` for the entry point that made the call.
pub(crate) fn record(error: Error) {
    log::debug!("burn-attention: kernel call refused: {error}");
    FAILURE.with(|slot| *slot.borrow_mut() = Some(error));
}

/// The error a kernel call on this thread left, if any (clearing it).
pub(crate) fn take() -> Option<Error> {
    FAILURE.with(|slot| slot.borrow_mut().take())
}
