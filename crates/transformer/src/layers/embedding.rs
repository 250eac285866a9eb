//! Token embedding plus positions, the input layer of each stream (source, target): `x = E[tokens] +
//! P[positions]` with a fixed sinusoidal or a learned position table, or `x = E[tokens]` when rotary
//! embeddings rotate Q and K inside attention instead. Owns its token buffer and output, allocated
//! once for `[batch, seq]` tokens. Row `l` sits at position `l`, or after each sequence's cached
//! tokens when decoding ([`Embedding::forward_cached`]).

use crate::layers::params::{Init, ParamId, Params};
use crate::layers::Recording;
use wgpu_attention::device::Context;
use wgpu_attention::error::Result;
use wgpu_attention::kernels::embedding::{
    embedding_backward_add_into, embedding_backward_into, embedding_forward_into,
    positional_backward_into, positional_backward_packed_into, record_positional, sinusoidal_table,
    Rows,
};
use wgpu_attention::tensor::{GpuTensor, GpuTokens, SeqLens};

/// How positions enter a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionKind {
    /// The fixed table of "Attention Is All You Need".
    Sinusoidal,
    /// A learned `[positions, d_model]` table (`{name}.pos`).
    Learned,
    /// Rotary embeddings in the attention layers; nothing is added here.
    Rotary,
}

enum Positions {
    Table(GpuTensor),
    Learned(ParamId),
    Rotary,
}

/// Token embedding (scaled by sqrt(d_model)) plus positions (sinusoidal or learned; none with
/// rotary attention), with its backward.
pub struct Embedding {
    table: ParamId,
    /// The table is also the output head's weight, whose backward runs first: add to its gradient.
    tied: bool,
    positions: Positions,
    /// `[batch, seq]` token ids, written by the caller.
    pub tokens: GpuTokens,
    embedded: GpuTensor,
    /// `[batch, seq, d_model]`, the layer's output.
    pub x: GpuTensor,
}

impl Embedding {
    /// `{name}.embed [vocab, d_model]` and, for learned positions, `{name}.pos [positions,
    /// d_model]`, where `(kind, positions)` gives the kind of positions and how many the table
    /// covers (at least `rows[1]`); tokens for `rows = [batch, seq]`, `pad_id` at first.
    pub fn new(
        ctx: &Context,
        params: &mut Params,
        name: &str,
        [vocab, d_model]: [usize; 2],
        pad_id: u32,
        (kind, positions): (PositionKind, usize),
        rows: [usize; 2],
    ) -> Result<Self> {
        let table = params.add(
            ctx,
            format!("{name}.embed"),
            &[vocab, d_model],
            Init::Uniform(1.0),
        )?;
        let positions = match kind {
            PositionKind::Rotary => Positions::Rotary,
            PositionKind::Learned => Positions::Learned(params.add(
                ctx,
                format!("{name}.pos"),
                &[positions, d_model],
                Init::Uniform(0.1),
            )?),
            PositionKind::Sinusoidal => Positions::Table(GpuTensor::from_slice(
                ctx,
                &sinusoidal_table(positions, d_model),
                &[positions, d_model],
            )?),
        };
        let shape = [rows[0], rows[1], d_model];
        Ok(Self {
            table,
            tied: false,
            positions,
            tokens: GpuTokens::from_slice(ctx, &vec![pad_id; rows[0] * rows[1]], &rows)?,
            embedded: GpuTensor::zeros(ctx, &shape)?,
            x: GpuTensor::zeros(ctx, &shape)?,
        })
    }

    /// The token table `{name}.embed [vocab, d_model]`.
    pub fn table(&self) -> ParamId {
        self.table
    }

    /// Marks the table as shared with an output head ([`crate::layers::linear::Linear::tied`]) whose
    /// backward runs before this layer's: the backward then adds to the table's gradient.
    pub fn tie_output(&mut self) {
        self.tied = true;
    }

    fn position_table<'a>(&'a self, p: &'a Params) -> Option<&'a GpuTensor> {
        match &self.positions {
            Positions::Table(t) => Some(t),
            Positions::Learned(id) => Some(p.value(*id)),
            Positions::Rotary => None,
        }
    }

    /// `x = E[tokens] + P[l]`.
    pub fn forward(&self, rec: &mut Recording<'_>) -> Result<()> {
        self.record(rec, Rows::Padded)
    }

    /// `x = E[tokens] + P[position]` for a packed batch (`lens` from `SeqLens::packed`, the layer's
    /// rows a batch of 1): each sequence's rows from position 0 at its first row.
    pub fn forward_packed(&self, rec: &mut Recording<'_>, lens: &SeqLens) -> Result<()> {
        self.record(rec, Rows::Packed(lens))
    }

    /// `x = E[tokens] + P[position]` for new tokens after a cache: row `l` of sequence `b` at
    /// `kv_lens[b] - q_lens[b] + l` (see [`SeqLens::check_decode`]).
    pub fn forward_cached(&self, rec: &mut Recording<'_>, lens: &SeqLens) -> Result<()> {
        self.record(rec, Rows::AfterCached(lens))
    }

    fn record(&self, rec: &mut Recording<'_>, rows: Rows<'_>) -> Result<()> {
        let Recording { ctx, params: p, .. } = *rec;
        let embed = p.value(self.table);
        let Some(table) = self.position_table(p) else {
            return embedding_forward_into(ctx, rec.encoder, &self.tokens, embed, &self.x);
        };
        embedding_forward_into(ctx, rec.encoder, &self.tokens, embed, &self.embedded)?;
        record_positional(ctx, rec.encoder, &self.embedded, table, &self.x, rows)
    }

    /// `dx` is the gradient at `x = embedded + positions`, which both terms receive unchanged.
    pub fn backward(&self, rec: &mut Recording<'_>, dx: &GpuTensor) -> Result<()> {
        self.record_backward(rec, dx, None)
    }

    /// [`Embedding::backward`] of [`Embedding::forward_packed`].
    pub fn backward_packed(
        &self,
        rec: &mut Recording<'_>,
        dx: &GpuTensor,
        lens: &SeqLens,
    ) -> Result<()> {
        self.record_backward(rec, dx, Some(lens))
    }

    fn record_backward(
        &self,
        rec: &mut Recording<'_>,
        dx: &GpuTensor,
        packed: Option<&SeqLens>,
    ) -> Result<()> {
        let Recording { ctx, params: p, .. } = *rec;
        let d_table = p.grad(self.table);
        if self.tied {
            embedding_backward_add_into(ctx, rec.encoder, &self.tokens, dx, d_table)?;
        } else {
            embedding_backward_into(ctx, rec.encoder, &self.tokens, dx, d_table)?;
        }
        if let Positions::Learned(id) = &self.positions {
            match packed {
                None => positional_backward_into(ctx, rec.encoder, dx, p.grad(*id))?,
                Some(lens) => {
                    positional_backward_packed_into(ctx, rec.encoder, dx, p.grad(*id), lens)?
                }
            }
        }
        Ok(())
    }
}
