//! Token embeddings and positional encodings (SPEC.md).
//!
//! - `shaders/embedding_forward.wgsl`: `out[t] = table[tokens[t]]`;
//!   `shaders/embedding_backward.wgsl`: the table gradient by a deterministic scatter-add (one
//!   invocation per column, tokens in order; no float atomics).
//! - `shaders/positional_add.wgsl`: `y[b, l] = x[b, l] + table[l]` with a sinusoidal table (computed
//!   on the host in f64, [`sinusoidal_table`]) or a learned one; `shaders/positional_backward.wgsl`:
//!   the learned table's gradient (sum over the batch). The gradient to `x` is the identity.
//!
//! CPU reference: [`crate::reference::embedding`].

use crate::device::Context;
use crate::error::{Error, Result};
use crate::kernels::arguments::{check_binding, check_call};
use crate::kernels::dispatch::{encode, grid_x, loop_chunks, SimpleKernel};
use crate::tensor::{GpuTensor, GpuTokens, PackedSide, SeqLens};

const EMBEDDING_FORWARD: &str = include_str!("../../shaders/embedding_forward.wgsl");
const EMBEDDING_BACKWARD: &str = include_str!("../../shaders/embedding_backward.wgsl");
const POSITIONAL_ADD: &str = include_str!("../../shaders/positional_add.wgsl");
const POSITIONAL_BACKWARD: &str = include_str!("../../shaders/positional_backward.wgsl");

/// The embedding shaders by name, for the naga tests.
pub fn shader_sources() -> Vec<(&'static str, String)> {
    vec![
        ("embedding_forward", EMBEDDING_FORWARD.to_string()),
        ("embedding_backward", EMBEDDING_BACKWARD.to_string()),
        ("positional_add", POSITIONAL_ADD.to_string()),
        ("positional_backward", POSITIONAL_BACKWARD.to_string()),
    ]
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct EmbeddingParams {
    tokens: u32,
    dim: u32,
    vocab: u32,
    grid_x: u32,
    token_begin: u32,
    token_end: u32,
    accumulate: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct PositionalParams {
    batch: u32,
    seq: u32,
    dim: u32,
    grid_x: u32,
    max_len: u32,
    per_sequence: u32,
    pad: [u32; 2],
}

/// The sinusoidal table of "Attention Is All You Need", `[max_len, dim]` row-major:
/// `PE[l, 2i] = sin(l / 10000^(2i / dim))`, `PE[l, 2i + 1] = cos(l / 10000^(2i / dim))`.
pub fn sinusoidal_table(max_len: usize, dim: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; max_len * dim];
    for l in 0..max_len {
        for c in 0..dim {
            let i = (c / 2) as f64;
            let angle = l as f64 / 10000f64.powf(2.0 * i / dim as f64);
            t[l * dim + c] = if c % 2 == 0 { angle.sin() } else { angle.cos() } as f32;
        }
    }
    t
}

fn check_table(ctx: &Context, table: &GpuTensor) -> Result<(usize, usize)> {
    let &[vocab, dim] = table.shape() else {
        return Err(Error::shape(
            "table",
            format!("has shape {:?}; expected [vocab, dim]", table.shape()),
        ));
    };
    if vocab == 0 || dim == 0 || table.len() > u32::MAX as usize {
        return Err(Error::shape(
            "table",
            format!(
                "has shape {:?}; both dimensions must be at least 1",
                table.shape()
            ),
        ));
    }
    check_binding(ctx, "table", table.size_bytes())?;
    Ok((vocab, dim))
}

fn check_tokens(tokens: &GpuTokens, vocab: usize, dim: usize) -> Result<()> {
    if let Some((i, v)) = tokens.first_out_of_range(vocab as u32, None) {
        return Err(Error::shape(
            "tokens",
            format!("entry {i} is {v}, beyond the vocabulary of {vocab}"),
        ));
    }
    if tokens.len() * dim > u32::MAX as usize {
        return Err(Error::Unsupported {
            arg: "tokens * dim",
            value: (tokens.len() * dim) as u64,
            limit: u32::MAX as u64,
            hint: "",
        });
    }
    Ok(())
}

fn shape_with_dim(tokens: &GpuTokens, dim: usize) -> Vec<usize> {
    let mut s = tokens.shape().to_vec();
    s.push(dim);
    s
}

/// `table[tokens]`, shaped `tokens.shape() + [dim]`, submitted.
pub fn embedding_forward(
    ctx: &Context,
    tokens: &GpuTokens,
    table: &GpuTensor,
) -> Result<GpuTensor> {
    let (_, dim) = check_table(ctx, table)?;
    let out = GpuTensor::uninit(ctx, "embedding out", &shape_with_dim(tokens, dim))?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    embedding_forward_into(ctx, &mut encoder, tokens, table, &out)?;
    ctx.submit(encoder)?;
    Ok(out)
}

/// Records `out = table[tokens]` (`tokens.shape() + [dim]`).
pub fn embedding_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    tokens: &GpuTokens,
    table: &GpuTensor,
    out: &GpuTensor,
) -> Result<()> {
    let (vocab, dim) = check_table(ctx, table)?;
    check_tokens(tokens, vocab, dim)?;
    check_call(
        ctx,
        &[("out", out.region())],
        &[("table", table.region()), ("tokens", tokens.region())],
    )?;
    if out.shape() != shape_with_dim(tokens, dim) {
        return Err(Error::shape(
            "out",
            format!(
                "must be a separate tensor of shape {:?}",
                shape_with_dim(tokens, dim)
            ),
        ));
    }
    let n = tokens.len() * dim;
    let p = EmbeddingParams {
        tokens: tokens.len() as u32,
        dim: dim as u32,
        vocab: vocab as u32,
        grid_x: grid_x(ctx, n)?,
        token_begin: 0,
        token_end: 0,
        accumulate: 0,
        pad: 0,
    };
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "embedding_forward",
            source: EMBEDDING_FORWARD,
            constants: &[],
        },
        bytemuck::bytes_of(&p),
        &[tokens, table, out],
        n,
    )
}

