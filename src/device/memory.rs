//! Buffers this crate allocates on a context, their byte counts (current and peak) and the
//! grow-only scratch buffers of kernels that need a workspace.

use super::Context;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes of tensor storage this crate has allocated on a context (user-wrapped buffers, uniform
/// blocks and readback staging are not counted).
#[derive(Debug, Default)]
pub(crate) struct MemoryCounter {
    current: AtomicU64,
    peak: AtomicU64,
}

/// A live allocation: releases its bytes from the counter when the last tensor using it is dropped.
#[derive(Debug)]
pub(crate) struct Allocation {
    bytes: u64,
    counter: Arc<MemoryCounter>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.counter
            .current
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Current and peak bytes of tensors allocated through a [`Context`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes of the live buffers this context allocated.
    pub current_bytes: u64,
    /// The most bytes live at once since the context was created or `reset_peak_memory`.
    pub peak_bytes: u64,
}

impl Context {
    /// The scratch buffer `what` (one per purpose, so two kinds of workspace of one call never
    /// alias), at least `bytes`, counted in [`Context::memory`]. See `scratch` above.
    pub(crate) fn scratch_buffer(&self, what: &'static str, bytes: u64) -> Result<wgpu::Buffer> {
        let mut slots = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((buffer, _)) = slots.get(what).filter(|(b, _)| b.size() >= bytes) {
            return Ok(buffer.clone());
        }
        // Room to grow, within what one binding can use.
        let cap = self.limits().max_storage_buffer_binding_size.max(bytes);
        let size = bytes.max(256).next_power_of_two().min(cap).div_ceil(4) * 4;
        let (buffer, allocation) = self.create_buffer(what, size, wgpu::BufferUsages::STORAGE)?;

        slots.insert(what, (buffer.clone(), allocation));
        Ok(buffer)
    }

    /// Allocates a buffer of `bytes` for `what`, counted in [`Context::memory`]: the allocation path
    /// of every tensor and workspace (see [`Context::create_uncounted_buffer`]).
    pub(crate) fn create_buffer(
        &self,
        what: &'static str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<(wgpu::Buffer, Allocation)> {
        let buffer = self.create_uncounted_buffer(what, bytes, usage)?;
        Ok((buffer, self.track_allocation(bytes)))
    }

    /// Allocates a buffer, refused with a typed error on a lost device, beyond `max_buffer_size`, or
    /// when the device is out of memory (caught by an error scope rather than left to wgpu's
    /// uncaptured-error handler). Not counted: for short-lived staging buffers.
    pub fn create_uncounted_buffer(
        &self,
        what: &'static str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        self.check_lost()?;
        let limit = self.limits().max_buffer_size;
        if bytes > limit {
            return Err(Error::Unsupported {
                arg: what,
                value: bytes,
                limit,
                hint:
                    " bytes (the adapter's max_buffer_size): use a smaller batch or sequence length",
            });
        }
        let descriptor = wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes,
            usage,
            mapped_at_creation: false,
        };
        // A browser answers an error scope only after control returns to its event loop, which a
        // synchronous allocation cannot wait for: there an out-of-memory error reaches the
        // uncaptured-error handler instead, and the next wait reports it (`Error::Device`).
        #[cfg(target_arch = "wasm32")]
        return Ok(self.device.create_buffer(&descriptor));
        #[cfg(not(target_arch = "wasm32"))]
        {
            let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let buffer = self.device.create_buffer(&descriptor);
            if pollster::block_on(scope.pop()).is_some() {
                buffer.destroy();
                return Err(Error::OutOfMemory {
                    what,
                    bytes,
                    allocated: self.memory().current_bytes,
                });
            }
            Ok(buffer)
        }
    }

    /// Tensor memory allocated through this context: now and at its peak since the last
    /// [`Context::reset_peak_memory`].
    pub fn memory(&self) -> MemoryStats {
        MemoryStats {
            current_bytes: self.memory.current.load(Ordering::Relaxed),
            peak_bytes: self.memory.peak.load(Ordering::Relaxed),
        }
    }

    /// Sets the peak to the current allocation.
    pub fn reset_peak_memory(&self) {
        let current = self.memory.current.load(Ordering::Relaxed);
        self.memory.peak.store(current, Ordering::Relaxed);
    }

    pub(crate) fn track_allocation(&self, bytes: u64) -> Allocation {
        let now = self.memory.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.memory.peak.fetch_max(now, Ordering::Relaxed);
        Allocation {
            bytes,
            counter: self.memory.clone(),
        }
    }
}
