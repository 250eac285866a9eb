// Learned positional table gradient: d_table[l, c] = sum over b of dy[b, l, c] for l < seq (in batch
// order, deterministic) and 0 for the rows past the sequence. A packed batch (per_sequence 3,
// SeqLens::packed, dy [1, rows, dim]): the sum over the sequences b with l < q_len[b] of
// dy[start[b] + l, c], in sequence order. One invocation per table element.

struct Params {
    batch: u32,
    seq: u32,
    dim: u32,
    grid_x: u32,
    max_len: u32,
    per_sequence: u32,
    pad1: u32,
    pad2: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> dy: array<f32>;
@group(0) @binding(2) var<storage, read_write> d_table: array<f32>;
// The packed lengths [q_lens, kv_lens, q_starts, kv_starts] (per_sequence 3); a dummy otherwise.
@group(0) @binding(3) var<storage, read> lens: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.max_len * params.dim {
        return;
    }
    var s = 0.0;
    if params.per_sequence == 3u {
        let l = i / params.dim;
        let c = i % params.dim;
        for (var b = 0u; b < params.batch; b++) {
            if l < lens[b] {
                s += dy[(lens[2u * params.batch + b] + l) * params.dim + c];
            }
        }
    } else if i < params.seq * params.dim {
        for (var b = 0u; b < params.batch; b++) {
            s += dy[b * params.seq * params.dim + i];
        }
    }
    d_table[i] = s;
}
