//! Speculative decoding's verification step: each sequence's draft tree (the token it is about to
//! be fed, then guesses of what follows, from a draft model, n-grams or a user) is fed in one pass
//! under a tree mask (`SeqLens::with_trees`: every row attends to the cache and to its ancestors,
//! at its depth's position), every row's greedy token comes from the same pass, the longest path
//! the model agrees with is kept, and the cache is rolled back to it: rows of the kept path move to
//! consecutive positions, the others are dropped. Greedy output is that of plain decoding, a token
//! per agreed draft row faster.

use super::{Cache, Generator, Pass, PassKind};
use wgpu_attention::device::read_mapped;
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::sampling::{sample_into, Sampling};
use wgpu_attention::tensor::{GpuTensor, SeqLens, MAX_TREE_ROWS};
use wgpu_attention_transformer::layers::Recording;

/// A draft tree for [`Generator::verify`]: `tokens[0]` is the token the sequence is fed next
/// (certain: the one [`Generator::sample`] gave), every other row a guess whose parent is an earlier
/// row. A chain of guesses is [`Draft::chain`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Draft {
    tokens: Vec<u32>,
    parents: Vec<Option<usize>>,
}

impl Draft {
    /// `next` followed by `guesses` in a line (a draft model's continuation).
    pub fn chain(next: u32, guesses: &[u32]) -> Self {
        let tokens: Vec<u32> = std::iter::once(next)
            .chain(guesses.iter().copied())
            .collect();
        let parents = (0..tokens.len()).map(|i| i.checked_sub(1)).collect();
        Self { tokens, parents }
    }

    /// A tree: `tokens[0]` the next token (`parents[0]` must be `None`), row `i > 0` a guess after
    /// row `parents[i] < i`; 1 to 32 rows.
    pub fn tree(tokens: Vec<u32>, parents: Vec<Option<usize>>) -> Result<Self> {
        if tokens.is_empty() || tokens.len() > MAX_TREE_ROWS || parents.len() != tokens.len() {
            return Err(Error::shape(
                "draft",
                format!(
                    "has {} tokens and {} parents; a draft has 1 to {MAX_TREE_ROWS} rows, one parent each",
                    tokens.len(),
                    parents.len()
                ),
            ));
        }
        for (i, &parent) in parents.iter().enumerate() {
            let fits = match (i, parent) {
                (0, None) => true,
                (_, Some(p)) => p < i,
                _ => false,
            };
            if !fits {
                return Err(Error::shape(
                    "draft",
                    format!("row {i} has parent {parent:?}; row 0 is the root, every other row's parent an earlier row"),
                ));
            }
        }
        Ok(Self { tokens, parents })
    }

    /// The rows' tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The rows' parents (`None` for the root).
    pub fn parents(&self) -> &[Option<usize>] {
        &self.parents
    }
}

/// The verification pass (`pass.rows` draft rows per sequence: the smallest power of two, at least
/// 4, that held the drafts so far), its tree lengths, and every draft row's decoder output, logits
/// and greedy token.
pub(super) struct VerifyBuffers {
    pub(super) pass: Pass,
    trees: SeqLens,
    rows: GpuTensor,
    logits: GpuTensor,
    ids: wgpu::Buffer,
    staging: wgpu::Buffer,
}

impl Generator {
    /// Verifies one draft per sequence (`None`: the sequence takes no token) with greedy decoding,
    /// in one pass: feeds every draft row under its tree mask, keeps the longest path from the root
    /// along which each row is the model's greedy token after its parent, and rolls the cache back
    /// to the root and that path. Returns per sequence the kept guesses followed by the model's
    /// greedy token after them (the next draft's root; [`Generator::logits`] are that token's
    /// logits, as after a step). Drafts are at most 32 rows; the pass runs as many rows per
    /// sequence as the smallest power of two (at least 4) that holds them. Validated first: on
    /// error the cache is unchanged.
    pub fn verify(&mut self, ctx: &Context, drafts: &[Option<Draft>]) -> Result<Vec<Vec<u32>>> {
        wgpu_attention::device::block_on("Generator::verify", self.verify_async(ctx, drafts))
    }

