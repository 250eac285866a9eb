// Positional encoding forward: y[b, l, c] = x[b, l, c] + table[l, c] for a [max_len, dim] table,
// sinusoidal (computed once on the host in f64) or learned. The backward to x is the identity.
// PER_SEQUENCE positions (decoding from a cache): row l of sequence b sits at kv_len[b] - q_len[b] + l,
// its new tokens being the last of its kv_len[b] (the [q_lens, kv_lens] buffer of SeqLens); in a
// tree step (per_sequence 2, SeqLens::with_trees) at kv_len[b] - q_len[b] + depth(l), the depths
// following the lengths in the same buffer. A packed batch (per_sequence 3, SeqLens::packed, x
// [1, rows, dim]): row r belongs to the sequence b whose rows start[b] .. start[b] + q_len[b] hold
// it and sits at position r - start[b]; rows after every sequence get no position (y = x). A packed
// prefill (per_sequence 4, packed lengths of new tokens after a cache): as 3, each sequence's rows
// after its kv_len[b] - q_len[b] cached tokens.

struct Params {
    batch: u32,
    seq: u32,
    dim: u32,
    grid_x: u32,
    max_len: u32,
    per_sequence: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
// Per-sequence lengths [q_lens (batch), kv_lens (batch)] when per_sequence; a dummy otherwise.
@group(0) @binding(4) var<storage, read> lens: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    // A packed batch is one [1, rows, dim] tensor of `batch` sequences.
    let sequences = select(params.batch, 1u, params.per_sequence >= 3u);
    if i >= sequences * params.seq * params.dim {
        return;
    }
    let c = i % params.dim;
    let l = (i / params.dim) % params.seq;
    var p = l;
    if params.per_sequence >= 3u {
        // The last sequence starting at or before row l (starts ascend; empty sequences share the
        // next one's start, and holding no rows they are never the one found with l inside).
        var lo = 0u;
        var hi = params.batch;
        while hi - lo > 1u {
            let mid = (lo + hi) / 2u;
            if lens[2u * params.batch + mid] <= l {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let position = l - lens[2u * params.batch + lo];
        if position >= lens[lo] {
            y[i] = x[i];
            return;
        }
        var cached = 0u;
        if params.per_sequence == 4u {
            cached = lens[params.batch + lo] - min(lens[lo], lens[params.batch + lo]);
        }
        p = min(cached + position, params.max_len - 1u);
    } else if params.per_sequence != 0u {
        let b = i / (params.seq * params.dim);
        // Rows past a sequence's new tokens are padding: any in-table position serves.
        var row = l;
        if params.per_sequence == 2u && l < lens[b] {
            row = lens[2u * params.batch + b * params.seq + l];
        }
        p = min(lens[params.batch + b] - min(lens[b], lens[params.batch + b]) + row, params.max_len - 1u);
    }
    y[i] = x[i] + table[p * params.dim + c];
}
