//! Integer data on the GPU: [`GpuTokens`] (token ids, targets) and [`SeqLens`] (per-batch sequence
//! lengths).

use super::Region;
use crate::device::{Allocation, Context, ContextId};
use crate::error::{Error, Result};
use std::sync::Arc;

/// Which lengths and starts of a packed batch ([`SeqLens::packed`]) a packed view follows: the
/// queries' (Q, O and their gradients) or the keys' (K, V and theirs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedSide {
    /// `q_lens` and `q_starts`.
    Queries,
    /// `kv_lens` and `kv_starts`.
    Keys,
}

/// Integer ids on the GPU (tokens, class targets): a `u32` storage buffer with its shape, and a
/// host copy so that ops can reject ids beyond a vocabulary before dispatching. Clones share the
/// buffer and the host copy, so a [`GpuTokens::write`] through one is what every clone validates.
#[derive(Clone, Debug)]
pub struct GpuTokens {
    buffer: wgpu::Buffer,
    shape: Vec<usize>,
    values: Arc<std::sync::Mutex<Vec<u32>>>,
    _allocation: Arc<Allocation>,
    context: ContextId,
}

impl GpuTokens {
    /// Uploads `data` (at least one id) as ids of `shape`.
    pub fn from_slice(ctx: &Context, data: &[u32], shape: &[usize]) -> Result<Self> {
        let len: usize = shape.iter().product();
        if len != data.len() || len == 0 {
            return Err(Error::shape(
                "tokens",
                format!(
                    "{} values for shape {shape:?} ({len} elements, at least 1 needed)",
                    data.len()
                ),
            ));
        }
        let (buffer, allocation) = ctx.create_buffer(
            "tokens",
            len as u64 * 4,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
        )?;
        ctx.queue()
            .write_buffer(&buffer, 0, bytemuck::cast_slice(data));
        Ok(Self {
            buffer,
            shape: shape.to_vec(),
            values: Arc::new(std::sync::Mutex::new(data.to_vec())),
            _allocation: Arc::new(allocation),
            context: ctx.id(),
        })
    }

    /// The ids' shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Their count.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer holding them.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// The buffer as a read-only argument of a call (its context, for the aliasing checks).
    pub(crate) fn region(&self) -> Region<'_> {
        Region::whole(&self.buffer).of_context(Some(self.context))
    }

    /// Overwrites the ids (same count) for the calls recorded after this one: a call recorded
    /// before it and submitted after still reads the ids it validated (as [`SeqLens::write`]: the
    /// new ids wait in a staging buffer for the context's next compute pass, which copies them in
    /// ahead of itself).
    pub fn write(&mut self, ctx: &Context, data: &[u32]) -> Result<()> {
        if data.len() != self.len() {
            return Err(Error::shape(
                "tokens",
                format!("{} values for a buffer of {}", data.len(), self.len()),
            ));
        }
        ctx.check_owns("tokens", Some(self.context))?;
        ctx.check_lost()?;
        // Under the lock, so the host copy and the ordered write change together.
        let mut values = self.values.lock().unwrap_or_else(|e| e.into_inner());
        ctx.write_in_recording_order(&self.buffer, bytemuck::cast_slice(data))?;
        values.copy_from_slice(data);
        Ok(())
    }

    /// The first id at or beyond `limit` that is not `ignore`, with its index: what an op with a
    /// vocabulary or class count of `limit` rejects.
    pub fn first_out_of_range(&self, limit: u32, ignore: Option<u32>) -> Option<(usize, u32)> {
        self.values
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .enumerate()
            .find(|&(_, v)| v >= limit && Some(v) != ignore)
    }
}

/// Per-batch valid sequence lengths for padding / variable-length attention, held on the GPU as one
/// buffer `[q_lens (batch), kv_lens (batch)]` with a host copy for validation.
///
/// Not `Clone`, and [`SeqLens::write`] takes `&mut self`: the host copy every call validates is
/// always the one the kernels read (a shared buffer with two host copies could go stale). Share
/// one behind a reference; create a second with [`SeqLens::new`].
#[derive(Debug)]
pub struct SeqLens {
    buffer: wgpu::Buffer,
    context: ContextId,
    q_lens: Option<Vec<u32>>,
    kv_lens: Option<Vec<u32>>,
    batch: usize,
    tree: Option<TreeRows>,
    /// A packed batch's first rows, `[q_starts, kv_starts]` ([`SeqLens::packed`]).
    starts: Option<[Vec<u32>; 2]>,
}