    /// Async form of [`Generator::verify`] (what a browser must use).
    pub async fn verify_async(
        &mut self,
        ctx: &Context,
        drafts: &[Option<Draft>],
    ) -> Result<Vec<Vec<u32>>> {
        let b = self.shape.batch;
        if drafts.len() != b {
            return Err(Error::shape(
                "drafts",
                format!("{} drafts for a generator of batch {b}", drafts.len()),
            ));
        }
        if self.config.scores().additive.is_some() {
            return Err(Error::shape(
                "drafts",
                "additive scores decode without tree masks; verify drafts with dot-product attention",
            ));
        }
        for draft in drafts.iter().flatten() {
            self.check_ids("drafts", &draft.tokens)?;
        }
        let new: Vec<u32> = drafts
            .iter()
            .map(|d| d.as_ref().map_or(0, |d| d.tokens.len() as u32))
            .collect();
        let parents: Vec<Vec<Option<usize>>> = drafts
            .iter()
            .map(|d| d.as_ref().map_or(Vec::new(), |d| d.parents.clone()))
            .collect();
        // Checked before the cache changes (a paged cache's step allocates blocks).
        let mut total = self.lens().to_vec();
        for (t, &n) in total.iter_mut().zip(&new) {
            *t += n;
        }
        let widest = new.iter().copied().max().unwrap_or(0) as usize;
        let slots = widest.next_power_of_two().clamp(4, MAX_TREE_ROWS);
        SeqLens::check_trees(&total, slots, &parents)?;
        self.verify_buffers(ctx, slots)?;
        let step = self.cache.step(ctx, &new)?;
        let v = self.verify.as_mut().expect("allocated above");
        v.trees.write_trees(ctx, &step.total, &parents)?;
        let slots = v.pass.rows;
        let mut tokens = vec![self.config.pad_id; b * slots];
        for (seq, draft) in drafts.iter().enumerate() {
            if let Some(d) = draft {
                tokens[seq * slots..][..d.tokens.len()].copy_from_slice(&d.tokens);
            }
        }
        v.pass.target.tokens.write(ctx, &tokens)?;
        if let Some(source) = &self.source {
            self.cross_lens
                .write(ctx, Some(&step.new), Some(&source.lens_host))?;
        }
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let mut bindings = std::mem::take(&mut self.bindings);
        let recorded = ctx.with_binding_cache(&mut bindings, || {
            self.record_verify(ctx, &mut encoder, &new)
        });
        self.bindings = bindings;
        recorded?;
        ctx.submit(encoder)?;
        self.cache.advance(&step);
        let v = self.verify.as_ref().expect("allocated above");
        let greedy: Vec<u32> = read_mapped::<u32>(ctx, &v.staging).await?;

        // The kept path per sequence, its rows moved after the cached tokens, the cache cut to it,
        // and the path end's logits as the sequence's.
        let mut out = vec![Vec::new(); b];
        let mut encoder = ctx.device().create_command_encoder(&Default::default());
        let row_bytes = 4 * self.config.vocab as u64;
        for (seq, draft) in drafts.iter().enumerate() {
            let Some(d) = draft else { continue };
            let row = |i: usize| seq * MAX_TREE_ROWS + i;
            let mut path = vec![0];
            loop {
                let at = *path.last().expect("the root");
                let want = greedy[row(at)];
                match (at + 1..d.tokens.len())
                    .find(|&c| d.parents[c] == Some(at) && d.tokens[c] == want)
                {
                    Some(c) => path.push(c),
                    None => break,
                }
            }
            let end = *path.last().expect("the root");
            out[seq] = path[1..].iter().map(|&i| d.tokens[i]).collect();
            out[seq].push(greedy[row(end)]);
            let prefix = step.total[seq] as usize - d.tokens.len();
            let moves: Vec<(usize, usize)> = path
                .iter()
                .enumerate()
                .filter(|&(k, &i)| k != i)
                .map(|(k, &i)| (prefix + i, prefix + k))
                .collect();
            match &mut self.cache {
                Cache::Contiguous(c) => {
                    c.move_rows(&mut encoder, seq, &moves);
                    c.truncate(seq, prefix + path.len())?;
                }
                Cache::Paged(c) => {
                    c.move_rows(&mut encoder, seq, &moves)?;
                    c.truncate(seq, prefix + path.len())?;
                }
            }
            encoder.copy_buffer_to_buffer(
                v.logits.buffer(),
                row(end) as u64 * row_bytes,
                self.logits.buffer(),
                seq as u64 * row_bytes,
                row_bytes,
            );
        }
        ctx.submit(encoder)?;
        Ok(out)
    }

