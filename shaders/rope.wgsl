// Rotary position embeddings (RoFormer, Su et al. 2021), in place on a strided [B, L, H, D] view:
// each pair (x1, x2) of the first `rotary_dim` dims of the row at position p = offset + l is rotated
// by the angle p * base^(-2k / rotary_dim) of its pair index k:
//   x1' = x1 cos - x2 sin,   x2' = x1 sin + x2 cos
// Pairs are (2k, 2k + 1) (INTERLEAVED: GPT-J, RoFormer) or (k, k + rotary_dim / 2) (GPT-NeoX, LLaMA).
// Dims past rotary_dim pass unchanged. The backward is the rotation by the negative angle (SIGN = -1)
// applied to the gradient, in place too. cos and sin come from a [max_positions, rotary_dim / 2]
// table computed in f64 on the host, so large positions keep full f32 accuracy.
// PER_SEQUENCE positions (decoding from a cache): row l of sequence b sits at kv_len[b] - q_len[b] + l,
// its new tokens being the last of its kv_len[b] (the [q_lens, kv_lens] buffer of SeqLens); in a
// tree step (per_sequence 2, SeqLens::with_trees) at kv_len[b] - q_len[b] + depth(l), the depths
// following the lengths in the same buffer. A packed view (SeqLens::packed): row l of sequence b is
// row start[b] + l of the tensor; the rows past the sequence's length are the next sequence's and
// are left alone. One invocation per (row, pair).

struct Params {
    batch: u32,
    seq: u32,
    heads: u32,
    pairs: u32,
    offset: u32,
    interleaved: u32,
    // 1.0 forward, -1.0 backward.
    sign: f32,
    grid_x: u32,
    view_offset: u32,
    stride_b: u32,
    stride_s: u32,
    stride_h: u32,
    max_positions: u32,
    per_sequence: u32,
    // A packed view: 0 none, 1 on the queries' lengths, 2 on the keys'.
    packed: u32,
    pad2: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
// cos then sin: [2, max_positions, pairs].
@group(0) @binding(1) var<storage, read> table: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
// Per-sequence lengths [q_lens (batch), kv_lens (batch)] when per_sequence; a dummy otherwise.
@group(0) @binding(3) var<storage, read> lens: array<u32>;

// Row l's offset after the cached tokens: l, or in a tree step its depth.
fn tree_row(b: u32, l: u32) -> u32 {
    if params.per_sequence == 2u && l < lens[b] {
        return lens[2u * params.batch + b * params.seq + l];
    }
    return l;
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.batch * params.seq * params.heads * params.pairs {
        return;
    }
    let k = i % params.pairs;
    let row = i / params.pairs;
    let h = row % params.heads;
    let l = (row / params.heads) % params.seq;
    let b = row / (params.heads * params.seq);
    var p = params.offset + l;
    var first = b * params.stride_b;
    if params.packed != 0u {
        let side = params.packed - 1u;
        if l >= lens[side * params.batch + b] {
            return;
        }
        first = lens[(2u + side) * params.batch + b] * params.stride_s;
    }
    if params.per_sequence != 0u {
        // Rows past a sequence's new tokens are padding: any in-table position serves.
        p = min(lens[params.batch + b] - min(lens[b], lens[params.batch + b]) + tree_row(b, l), params.max_positions - 1u);
    }
    let c = table[p * params.pairs + k];
    let s = params.sign * table[(params.max_positions + p) * params.pairs + k];
    let base = params.view_offset + first + l * params.stride_s + h * params.stride_h;
    var i1 = base + k;
    var i2 = base + k + params.pairs;
    if params.interleaved != 0u {
        i1 = base + 2u * k;
        i2 = i1 + 1u;
    }
    let x1 = x[i1];
    let x2 = x[i2];
    x[i1] = x1 * c - x2 * s;
    x[i2] = x1 * s + x2 * c;
}