/// The first row of each sequence packed one after another (exclusive prefix sums: FlashAttention's
/// `cu_seqlens` without the final total), checked to fit u32.
fn packed_starts(arg: &'static str, lens: &[u32]) -> Result<Vec<u32>> {
    let mut next = 0u32;
    lens.iter()
        .map(|&len| {
            let start = next;
            next = next
                .checked_add(len)
                .ok_or_else(|| Error::shape(arg, format!("sum to more than {} rows", u32::MAX)))?;
            Ok(start)
        })
        .collect()
}

/// The lengths buffer of a packed batch, `[q_lens, kv_lens, q_starts, kv_starts]`, and its starts.
fn packed_data(q_lens: &[u32], kv_lens: &[u32]) -> Result<(Vec<u32>, [Vec<u32>; 2])> {
    let starts = [
        packed_starts("q_lens", q_lens)?,
        packed_starts("kv_lens", kv_lens)?,
    ];
    let mut data = lens_data(q_lens.len(), Some(q_lens), Some(kv_lens));
    data.extend(starts.iter().flatten());
    Ok((data, starts))
}

/// The lengths buffer `[q_lens, kv_lens]` of `batch` sequences (`u32::MAX` where not given: no
/// limit).
fn lens_data(batch: usize, q_lens: Option<&[u32]>, kv_lens: Option<&[u32]>) -> Vec<u32> {
    let mut data = vec![u32::MAX; 2 * batch.max(1)];
    if let Some(q) = q_lens {
        data[..batch].copy_from_slice(q);
    }
    if let Some(k) = kv_lens {
        data[batch..2 * batch].copy_from_slice(k);
    }
    data
}

/// A storage buffer holding `data` (rewritten in recording order: [`SeqLens::write`]).
fn upload(ctx: &Context, label: &'static str, data: &[u32]) -> Result<wgpu::Buffer> {
    let buffer = ctx.create_uncounted_buffer(
        label,
        data.len() as u64 * 4,
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
    )?;
    ctx.queue()
        .write_buffer(&buffer, 0, bytemuck::cast_slice(data));
    Ok(buffer)
}

/// The buffer of a tree step, `[q_lens, kv_lens, depths [batch, slots], ancestors [batch, slots]]`,
/// and its parts, checked (see [`SeqLens::with_trees`]).
fn tree_data(
    kv_lens: &[u32],
    slots: usize,
    parents: &[Vec<Option<usize>>],
) -> Result<(Vec<u32>, TreeRows, Vec<u32>)> {
    if parents.len() != kv_lens.len() {
        return Err(Error::shape(
            "parents",
            format!(
                "has {} trees for {} sequences",
                parents.len(),
                kv_lens.len()
            ),
        ));
    }
    if slots == 0 {
        return Err(Error::shape("slots", "is 0; a tree step has row slots"));
    }
    let batch = kv_lens.len();
    let mut tree = TreeRows {
        slots,
        depths: vec![0; batch * slots],
        ancestors: vec![0; batch * slots],
    };
    for (b, rows) in parents.iter().enumerate() {
        if rows.len() > slots.min(MAX_TREE_ROWS) || rows.len() > kv_lens[b] as usize {
            return Err(Error::shape(
                "parents",
                format!(
                    "tree {b} has {} rows, beyond the {slots} slots, {MAX_TREE_ROWS}, or kv_lens[{b}] = {}",
                    rows.len(),
                    kv_lens[b]
                ),
            ));
        }
        for (i, &parent) in rows.iter().enumerate() {
            let (depth, ancestors) = match parent {
                None => (0, 0),
                Some(p) if p < i => (
                    tree.depths[b * slots + p] + 1,
                    tree.ancestors[b * slots + p],
                ),
                Some(p) => {
                    return Err(Error::shape(
                        "parents",
                        format!("row {i} of tree {b} names row {p} as its parent; a parent is an earlier row"),
                    ))
                }
            };
            tree.depths[b * slots + i] = depth;
            tree.ancestors[b * slots + i] = ancestors | 1 << i;
        }
    }
    let q_lens: Vec<u32> = parents.iter().map(|rows| rows.len() as u32).collect();
    let mut data = Vec::with_capacity(2 * batch + 2 * batch * slots);
    data.extend(&q_lens);
    data.extend(kv_lens);
    data.extend(&tree.depths);
    data.extend(&tree.ancestors);
    Ok((q_lens, tree, data))
}