/// The gradient of the table `[vocab, dim]` for the upstream gradient `dy` (shaped like the
/// forward's output), submitted.
pub fn embedding_backward(
    ctx: &Context,
    tokens: &GpuTokens,
    dy: &GpuTensor,
    vocab: usize,
) -> Result<GpuTensor> {
    let dim = *dy.shape().last().unwrap_or(&0);
    let d_table = GpuTensor::uninit(ctx, "embedding d_table", &[vocab, dim])?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    embedding_backward_into(ctx, &mut encoder, tokens, dy, &d_table)?;
    ctx.submit(encoder)?;
    Ok(d_table)
}

/// Records the table gradient into `d_table [vocab, dim]` (overwritten).
pub fn embedding_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    tokens: &GpuTokens,
    dy: &GpuTensor,
    d_table: &GpuTensor,
) -> Result<()> {
    record_embedding_backward(ctx, encoder, tokens, dy, d_table, false)
}

/// [`embedding_backward_into`] adding to the gradient already in `d_table` instead of overwriting
/// it: a table that is also the output head's weight (tied embeddings) receives both gradients.
pub fn embedding_backward_add_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    tokens: &GpuTokens,
    dy: &GpuTensor,
    d_table: &GpuTensor,
) -> Result<()> {
    record_embedding_backward(ctx, encoder, tokens, dy, d_table, true)
}