    /// Allocates the verification pass and buffers for drafts of up to `slots` rows (kept while
    /// they hold the drafts; the source's memory prepared for a new pass).
    fn verify_buffers(&mut self, ctx: &Context, slots: usize) -> Result<()> {
        if self.verify.as_ref().is_some_and(|v| v.pass.rows >= slots) {
            return Ok(());
        }
        let b = self.shape.batch;
        let mut params = self.params.shared();
        let pass = Pass::new(
            ctx,
            &self.config,
            &mut params,
            &self.shape,
            [slots, self.tgt_positions],
            false,
        )?;
        let rows = b * MAX_TREE_ROWS;
        let id_bytes = 4 * rows as u64;
        let zeros = vec![0; b];
        self.verify = Some(VerifyBuffers {
            pass,
            trees: SeqLens::with_trees(ctx, &zeros, slots, &vec![Vec::new(); b])?,
            rows: GpuTensor::zeros(ctx, &[rows, self.config.d_model])?,
            logits: GpuTensor::zeros(ctx, &[rows, self.config.vocab])?,
            ids: ctx.create_uncounted_buffer(
                "draft ids",
                id_bytes,
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            )?,
            staging: ctx.create_uncounted_buffer(
                "draft ids readback",
                id_bytes,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )?,
        });
        // Encoder-decoder models: the new pass's cross-attention keys and values of the sources.
        if let Some(source) = &self.source {
            let v = self.verify.as_ref().expect("allocated above");
            let mut encoder = ctx.device().create_command_encoder(&Default::default());
            let memory = source.encoder.output(&source.embedding.x);
            v.pass
                .decoder
                .prepare_memory(&mut Recording::new(ctx, &mut encoder, &self.params), memory)?;
            ctx.submit(encoder)?;
        }
        Ok(())
    }

    /// The verification pass over the drafts under their trees, every draft row's decoder output
    /// copied out, the output layer over them, and each row's greedy token into the readback buffer.
    fn record_verify(
        &self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        new: &[u32],
    ) -> Result<()> {
        let v = self.verify.as_ref().expect("allocated by verify");
        self.record_pass_with(ctx, encoder, PassKind::Verify, new, false, &v.trees)?;
        let h = v.pass.decoder.output(&v.pass.target.x);
        let row_bytes = 4 * self.config.d_model as u64;
        for (seq, &n) in new.iter().enumerate() {
            if n > 0 {
                encoder.copy_buffer_to_buffer(
                    h.buffer(),
                    (seq * v.pass.rows) as u64 * row_bytes,
                    v.rows.buffer(),
                    (seq * MAX_TREE_ROWS) as u64 * row_bytes,
                    n as u64 * row_bytes,
                );
            }
        }
        self.output.forward(
            &mut Recording::new(ctx, encoder, &self.params),
            &v.rows,
            &v.logits,
        )?;
        sample_into(ctx, encoder, &v.logits, &Sampling::greedy(), 0, &v.ids)?;
        encoder.copy_buffer_to_buffer(&v.ids, 0, &v.staging, 0, v.ids.size());
        Ok(())
    }
}