/// The most rows one draft tree of [`SeqLens::with_trees`] holds (one bit each in an ancestor
/// mask).
pub const MAX_TREE_ROWS: usize = 32;

/// The new rows of a tree step: per sequence, `slots` rows, each row's depth below the cached
/// tokens and its ancestors (itself included) as a bit mask over the rows.
#[derive(Debug, Clone)]
struct TreeRows {
    slots: usize,
    depths: Vec<u32>,
    ancestors: Vec<u32>,
}

impl SeqLens {
    /// Valid query lengths (`q_lens`, rows past them give O = 0) and/or key lengths (`kv_lens`,
    /// keys past them are masked), one entry per batch element. At least one must be given.
    pub fn new(ctx: &Context, q_lens: Option<&[u32]>, kv_lens: Option<&[u32]>) -> Result<Self> {
        let batch = match (q_lens, kv_lens) {
            (Some(q), Some(k)) if q.len() != k.len() => {
                return Err(Error::shape(
                    "kv_lens",
                    format!("has {} entries but q_lens has {}", k.len(), q.len()),
                ))
            }
            (Some(q), _) => q.len(),
            (None, Some(k)) => k.len(),
            (None, None) => {
                return Err(Error::shape(
                    "SeqLens",
                    "give q_lens, kv_lens or both (or pass no SeqLens at all)",
                ))
            }
        };
        let buffer = upload(ctx, "seq_lens", &lens_data(batch, q_lens, kv_lens))?;
        Ok(Self {
            buffer,
            context: ctx.id(),
            q_lens: q_lens.map(<[u32]>::to_vec),
            kv_lens: kv_lens.map(<[u32]>::to_vec),
            batch,
            tree: None,
            starts: None,
        })
    }

    /// The lengths of a packed variable-length batch (FlashAttention's varlen layout): sequence `b`
    /// has `q_lens[b]` queries in rows `q_starts[b] ..` of `[total_q, heads, head_dim]` tensors (Q,
    /// O and their gradients) and `kv_lens[b]` keys in rows `kv_starts[b] ..` of `[total_kv, ...]`
    /// ones (K, V, dK, dV), the starts being the sums of the lengths before (a sequence may be
    /// empty). Make the views with [`HeadsView::packed`](super::HeadsView::packed) and pass these
    /// lengths as
    /// `AttentionOptions::seq_lens`. Position-dependent masks (causal, windows, ALiBi, relative
    /// buckets) align a sequence's queries and keys at their first rows, so they need
    /// `q_lens == kv_lens` (self-attention).
    pub fn packed(ctx: &Context, q_lens: &[u32], kv_lens: &[u32]) -> Result<Self> {
        if q_lens.is_empty() {
            return Err(Error::shape(
                "q_lens",
                "is empty; a packed batch has at least one sequence",
            ));
        }
        if q_lens.len() != kv_lens.len() {
            return Err(Error::shape(
                "kv_lens",
                format!(
                    "has {} entries and q_lens {}; a packed batch gives both, one per sequence",
                    kv_lens.len(),
                    q_lens.len()
                ),
            ));
        }
        let (data, starts) = packed_data(q_lens, kv_lens)?;
        let buffer = upload(ctx, "seq_lens (packed)", &data)?;
        Ok(Self {
            buffer,
            context: ctx.id(),
            q_lens: Some(q_lens.to_vec()),
            kv_lens: Some(kv_lens.to_vec()),
            batch: q_lens.len(),
            tree: None,
            starts: Some(starts),
        })
    }

    /// A packed batch's first rows of each sequence on `side` ([`SeqLens::packed`]); `None` for
    /// padded lengths.
    pub fn packed_starts(&self, side: PackedSide) -> Option<&[u32]> {
        let [q, kv] = self.starts.as_ref()?;
        Some(match side {
            PackedSide::Queries => q,
            PackedSide::Keys => kv,
        })
    }

    /// The lengths of `side`: `q_lens` for the queries, `kv_lens` for the keys, if given.
    pub fn lens(&self, side: PackedSide) -> Option<&[u32]> {
        match side {
            PackedSide::Queries => self.q_lens(),
            PackedSide::Keys => self.kv_lens(),
        }
    }

    /// The rows a packed batch's tensors of `side` hold: the sum of its lengths (0 for padded
    /// lengths).
    pub fn packed_total(&self, side: PackedSide) -> usize {
        match (&self.starts, self.lens(side)) {
            (Some(_), Some(lens)) => lens.iter().map(|&l| l as usize).sum(),
            _ => 0,
        }
    }