fn record_embedding_backward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    tokens: &GpuTokens,
    dy: &GpuTensor,
    d_table: &GpuTensor,
    add: bool,
) -> Result<()> {
    let (vocab, dim) = check_table(ctx, d_table)?;
    check_tokens(tokens, vocab, dim)?;
    if dy.shape() != shape_with_dim(tokens, dim) {
        return Err(Error::shape(
            "dy",
            format!(
                "has shape {:?}, expected {:?}",
                dy.shape(),
                shape_with_dim(tokens, dim)
            ),
        ));
    }
    check_call(
        ctx,
        &[("d_table", d_table.region())],
        &[("dy", dy.region()), ("tokens", tokens.region())],
    )?;
    // One invocation zeroes its column (vocab iterations) and adds tokens; split under a loop budget.
    if let Some(budget) = ctx.loop_budget() {
        if (budget as usize) <= vocab + 16 {
            return Err(Error::Unsupported {
                arg: "vocab",
                value: vocab as u64,
                limit: budget as u64 - 17,
                hint: " on this driver (llvmpipe loop cap)",
            });
        }
    }
    let chunks = loop_chunks(ctx, tokens.len(), 1, vocab + 16, 1);
    for (index, (begin, end)) in chunks.into_iter().enumerate() {
        let p = EmbeddingParams {
            tokens: tokens.len() as u32,
            dim: dim as u32,
            vocab: vocab as u32,
            grid_x: grid_x(ctx, dim)?,
            token_begin: begin,
            token_end: end,
            accumulate: (add || index > 0) as u32,
            pad: 0,
        };
        encode(
            ctx,
            encoder,
            SimpleKernel {
                name: "embedding_backward",
                source: EMBEDDING_BACKWARD,
                constants: &[],
            },
            bytemuck::bytes_of(&p),
            &[tokens, dy, d_table],
            dim,
        )?;
    }
    Ok(())
}

/// (batch, seq, dim, max_len) of `x [batch, seq, dim]` against `table [max_len, dim]`.
/// `(batch, seq, dim, max_len)` of a positional op over `x [batch, seq, dim]` and a table of
/// `max_len` positions; `seq` within them unless `packed` (whose sequences are checked instead).
fn positional_dims(
    ctx: &Context,
    x: &GpuTensor,
    table: &GpuTensor,
    packed: bool,
) -> Result<(usize, usize, usize, usize)> {
    let (max_len, dim) = check_table(ctx, table)?;
    let &[batch, seq, x_dim] = x.shape() else {
        return Err(Error::shape(
            "x",
            format!("has shape {:?}; expected [batch, seq, dim]", x.shape()),
        ));
    };
    if x_dim != dim || (seq > max_len && !packed) || batch == 0 || seq == 0 {
        return Err(Error::shape(
            "x",
            format!(
                "has shape {:?}; needs dim {dim} and 1 to {max_len} positions (the table's rows)",
                x.shape()
            ),
        ));
    }
    if let Some(budget) = ctx.loop_budget() {
        if batch > budget as usize {
            return Err(Error::Unsupported {
                arg: "batch",
                value: batch as u64,
                limit: budget as u64,
                hint: " on this driver (llvmpipe loop cap)",
            });
        }
    }
    Ok((batch, seq, dim, max_len))
}

/// `x + table[:seq]` (positions broadcast over the batch), submitted.
pub fn positional_forward(ctx: &Context, x: &GpuTensor, table: &GpuTensor) -> Result<GpuTensor> {
    let y = GpuTensor::uninit(ctx, "positional y", x.shape())?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    positional_forward_into(ctx, &mut encoder, x, table, &y)?;
    ctx.submit(encoder)?;
    Ok(y)
}

/// Records `y = x + table[positions]` for `x [batch, seq, dim]`: row `l` at position `l`.
pub fn positional_forward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    table: &GpuTensor,
    y: &GpuTensor,
) -> Result<()> {
    record_positional(ctx, encoder, x, table, y, Rows::Padded)
}

/// Records `y = x + table[positions]` for a packed batch (`x [1, rows, dim]`, `lens` from
/// [`SeqLens::packed`]): each sequence's rows at positions `0..len` from its first row; rows after
/// every sequence get no position (`y = x`).
pub fn positional_forward_packed_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    table: &GpuTensor,
    y: &GpuTensor,
    lens: &SeqLens,
) -> Result<()> {
    record_positional(ctx, encoder, x, table, y, Rows::Packed(lens))
}

/// Where the rows of a positional op sit (the embedding layer passes its own through).
#[derive(Clone, Copy)]
pub enum Rows<'a> {
    /// Row `l` of every sequence at `l`.
    Padded,
    /// New tokens after a cache (see [`positional_forward_cached_into`]).
    AfterCached(&'a SeqLens),
    /// A packed batch's rows (see [`positional_forward_packed_into`]).
    Packed(&'a SeqLens),
}

/// Records `y = x + table[positions]` for new tokens when decoding: row `l` of sequence `b` sits at
/// `kv_lens[b] - q_lens[b] + l` (`lens` as [`SeqLens::check_decode`] describes, `kv_lens` within
/// the table's rows). With packed lengths ([`SeqLens::packed`] of the new and the cached tokens,
/// `x [1, rows, dim]`: a packed prefill) each sequence's new rows follow one another from row 0,
/// sequence `b`'s row `l` at the same position; rows after every sequence get none (`y = x`).
pub fn positional_forward_cached_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    table: &GpuTensor,
    y: &GpuTensor,
    lens: &SeqLens,
) -> Result<()> {
    record_positional(ctx, encoder, x, table, y, Rows::AfterCached(lens))
}

