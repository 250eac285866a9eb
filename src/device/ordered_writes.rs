//! Buffer writes that take effect in recording order, for data a call validates on the host and its
//! kernels read on the GPU ([`crate::SeqLens::write`]). `queue.write_buffer` lands before every
//! command of the next submission, so a call recorded before the write and submitted after it would
//! read values it never validated. An ordered write waits in its own staging buffer instead, and the
//! next compute pass this context begins copies it in, in that pass's encoder, ahead of the pass:
//! calls recorded earlier read the old values, calls recorded later the new ones.

use super::Context;
use crate::error::Result;

/// A write waiting for the next compute pass: `staging` holds the values for `target`.
pub(super) struct OrderedWrite {
    staging: wgpu::Buffer,
    target: wgpu::Buffer,
}

impl Context {
    /// Writes `data` into `target` from offset 0 for every call recorded after this one, in
    /// whichever encoder, and for none recorded before (given the encoders are submitted in the
    /// order they were recorded). A second write before any pass has taken the first replaces it.
    pub(crate) fn write_in_recording_order(
        &self,
        target: &wgpu::Buffer,
        data: &[u8],
    ) -> Result<()> {
        self.check_lost()?;
        let mut pending = self
            .ordered_writes
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Not yet copied by any recorded pass: rewriting its staging buffer reaches no recorded call.
        if let Some(write) = pending.iter().find(|w| w.target == *target) {
            self.queue.write_buffer(&write.staging, 0, data);
            return Ok(());
        }
        // A staging buffer of its own, never rewritten once a recorded pass copies from it.
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("ordered write staging"),
            size: data.len() as u64,
            usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&staging, 0, data);
        pending.push(OrderedWrite {
            staging,
            target: target.clone(),
        });
        Ok(())
    }

    /// The writes waiting for the next compute pass, handed over for recording.
    pub(super) fn take_ordered_writes(&self) -> Vec<OrderedWrite> {
        std::mem::take(
            &mut *self
                .ordered_writes
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }
}

/// Records `writes` into `encoder`, which has no pass open.
pub(super) fn record_ordered_writes(encoder: &mut wgpu::CommandEncoder, writes: &[OrderedWrite]) {
    for write in writes {
        encoder.copy_buffer_to_buffer(&write.staging, 0, &write.target, 0, write.staging.size());
    }
}