    /// Whether these are a packed batch's lengths ([`SeqLens::packed`]).
    pub fn is_packed(&self) -> bool {
        self.starts.is_some()
    }

    /// The lengths of a step that feeds each sequence a tree of new tokens (speculative decoding's
    /// drafts): `parents[b][i]` is the parent row of new row `i` of sequence `b` (`None`: a root,
    /// following the cached tokens directly), always an earlier row, at most [`MAX_TREE_ROWS`] rows
    /// per sequence, in `slots` row slots. Sequence `b` holds `kv_lens[b]` tokens including its
    /// `parents[b].len()` new ones, which the cache stores in row order; row `i` sits at position
    /// `kv_lens[b] - parents[b].len() + depth(i)` (rotary and learned positions, ALiBi, windows and
    /// relative buckets follow it) and attends to the cached tokens and to its ancestors and itself
    /// only. A tree has at most 32 rows (one bit each in its rows' ancestor masks). Decode
    /// attention, rotary embeddings and positional tables read the trees; other kernels refuse
    /// them.
    pub fn with_trees(
        ctx: &Context,
        kv_lens: &[u32],
        slots: usize,
        parents: &[Vec<Option<usize>>],
    ) -> Result<Self> {
        let (q_lens, tree, data) = tree_data(kv_lens, slots, parents)?;
        let buffer = upload(ctx, "seq_lens (trees)", &data)?;
        Ok(Self {
            buffer,
            context: ctx.id(),
            q_lens: Some(q_lens),
            kv_lens: Some(kv_lens.to_vec()),
            batch: kv_lens.len(),
            tree: Some(tree),
            starts: None,
        })
    }

    /// Overwrites a tree step's lengths and trees for the calls recorded after this one, as
    /// [`SeqLens::write`] does: as many sequences and row slots as at creation
    /// ([`SeqLens::with_trees`]).
    pub fn write_trees(
        &mut self,
        ctx: &Context,
        kv_lens: &[u32],
        parents: &[Vec<Option<usize>>],
    ) -> Result<()> {
        let Some(slots) = self.tree_slots() else {
            return Err(Error::shape(
                "seq_lens",
                "holds no trees; build one with SeqLens::with_trees",
            ));
        };
        if kv_lens.len() != self.batch {
            return Err(Error::shape(
                "kv_lens",
                format!(
                    "has {} entries; this SeqLens holds {}",
                    kv_lens.len(),
                    self.batch
                ),
            ));
        }
        ctx.check_owns("seq_lens", Some(self.context))?;
        let (q_lens, tree, data) = tree_data(kv_lens, slots, parents)?;
        ctx.write_in_recording_order(&self.buffer, bytemuck::cast_slice(&data))?;
        self.q_lens = Some(q_lens);
        self.kv_lens = Some(kv_lens.to_vec());
        self.tree = Some(tree);
        Ok(())
    }

    /// Checks trees as [`SeqLens::with_trees`] would, without allocating.
    pub fn check_trees(
        kv_lens: &[u32],
        slots: usize,
        parents: &[Vec<Option<usize>>],
    ) -> Result<()> {
        tree_data(kv_lens, slots, parents).map(|_| ())
    }

    /// The row slots per sequence of a tree step ([`SeqLens::with_trees`]), `None` otherwise.
    pub fn tree_slots(&self) -> Option<usize> {
        self.tree.as_ref().map(|t| t.slots)
    }

    /// Each new row's depth below the cached tokens, `[batch, slots]`, for a tree step.
    pub fn tree_depths(&self) -> Option<&[u32]> {
        self.tree.as_ref().map(|t| t.depths.as_slice())
    }

    /// Checks that a kernel over `slots` new rows per sequence can read this step's trees (none,
    /// or trees of `slots` row slots).
    pub(crate) fn check_tree_slots(&self, slots: usize) -> Result<bool> {
        match self.tree_slots() {
            None => Ok(false),
            Some(s) if s == slots => Ok(true),
            Some(s) => Err(Error::shape(
                "seq_lens",
                format!("holds trees of {s} row slots; the new rows have {slots}"),
            )),
        }
    }