/// Records `y = x + table[positions]` with rows placed as `positions` says: what the three public
/// entry points above record.
pub fn record_positional(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    x: &GpuTensor,
    table: &GpuTensor,
    y: &GpuTensor,
    positions: Rows<'_>,
) -> Result<()> {
    let packed = match positions {
        Rows::Padded => false,
        Rows::AfterCached(lens) => lens.is_packed(),
        Rows::Packed(_) => true,
    };
    let (batch, seq, dim, max_len) = positional_dims(ctx, x, table, packed)?;
    let lens = match positions {
        Rows::Padded => None,
        Rows::AfterCached(lens) | Rows::Packed(lens) => Some(lens),
    };
    let mut inputs = vec![("x", x.region()), ("table", table.region())];
    inputs.extend(lens.map(|l| ("seq_lens", l.region())));
    check_call(ctx, &[("y", y.region())], &inputs)?;
    if y.shape() != x.shape() {
        return Err(Error::shape(
            "y",
            format!("must be a separate tensor of shape {:?}", x.shape()),
        ));
    }
    let (batch, per_sequence) = match positions {
        Rows::Padded => (batch, 0),
        // A packed prefill: each sequence's new rows after its cached ones.
        Rows::AfterCached(lens) if lens.is_packed() => {
            let sequences = check_packed_rows(ctx, lens, batch, seq, max_len)?;
            lens.check_decode(sequences, seq, max_len)?;
            (sequences, 4)
        }
        Rows::AfterCached(lens) => {
            lens.check_decode(batch, seq, max_len)?;
            // 2: a tree step, rows at their depths.
            (batch, 1 + lens.check_tree_slots(seq)? as u32)
        }
        Rows::Packed(lens) => (check_packed_rows(ctx, lens, batch, seq, max_len)?, 3),
    };
    let n = x.len();
    let p = PositionalParams {
        batch: batch as u32,
        seq: seq as u32,
        dim: dim as u32,
        grid_x: grid_x(ctx, n)?,
        max_len: max_len as u32,
        per_sequence,
        pad: [0; 2],
    };
    let lens = lens.map_or(ctx.empty_storage(), SeqLens::buffer);
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "positional_add",
            source: POSITIONAL_ADD,
            constants: &[],
        },
        bytemuck::bytes_of(&p),
        &[x, table, y, lens],
        n,
    )
}

/// The learned table's gradient `[max_len, dim]` for `dy [batch, seq, dim]`, submitted.
pub fn positional_backward(ctx: &Context, dy: &GpuTensor, max_len: usize) -> Result<GpuTensor> {
    let dim = *dy.shape().last().unwrap_or(&0);
    let d_table = GpuTensor::uninit(ctx, "positional d_table", &[max_len, dim])?;
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    positional_backward_into(ctx, &mut encoder, dy, &d_table)?;
    ctx.submit(encoder)?;
    Ok(d_table)
}

/// Records the positional table's gradient: `dy [B, L, dim]` summed over the batch into `d_table
/// [max_len, dim]` rows `0..L` (in batch order).
pub fn positional_backward_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    dy: &GpuTensor,
    d_table: &GpuTensor,
) -> Result<()> {
    record_positional_backward(ctx, encoder, dy, d_table, None)
}

/// [`positional_backward_into`] of a packed batch (`dy [1, rows, dim]`, `lens` from
/// [`SeqLens::packed`]): row `l` of the table gathers row `l` of every sequence that has one, in
/// sequence order.
pub fn positional_backward_packed_into(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    dy: &GpuTensor,
    d_table: &GpuTensor,
    lens: &SeqLens,
) -> Result<()> {
    record_positional_backward(ctx, encoder, dy, d_table, Some(lens))
}

