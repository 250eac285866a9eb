//! A paged key/value cache (vLLM's PagedAttention layout): per decoder layer one pool of fixed-size
//! blocks of keys and one of values, shared by every sequence, and a block table giving each
//! sequence slot its blocks in order. Memory grows with the tokens cached, not with capacity x
//! batch; sequences join, leave and fork without moving cached data: a fork shares its parent's
//! blocks, and a block still shared when a sequence writes into it is copied first (copy-on-write),
//! so a common prompt prefix is stored once. Decode attention and the cache append read and write
//! through the table ([`crate::kernels::attention::attention_decode_paged_into`],
//! [`crate::kernels::kv_cache::kv_cache_append_paged_into`]).

use crate::device::Context;
use crate::error::{Error, Result};
use crate::inference::kv_cache::StepLens;
use crate::kernels::kv_cache::BlockTable;
use crate::tensor::GpuTensor;

/// The sizes of a [`PagedKvCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PagedKvCacheConfig {
    /// Decoder layers (one pool pair each).
    pub layers: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Widths of a key and a value per head, `[key_dim, value_dim]`.
    pub dims: [usize; 2],
    /// Tokens per block (16 to 64 in serving systems).
    pub page: usize,
    /// Blocks in each pool: the tokens all sequences together can hold, in pages.
    pub pool_blocks: usize,
    /// Sequence slots (sequences held at once, forks included).
    pub slots: usize,
    /// The most tokens one sequence can hold.
    pub max_len: usize,
}

impl PagedKvCacheConfig {
    /// A cache for `layers` layers of `kv_heads` heads of `head_dim` (keys and values), `pool_blocks`
    /// blocks of `page` tokens, `slots` sequences of up to `max_len` tokens.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        page: usize,
        pool_blocks: usize,
        slots: usize,
        max_len: usize,
    ) -> Self {
        Self {
            layers,
            kv_heads,
            dims: [head_dim, head_dim],
            page,
            pool_blocks,
            slots,
            max_len,
        }
    }
}

/// One sequence's blocks, in order, and its cached length.
#[derive(Clone, Debug, Default)]
struct Sequence {
    blocks: Vec<u32>,
    len: usize,
}

/// Key and value pools per layer, the block table, and the host's record of blocks and sequences.
pub struct PagedKvCache {
    config: PagedKvCacheConfig,
    /// Per layer, keys `[pool_blocks * page, kv_heads, key_dim]` and values likewise.
    layers: Vec<[GpuTensor; 2]>,
    table: BlockTable,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// Unused blocks, the next one last.
    free: Vec<u32>,
    slots: Vec<Option<Sequence>>,
    /// One block of keys and of values, where copy-on-write stages a shared block.
    staging: [GpuTensor; 2],
}

impl PagedKvCache {
    /// Allocates the pools (every block free) and the table.
    pub fn new(ctx: &Context, config: PagedKvCacheConfig) -> Result<Self> {
        let c = config;
        for (arg, value) in [
            ("layers", c.layers),
            ("kv_heads", c.kv_heads),
            ("key dim", c.dims[0]),
            ("value dim", c.dims[1]),
            ("max_len", c.max_len),
        ] {
            if value == 0 {
                return Err(Error::shape(arg, "is 0; it must be at least 1"));
            }
        }
        let stride = c.max_len.div_ceil(c.page.max(1));
        let table = BlockTable::new(ctx, c.slots, stride, c.page, c.pool_blocks)?;
        let rows = c.pool_blocks * c.page;
        let layers = (0..c.layers)
            .map(|_| {
                Ok([
                    GpuTensor::zeros(ctx, &[rows, c.kv_heads, c.dims[0]])?,
                    GpuTensor::zeros(ctx, &[rows, c.kv_heads, c.dims[1]])?,
                ])
            })
            .collect::<Result<_>>()?;
        let staging = [
            GpuTensor::zeros(ctx, &[c.page, c.kv_heads, c.dims[0]])?,
            GpuTensor::zeros(ctx, &[c.page, c.kv_heads, c.dims[1]])?,
        ];
        Ok(Self {
            config: c,
            layers,
            table,
            refs: vec![0; c.pool_blocks],
            free: (0..c.pool_blocks as u32).rev().collect(),
            slots: vec![None; c.slots],
            staging,
        })
    }

    /// The sizes it was built with.
    pub fn config(&self) -> &PagedKvCacheConfig {
        &self.config
    }

    /// Every layer's key and value pools, `[pool_blocks * page, kv_heads, dim]`.
    pub fn layers(&self) -> &[[GpuTensor; 2]] {
        &self.layers
    }

