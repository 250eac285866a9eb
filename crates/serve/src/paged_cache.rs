//! A paged key/value cache (vLLM's PagedAttention layout): per decoder layer one pool of fixed-size
//! blocks of keys and one of values, shared by every sequence, and a block table giving each
//! sequence slot its blocks in order. Memory grows with the tokens cached, not with capacity x
//! batch; sequences join, leave and fork without moving cached data: a fork shares its parent's
//! blocks, and a block still shared when a sequence writes into it is copied first (copy-on-write),
//! so a common prompt prefix is stored once. Decode attention and the cache append read and write
//! through the table ([`wgpu_attention::kernels::attention::attention_decode_paged_into`],
//! [`wgpu_attention::kernels::kv_cache::kv_cache_append_paged_into`]).

use crate::kv_cache::{copy_row, StepLens};
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::kv_cache::{BlockTable, KvFormat, KvStorage};

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
    /// How the pools store keys and values (f32 unless set; int8 needs dims that are multiples
    /// of 4).
    pub format: KvFormat,
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
            format: KvFormat::F32,
        }
    }

    /// The same sizes with the pools stored in `format`.
    pub fn with_format(self, format: KvFormat) -> Self {
        Self { format, ..self }
    }
}

/// Key and value pools per layer, the block table, and the host's record of blocks and sequences.
pub struct PagedKvCache {
    config: PagedKvCacheConfig,
    /// Per layer, keys `[pool_blocks * page, kv_heads, key_dim]` and values likewise.
    layers: Vec<[KvStorage; 2]>,
    table: BlockTable,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// Unused blocks, the next one last.
    free: Vec<u32>,
    /// Each slot's blocks, in order (`None`: no sequence).
    slots: Vec<Option<Vec<u32>>>,
    /// Tokens cached per slot (0 for empty slots).
    lens: Vec<u32>,
    /// One block of keys and of values, where copy-on-write stages a shared block.
    staging: [KvStorage; 2],
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
                    KvStorage::zeros(ctx, &[rows, c.kv_heads, c.dims[0]], c.format)?,
                    KvStorage::zeros(ctx, &[rows, c.kv_heads, c.dims[1]], c.format)?,
                ])
            })
            .collect::<Result<_>>()?;
        let staging = [
            KvStorage::zeros(ctx, &[c.page, c.kv_heads, c.dims[0]], c.format)?,
            KvStorage::zeros(ctx, &[c.page, c.kv_heads, c.dims[1]], c.format)?,
        ];
        Ok(Self {
            config: c,
            layers,
            table,
            refs: vec![0; c.pool_blocks],
            free: (0..c.pool_blocks as u32).rev().collect(),
            slots: vec![None; c.slots],
            lens: vec![0; c.slots],
            staging,
        })
    }

    /// The sizes it was built with.
    pub fn config(&self) -> &PagedKvCacheConfig {
        &self.config
    }

    /// Every layer's key and value pools, `[pool_blocks * page, kv_heads, dim]`.
    pub fn layers(&self) -> &[[KvStorage; 2]] {
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
        self.slots.get(slot)?.as_ref()?;
        Some(self.lens[slot] as usize)
    }

    /// Tokens cached per slot (0 for empty slots).
    pub fn lens(&self) -> &[u32] {
        &self.lens
    }

    /// Slot `slot`'s blocks, in order (`None` if it holds no sequence).
    pub fn blocks(&self, slot: usize) -> Option<&[u32]> {
        self.slots.get(slot)?.as_deref()
    }

    fn sequence(&self, arg: &'static str, slot: usize) -> Result<&[u32]> {
        self.blocks(slot).ok_or_else(|| {
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
        self.slots[slot] = Some(Vec::new());
        self.lens[slot] = 0;
        Ok(())
    }

    /// Starts a sequence in the empty slot `child` that continues slot `parent`'s: it shares every
    /// cached block (nothing is copied now; a shared block is copied when either sequence first
    /// writes into it).
    pub fn fork(&mut self, parent: usize, child: usize) -> Result<()> {
        self.check_empty("child", child)?;
        // Only the blocks holding tokens are shared: one the parent holds ahead of its tokens (a
        // step prepared but never recorded) stays its own, so the only shared block either writes
        // into is a partly filled last one, which `prepare` copies.
        let len = self.lens[parent];
        let held = (len as usize).div_ceil(self.config.page);
        let blocks = self.sequence("parent", parent)?[..held].to_vec();
        for &b in &blocks {
            self.refs[b as usize] += 1;
        }
        self.slots[child] = Some(blocks);
        self.lens[child] = len;
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

    /// Drops one sequence's hold on `blocks`; those no sequence holds any more become free.
    fn release(&mut self, blocks: impl DoubleEndedIterator<Item = u32>) {
        for b in blocks.rev() {
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.free.push(b);
            }
        }
    }

    /// Ends slot `slot`'s sequence; blocks no other sequence holds become free.
    pub fn remove(&mut self, slot: usize) -> Result<()> {
        self.sequence("slot", slot)?;
        let blocks = self.slots[slot].take().expect("checked");
        self.lens[slot] = 0;
        self.release(blocks.into_iter());
        Ok(())
    }

    /// Rolls slot `slot` back to its first `len` tokens (a rejected speculative draft), freeing
    /// the blocks past them.
    pub fn truncate(&mut self, slot: usize, len: usize) -> Result<()> {
        self.sequence("slot", slot)?;
        let held = self.lens[slot] as usize;
        if len > held {
            return Err(Error::shape(
                "len",
                format!("is {len}; slot {slot} holds only {held} tokens"),
            ));
        }
        let blocks = self.slots[slot].as_mut().expect("checked");
        let past: Vec<u32> = blocks.drain(len.div_ceil(self.config.page)..).collect();
        self.release(past.into_iter());
        self.lens[slot] = len as u32;
        Ok(())
    }

    /// Prepares a step that adds `new[slot]` tokens to each slot (0 for slots not fed; every fed
    /// slot must hold a sequence): gives each sequence the blocks its new tokens fall in, copies
    /// every shared block a sequence will write into (copy-on-write, submitted here, so the cache
    /// stays whole whatever happens to the step), and uploads the table. Returns the step's lengths
    /// for the kernels' [`wgpu_attention::SeqLens`]; [`PagedKvCache::advance`] records them once the step
    /// is. Checked first: on error (a slot past its `max_len`, too few free blocks) nothing
    /// changes.
    pub fn prepare(&mut self, ctx: &Context, new: &[u32]) -> Result<StepLens> {
        let total = self.check_room(new)?;
        let page = self.config.page;
        let mut copies = ctx.device().create_command_encoder(&Default::default());
        let mut copied = false;
        for (slot, &n) in new.iter().enumerate() {
            if n == 0 {
                continue;
            }
            if self.shared_tail(slot) {
                let blocks = self.slots[slot].as_ref().expect("checked");
                let last = blocks.len() - 1;
                let old = blocks[last];
                let copy = self.free.pop().expect("counted");
                self.copy_block(&mut copies, old, copy);
                copied = true;
                self.refs[old as usize] -= 1;
                self.refs[copy as usize] = 1;
                self.slots[slot].as_mut().expect("checked")[last] = copy;
            }
            let want = (total[slot] as usize).div_ceil(page);
            while self.slots[slot].as_ref().expect("checked").len() < want {
                let b = self.free.pop().expect("counted");
                self.refs[b as usize] = 1;
                self.slots[slot].as_mut().expect("checked").push(b);
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

    /// Checks that sequences of `lens` tokens would fit the pool once every sequence is removed
    /// (a new batch, before [`PagedKvCache::clear`]): `KvCacheFull` if their blocks outnumber it.
    pub fn check_room_when_empty(&self, lens: &[u32]) -> Result<()> {
        let page = self.config.page;
        let needed = lens.iter().map(|&n| (n as usize).div_ceil(page)).sum();
        let total = self.config.pool_blocks;
        match needed > total {
            true => Err(Error::KvCacheFull {
                needed,
                free: total,
                total,
            }),
            false => Ok(()),
        }
    }

    /// Checks that `new` tokens per slot fit (what [`PagedKvCache::prepare`] checks first, changing
    /// nothing): every slot given tokens holds a sequence, stays within `max_len`, and the pool has
    /// the blocks they need (copies of shared blocks included); several steps that add up to `new`
    /// need no more. Returns each slot's length after them.
    pub fn check_room(&self, new: &[u32]) -> Result<Vec<u32>> {
        let max_len = self.config.max_len;
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
            let (len, n) = (self.lens[slot] as usize, n as usize);
            if n > 0 && self.slots[slot].is_none() {
                return Err(Error::shape(
                    "new tokens",
                    format!(
                        "slot {slot} is given {n} tokens but holds no sequence; add_sequence first"
                    ),
                ));
            }
            if len + n > max_len {
                return Err(Error::shape(
                    "sequence length",
                    format!("slot {slot} would hold {} tokens ({len} cached + {n} new), beyond max_len {max_len}", len + n),
                ));
            }
            total.push((len + n) as u32);
            if n > 0 {
                needed += self.blocks_to_grow(slot, n);
            }
        }
        if needed > self.free.len() {
            return Err(Error::KvCacheFull {
                needed,
                free: self.free.len(),
                total: self.config.pool_blocks,
            });
        }
        Ok(total)
    }

    /// Free blocks slot `slot`'s sequence takes to grow by `n` tokens: new pages past the blocks
    /// it holds (blocks held ahead by a step never recorded count towards them), and a copy of a
    /// shared, partly filled last block. 0 for a slot that holds no sequence.
    pub fn blocks_to_grow(&self, slot: usize, n: usize) -> usize {
        let Some(blocks) = self.slots.get(slot).and_then(Option::as_ref) else {
            return 0;
        };
        let len = self.lens[slot] as usize;
        (len + n)
            .div_ceil(self.config.page)
            .saturating_sub(blocks.len())
            + self.shared_tail(slot) as usize
    }

    /// Records that a prepared step's tokens are in the cache.
    pub fn advance(&mut self, step: &StepLens) {
        for (slot, &total) in step.total.iter().enumerate() {
            if self.slots[slot].is_some() {
                self.lens[slot] = total;
            }
        }
    }

    /// Whether slot `slot`'s last block is partly filled and shared (its next token would write
    /// into a block another sequence reads).
    fn shared_tail(&self, slot: usize) -> bool {
        !(self.lens[slot] as usize).is_multiple_of(self.config.page)
            && self.slots[slot]
                .as_ref()
                .and_then(|b| b.last())
                .is_some_and(|&b| self.refs[b as usize] > 1)
    }

    /// Records the copy of block `from` to block `to` in every pool (through the staging block:
    /// a buffer cannot be copied onto itself).
    fn copy_block(&self, encoder: &mut wgpu::CommandEncoder, from: u32, to: u32) {
        for pools in &self.layers {
            for (pool, staging) in pools.iter().zip(&self.staging) {
                let (pool, staging) = (pool.words(), staging.words());
                let bytes = staging.size_bytes();
                let at = |block: u32| pool.byte_offset() + block as u64 * bytes;
                encoder.copy_buffer_to_buffer(
                    pool.buffer(),
                    at(from),
                    staging.buffer(),
                    staging.byte_offset(),
                    bytes,
                );
                encoder.copy_buffer_to_buffer(
                    staging.buffer(),
                    staging.byte_offset(),
                    pool.buffer(),
                    at(to),
                    bytes,
                );
            }
        }
    }

    /// Records, for every layer, the copy of slot `slot`'s keys and values at each position `from`
    /// to position `to` (`moves` in order; positions the slot holds, in blocks it owns alone, as
    /// after [`PagedKvCache::prepare`] for them).
    pub(crate) fn move_rows(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        slot: usize,
        moves: &[(usize, usize)],
    ) -> Result<()> {
        let blocks = self.sequence("slot", slot)?;
        let page = self.config.page;
        let row = |p: usize| blocks[p / page] as usize * page + p % page;
        for pools in &self.layers {
            for (pool, staging) in pools.iter().zip(&self.staging) {
                for &(from, to) in moves {
                    copy_row(encoder, pool, staging, row(from), row(to));
                }
            }
        }
        Ok(())
    }

    fn upload(&mut self, ctx: &Context) -> Result<()> {
        let stride = self.table.stride();
        let mut ids = vec![0u32; self.slots.len() * stride];
        for (slot, blocks) in self.slots.iter().enumerate() {
            if let Some(blocks) = blocks {
                ids[slot * stride..][..blocks.len()].copy_from_slice(blocks);
            }
        }
        self.table.write(ctx, &ids)
    }
}
