//! The key/value cache of a decoder's self-attention layers: per layer, keys and values
//! `[batch, capacity, heads, head_dim]` preallocated once, and each sequence's cached length. A
//! decoding step appends its new keys and values in place (`kernels::kv_cache`) and attends over the
//! cache (`kernels::attention::attention_decode_into`); the lengths advance only once a step is
//! recorded, so a rejected step leaves the cache as it was.

use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::kv_cache::{KvFormat, KvStorage};

/// Per decoder layer, the keys and values of every cached position, `[batch, capacity, kv heads,
/// head_dim]` (f32 or int8), and each sequence's cached length.
pub struct KvCache {
    layers: Vec<[KvStorage; 2]>,
    /// One position of keys and of values, where a row move stages its row.
    staging: [KvStorage; 2],
    lens: Vec<u32>,
    capacity: usize,
}

/// The lengths of one step: new tokens per sequence and cached tokens including them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepLens {
    /// New tokens per sequence this step.
    pub new: Vec<u32>,
    /// Cached tokens per sequence after this step, the new ones included.
    pub total: Vec<u32>,
}

impl KvCache {
    /// Caches for `layers` layers of `batch` sequences of up to `capacity` tokens.
    pub fn new(
        ctx: &Context,
        layers: usize,
        batch: usize,
        capacity: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Self::with_dims(ctx, layers, batch, capacity, heads, [head_dim, head_dim])
    }

    /// [`KvCache::new`] with keys and values of different widths per head, `[key_dim, value_dim]`
    /// (additive attention caches its key projections `b`, `Da` wide).
    pub fn with_dims(
        ctx: &Context,
        layers: usize,
        batch: usize,
        capacity: usize,
        heads: usize,
        dims: [usize; 2],
    ) -> Result<Self> {
        Self::with_format(ctx, layers, batch, capacity, heads, dims, KvFormat::F32)
    }

    /// [`KvCache::with_dims`] storing keys and values in `format` (int8: head dimensions a
    /// multiple of 4).
    pub fn with_format(
        ctx: &Context,
        layers: usize,
        batch: usize,
        capacity: usize,
        heads: usize,
        [key_dim, value_dim]: [usize; 2],
        format: KvFormat,
    ) -> Result<Self> {
        if batch == 0 || capacity == 0 || capacity > i32::MAX as usize {
            return Err(Error::shape(
                "KvCache",
                format!(
                    "batch {batch} and capacity {capacity} must be positive (capacity below 2^31)"
                ),
            ));
        }
        let layers = (0..layers)
            .map(|_| {
                Ok([
                    KvStorage::zeros(ctx, &[batch, capacity, heads, key_dim], format)?,
                    KvStorage::zeros(ctx, &[batch, capacity, heads, value_dim], format)?,
                ])
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            staging: [
                KvStorage::zeros(ctx, &[1, heads, key_dim], format)?,
                KvStorage::zeros(ctx, &[1, heads, value_dim], format)?,
            ],
            lens: vec![0; batch],
            capacity,
        })
    }

    /// Sequences the cache holds.
    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    /// Positions each sequence can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tokens cached per sequence.
    pub fn lens(&self) -> &[u32] {
        &self.lens
    }

    /// Every layer's (keys, values).
    pub fn layers(&self) -> Vec<[&KvStorage; 2]> {
        self.layers.iter().map(|[k, v]| [k, v]).collect()
    }

    /// Bytes of cache storage.
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|[k, v]| k.size_bytes() + v.size_bytes())
            .sum()
    }

    /// The lengths of a step that adds `new[b]` tokens to sequence `b`, checked against the batch
    /// and the capacity (nothing changes until [`KvCache::advance`]).
    pub fn step(&self, new: &[u32]) -> Result<StepLens> {
        if new.len() != self.batch() {
            return Err(Error::shape(
                "new tokens",
                format!(
                    "{} sequences given for a cache of {}",
                    new.len(),
                    self.batch()
                ),
            ));
        }
        let mut total = Vec::with_capacity(new.len());
        for (b, (&n, &len)) in new.iter().zip(&self.lens).enumerate() {
            let sum = len as usize + n as usize;
            if sum > self.capacity {
                return Err(Error::shape(
                    "sequence length",
                    format!(
                        "sequence {b} would hold {sum} tokens ({len} cached + {n} new), beyond the cache capacity {}; build the generator with a larger capacity",
                        self.capacity
                    ),
                ));
            }
            total.push(sum as u32);
        }
        Ok(StepLens {
            new: new.to_vec(),
            total,
        })
    }

    /// Records that a step's tokens are in the cache.
    pub fn advance(&mut self, step: &StepLens) {
        self.lens.copy_from_slice(&step.total);
    }

    /// Forgets every sequence (the buffers are kept and overwritten by the next tokens).
    pub fn clear(&mut self) {
        self.lens.fill(0);
    }

    /// Forgets sequence `b` (its rows are overwritten by its next tokens).
    pub fn reset(&mut self, b: usize) -> Result<()> {
        match self.lens.get_mut(b) {
            Some(len) => {
                *len = 0;
                Ok(())
            }
            None => Err(Error::shape(
                "sequence",
                format!("is {b}; the cache holds {}", self.lens.len()),
            )),
        }
    }

    /// Keeps the first `len` tokens of sequence `b` (a rejected draft's rows are overwritten by the
    /// next tokens).
    pub fn truncate(&mut self, b: usize, len: usize) -> Result<()> {
        match self.lens.get_mut(b) {
            Some(held) if len <= *held as usize => {
                *held = len as u32;
                Ok(())
            }
            Some(held) => Err(Error::shape(
                "len",
                format!("is {len}; sequence {b} holds only {held} tokens"),
            )),
            None => Err(Error::shape(
                "sequence",
                format!("is {b}; the cache holds {}", self.lens.len()),
            )),
        }
    }

    /// Records, for every layer, the copy of sequence `b`'s keys and values at each position
    /// `from` to position `to` (`moves` in order; positions below the capacity).
    pub(crate) fn move_rows(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        b: usize,
        moves: &[(usize, usize)],
    ) {
        let row = |p: usize| b * self.capacity + p;
        for pair in &self.layers {
            for (cache, staging) in pair.iter().zip(&self.staging) {
                for &(from, to) in moves {
                    copy_row(encoder, cache, staging, row(from), row(to));
                }
            }
        }
    }
}

/// Records the copy of row `from` of `cache` (storage `[rows, heads, dim]` or `[batch, len, heads,
/// dim]`, a row being one position's heads) to row `to`, through the first row of `staging`: a
/// buffer cannot be copied onto itself.
pub(crate) fn copy_row(
    encoder: &mut wgpu::CommandEncoder,
    cache: &KvStorage,
    staging: &KvStorage,
    from: usize,
    to: usize,
) {
    let (cache, staging) = (cache.words(), staging.words());
    let shape = cache.shape();
    let bytes = 4 * (shape[shape.len() - 2] * shape[shape.len() - 1]) as u64;
    let at = |row: usize| cache.byte_offset() + row as u64 * bytes;
    let stage = staging.byte_offset();
    encoder.copy_buffer_to_buffer(cache.buffer(), at(from), staging.buffer(), stage, bytes);
    encoder.copy_buffer_to_buffer(staging.buffer(), stage, cache.buffer(), at(to), bytes);
}