    /// The block table (one row per slot; an empty slot's row is unused).
    pub fn table(&self) -> &BlockTable {
        &self.table
    }

    /// Bytes of the pools.
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|[k, v]| k.size_bytes() + v.size_bytes())
            .sum()
    }

    /// Blocks no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Tokens cached in slot `slot`, or `None` if it holds no sequence.
    pub fn len(&self, slot: usize) -> Option<usize> {
        self.slots.get(slot)?.as_ref().map(|s| s.len)
    }

    /// Tokens cached per slot (0 for empty slots).
    pub fn lens(&self) -> Vec<u32> {
        self.slots
            .iter()
            .map(|s| s.as_ref().map_or(0, |s| s.len as u32))
            .collect()
    }

    /// Slot `slot`'s blocks, in order (`None` if it holds no sequence).
    pub fn blocks(&self, slot: usize) -> Option<&[u32]> {
        self.slots.get(slot)?.as_ref().map(|s| s.blocks.as_slice())
    }

    fn sequence(&self, arg: &'static str, slot: usize) -> Result<&Sequence> {
        self.slots
            .get(slot)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                Error::shape(
                    arg,
                    format!("slot {slot} holds no sequence ({} slots)", self.slots.len()),
                )
            })
    }

    fn check_empty(&self, arg: &'static str, slot: usize) -> Result<()> {
        match self.slots.get(slot) {
            Some(None) => Ok(()),
            Some(Some(_)) => Err(Error::shape(
                arg,
                format!("slot {slot} holds a sequence; remove it first"),
            )),
            None => Err(Error::shape(
                arg,
                format!("slot {slot} is past the cache's {} slots", self.slots.len()),
            )),
        }
    }

    /// Starts an empty sequence in slot `slot` (which must be empty).
    pub fn add_sequence(&mut self, slot: usize) -> Result<()> {
        self.check_empty("slot", slot)?;
        self.slots[slot] = Some(Sequence::default());
        Ok(())
    }

    /// Starts a sequence in the empty slot `child` that continues slot `parent`'s: it shares every
    /// cached block (nothing is copied now; a shared block is copied when either sequence first
    /// writes into it).
    pub fn fork(&mut self, parent: usize, child: usize) -> Result<()> {
        let mut sequence = self.sequence("parent", parent)?.clone();
        self.check_empty("child", child)?;
        // Only the blocks holding tokens are shared: one the parent holds ahead of its tokens (a
        // step prepared but never recorded) stays its own, so the only shared block either writes
        // into is a partly filled last one, which `prepare` copies.
        sequence
            .blocks
            .truncate(sequence.len.div_ceil(self.config.page));
        for &b in &sequence.blocks {
            self.refs[b as usize] += 1;
        }
        self.slots[child] = Some(sequence);
        Ok(())
    }

    /// Ends every sequence (every block becomes free).
    pub fn clear(&mut self) {
        for slot in 0..self.slots.len() {
            if self.slots[slot].is_some() {
                self.remove(slot).expect("the slot holds a sequence");
            }
        }
    }

    /// Ends slot `slot`'s sequence; blocks no other sequence holds become free.
    pub fn remove(&mut self, slot: usize) -> Result<()> {
        self.sequence("slot", slot)?;
        let sequence = self.slots[slot].take().expect("checked");
        for b in sequence.blocks.into_iter().rev() {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push(b);
            }
        }
        Ok(())
    }

    /// Rolls slot `slot` back to its first `len` tokens (a rejected speculative draft), freeing
    /// the blocks past them.
    pub fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        let page = self.config.page;
        let sequence = self.sequence("slot", slot)?;
        if len > sequence.len {
            return Err(Error::shape(
                "len",
                format!("is {len}; slot {slot} holds only {} tokens", sequence.len),
            ));
        }
        let sequence = self.slots[slot].as_mut().expect("checked");
        for b in sequence.blocks.drain(len.div_ceil(page)..).rev() {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push(b);
            }
        }
        sequence.len = len;
        Ok(())
    }

    /// Prepares a step that adds `new[slot]` tokens to each slot (0 for slots not fed; every fed
    /// slot must hold a sequence): gives each sequence the blocks its new tokens fall in, copies
    /// every shared block a sequence will write into (copy-on-write, submitted here, so the cache
    /// stays whole whatever happens to the step), and uploads the table. Returns the step's lengths
    /// for the kernels' [`crate::SeqLens`]; [`PagedKvCache::advance`] records them once the step
    /// is. Checked first: on error (a slot past its `max_len`, too few free blocks) nothing
    /// changes.
    pub fn prepare(&mut self, ctx: &Context, new: &[u32]) -> Result<StepLens> {
        let (page, max_len) = (self.config.page, self.config.max_len);
        if new.len() != self.slots.len() {
            return Err(Error::shape(
                "new tokens",
                format!(
                    "{} slots given for a cache of {}",
                    new.len(),
                    self.slots.len()
                ),
            ));
        }
        // What every slot needs, before anything changes.
        let mut needed = 0;
        let mut total = Vec::with_capacity(new.len());
        for (slot, &n) in new.iter().enumerate() {
            let n = n as usize;
            let len = match (&self.slots[slot], n) {
                (_, 0) => self.len(slot).unwrap_or(0),
                (Some(s), _) => s.len,
                (None, _) => {
                    return Err(Error::shape(
                        "new tokens",
                        format!(
                        "slot {slot} is given {n} tokens but holds no sequence; add_sequence first"
                    ),
                    ))
                }
            };
            if len + n > max_len {
                return Err(Error::shape(
                    "sequence length",
                    format!("slot {slot} would hold {} tokens ({len} cached + {n} new), beyond max_len {max_len}", len + n),
                ));
            }
            total.push((len + n) as u32);
            if n > 0 {
                let s = self.slots[slot].as_ref().expect("checked");
                needed += (len + n).div_ceil(page) - s.blocks.len();
                needed += self.shared_tail(s) as usize;
            }
        }
        if needed > self.free.len() {
            return Err(Error::KvCacheFull {
                needed,
                free: self.free.len(),
                total: self.config.pool_blocks,
            });
        }
        let mut copies = ctx.device().create_command_encoder(&Default::default());
        let mut copied = false;
        for (slot, &n) in new.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let s = self.slots[slot].as_ref().expect("checked");
            if self.shared_tail(s) {
                let last = s.blocks.len() - 1;
                let old = s.blocks[last];
                let copy = self.free.pop().expect("counted");
                self.copy_block(&mut copies, old, copy);
                copied = true;
                self.refs[old as usize] -= 1;
                self.refs[copy as usize] = 1;
                self.slots[slot].as_mut().expect("checked").blocks[last] = copy;
            }
            let want = (total[slot] as usize).div_ceil(page);
            while self.slots[slot].as_ref().expect("checked").blocks.len() < want {
                let b = self.free.pop().expect("counted");
                self.refs[b as usize] = 1;
                self.slots[slot].as_mut().expect("checked").blocks.push(b);
            }
        }
        if copied {
            ctx.submit(copies)?;
        }
        self.upload(ctx)?;
        Ok(StepLens {
            new: new.to_vec(),
            total,
        })
    }

    /// Records that a prepared step's tokens are in the cache.
    pub fn advance(&mut self, step: &StepLens) {
        for (slot, &total) in step.total.iter().enumerate() {
            if let Some(s) = self.slots[slot].as_mut() {
                s.len = total as usize;
            }
        }
    }

    /// Whether a sequence's last block is partly filled and shared (its next token would write
    /// into a block another sequence reads).
    fn shared_tail(&self, s: &Sequence) -> bool {
        !s.len.is_multiple_of(self.config.page)
            && s.blocks.last().is_some_and(|&b| self.refs[b as usize] > 1)
    }

    /// Records the copy of block `from` to block `to` in every pool (through the staging block:
    /// a buffer cannot be copied onto itself).
    fn copy_block(&self, encoder: &mut wgpu::CommandEncoder, from: u32, to: u32) {
        for pools in &self.layers {
            for (pool, staging) in pools.iter().zip(&self.staging) {
                let bytes = staging.size_bytes();
                let at = |block: u32| pool.region().offset + block as u64 * bytes;
                encoder.copy_buffer_to_buffer(
                    pool.buffer(),
                    at(from),
                    staging.buffer(),
                    staging.region().offset,
                    bytes,
                );
                encoder.copy_buffer_to_buffer(
                    staging.buffer(),
                    staging.region().offset,
                    pool.buffer(),
                    at(to),
                    bytes,
                );
            }
        }
    }

    fn upload(&mut self, ctx: &Context) -> Result<()> {
        let stride = self.table.stride();
        let mut ids = vec![0u32; self.slots.len() * stride];
        for (slot, s) in self.slots.iter().enumerate() {
            if let Some(s) = s {
                ids[slot * stride..][..s.blocks.len()].copy_from_slice(&s.blocks);
            }
        }
        self.table.write(ctx, &ids)
    }
}