fn record_positional_backward(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    dy: &GpuTensor,
    d_table: &GpuTensor,
    packed: Option<&SeqLens>,
) -> Result<()> {
    let (batch, seq, dim, max_len) = positional_dims(ctx, dy, d_table, packed.is_some())?;
    let mut inputs = vec![("dy", dy.region())];
    inputs.extend(packed.map(|l| ("seq_lens", l.region())));
    check_call(ctx, &[("d_table", d_table.region())], &inputs)?;
    let batch = match packed {
        Some(lens) => check_packed_rows(ctx, lens, batch, seq, max_len)?,
        None => batch,
    };
    let n = max_len * dim;
    let p = PositionalParams {
        batch: batch as u32,
        seq: seq as u32,
        dim: dim as u32,
        grid_x: grid_x(ctx, n)?,
        max_len: max_len as u32,
        per_sequence: if packed.is_some() { 3 } else { 0 },
        pad: [0; 2],
    };
    let lens = packed.map_or(ctx.empty_storage(), SeqLens::buffer);
    encode(
        ctx,
        encoder,
        SimpleKernel {
            name: "positional_backward",
            source: POSITIONAL_BACKWARD,
            constants: &[],
        },
        bytemuck::bytes_of(&p),
        &[dy, d_table, lens],
        n,
    )
}

/// Checks packed lengths for a positional op over `[1, rows, dim]` rows: packed, within the rows,
/// every sequence within the table's `max_len` positions; returns the sequence count (the loop the
/// backward runs, within a driver's loop cap).
fn check_packed_rows(
    ctx: &Context,
    lens: &SeqLens,
    batch: usize,
    rows: usize,
    max_len: usize,
) -> Result<usize> {
    let q_lens = match (lens.is_packed(), lens.q_lens()) {
        (true, Some(q)) => q,
        _ => {
            return Err(Error::shape(
                "seq_lens",
                "are not packed; build them with SeqLens::packed",
            ))
        }
    };
    let total = lens.packed_total(PackedSide::Queries);
    if batch != 1 || total > rows {
        return Err(Error::shape(
            "x",
            format!("has {batch} x {rows} rows; a packed batch is one [1, rows, dim] of at least the lengths' {total}"),
        ));
    }
    if let Some((b, &len)) = q_lens
        .iter()
        .enumerate()
        .find(|(_, &l)| l as usize > max_len)
    {
        return Err(Error::shape(
            "seq_lens",
            format!("sequence {b} has {len} rows, beyond the table's {max_len} positions"),
        ));
    }
    if let Some(budget) = ctx.loop_budget() {
        if q_lens.len() > budget as usize {
            return Err(Error::Unsupported {
                arg: "sequences",
                value: q_lens.len() as u64,
                limit: budget as u64,
                hint: " on this driver (llvmpipe loop cap)",
            });
        }
    }
    Ok(q_lens.len())
}

/// This module's parameter blocks against their WGSL ([`crate::kernels::uniforms`]).
#[cfg(test)]
pub(crate) fn uniform_layouts() -> Vec<crate::kernels::uniforms::UniformLayout> {
    use crate::kernels::uniforms::uniform_layout;
    vec![
        uniform_layout!(
            "embedding_backward",
            "Params",
            EmbeddingParams {
                tokens,
                dim,
                vocab,
                grid_x,
                token_begin,
                token_end,
                accumulate,
                pad
            }
        ),
        uniform_layout!(
            "embedding_forward",
            "Params",
            EmbeddingParams {
                tokens,
                dim,
                vocab,
                grid_x,
                token_begin,
                token_end,
                accumulate,
                pad
            }
        )
        .read_as_prefix(),
        uniform_layout!(
            "positional_backward",
            "Params",
            PositionalParams {
                batch,
                seq,
                dim,
                grid_x,
                max_len,
                per_sequence,
                pad
            }
        ),
        uniform_layout!(
            "positional_add",
            "Params",
            PositionalParams {
                batch,
                seq,
                dim,
                grid_x,
                max_len,
                per_sequence,
                pad
            }
        )
        .read_as_prefix(),
    ]
}