    /// Overwrites the lengths for the calls recorded after this one: a call recorded before it
    /// (even one not yet submitted) reads the lengths it validated, one recorded after reads
    /// these, provided the encoders are submitted in the order they were recorded. The values wait
    /// in a small staging buffer until the next compute pass this context records copies them in
    /// (an encoder dropped unsubmitted after taking them loses them); lengths equal to the current
    /// ones write nothing. The same lengths must be
    /// given as at creation (`Some`/`None` alike) for the same batch; packed lengths get their new
    /// starts (views made for the old ones keep their shapes: make new ones if a sequence grew past
    /// the longest). `ctx` is the context that created these lengths.
    pub fn write(
        &mut self,
        ctx: &Context,
        q_lens: Option<&[u32]>,
        kv_lens: Option<&[u32]>,
    ) -> Result<()> {
        for (arg, new, old) in [
            ("q_lens", q_lens, self.q_lens.as_deref()),
            ("kv_lens", kv_lens, self.kv_lens.as_deref()),
        ] {
            if new.map(<[u32]>::len) != old.map(<[u32]>::len) {
                return Err(Error::shape(
                    arg,
                    format!(
                        "has {:?} entries; this SeqLens was created with {:?}",
                        new.map(<[u32]>::len),
                        old.map(<[u32]>::len)
                    ),
                ));
            }
        }
        if self.tree.is_some() {
            return Err(Error::shape(
                "seq_lens",
                "holds draft trees; build a new one with SeqLens::with_trees",
            ));
        }
        ctx.check_owns("seq_lens", Some(self.context))?;
        // What every call recorded from now on would read already (the starts follow the lengths).
        if q_lens == self.q_lens.as_deref() && kv_lens == self.kv_lens.as_deref() {
            return Ok(());
        }
        let (data, starts) = match (&self.starts, q_lens, kv_lens) {
            (Some(_), Some(q), Some(kv)) => {
                let (data, starts) = packed_data(q, kv)?;
                (data, Some(starts))
            }
            _ => (lens_data(self.batch, q_lens, kv_lens), None),
        };
        ctx.write_in_recording_order(&self.buffer, bytemuck::cast_slice(&data))?;
        if starts.is_some() {
            self.starts = starts;
        }
        self.q_lens = q_lens.map(<[u32]>::to_vec);
        self.kv_lens = kv_lens.map(<[u32]>::to_vec);
        Ok(())
    }

    /// Checks lengths that place new tokens at the end of cached sequences (decoding): both given
    /// for
    /// `batch` sequences, `q_lens[b]` (new tokens) at most `new_slots` and at most `kv_lens[b]`
    /// (tokens cached, the new ones included), which is at most `capacity`. Returns the longest
    /// `kv_lens` entry.
    pub fn check_decode(&self, batch: usize, new_slots: usize, capacity: usize) -> Result<usize> {
        let (Some(q), Some(kv)) = (self.q_lens(), self.kv_lens()) else {
            return Err(Error::shape(
                "seq_lens",
                "decoding needs SeqLens with q_lens (new tokens per sequence) and kv_lens (cached tokens per sequence, the new ones included)",
            ));
        };
        if self.batch != batch {
            return Err(Error::shape(
                "seq_lens",
                format!("has {} entries but the batch is {batch}", self.batch),
            ));
        }
        for b in 0..batch {
            let (n, len) = (q[b] as usize, kv[b] as usize);
            if n > new_slots {
                return Err(Error::shape(
                    "q_lens",
                    format!("entry {b} is {n}, beyond the {new_slots} new-token slots"),
                ));
            }
            if n > len {
                return Err(Error::shape(
                    "q_lens",
                    format!("entry {b} is {n} but kv_lens[{b}] is {len}: the new tokens are the last cached positions, so q_lens <= kv_lens"),
                ));
            }
            if len > capacity {
                return Err(Error::shape(
                    "kv_lens",
                    format!("entry {b} is {len}, beyond the capacity {capacity}"),
                ));
            }
        }
        Ok(kv.iter().copied().max().unwrap_or(0) as usize)
    }

    /// Valid query rows per batch entry, if given.
    pub fn q_lens(&self) -> Option<&[u32]> {
        self.q_lens.as_deref()
    }

    /// Valid keys per batch entry, if given.
    pub fn kv_lens(&self) -> Option<&[u32]> {
        self.kv_lens.as_deref()
    }

    /// Batch entries.
    pub fn batch(&self) -> usize {
        self.batch
    }

    pub(crate) fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// The buffer as a read-only argument of a call (its context, for the aliasing checks).
    pub(crate) fn region(&self) -> Region<'_> {
        Region::whole(&self.buffer).of_context(Some(self.context))
    }
}
