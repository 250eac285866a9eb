// Learned positional table gradient: d_table[l, c] = sum over b of dy[b, l, c] for l < seq (in batch
// order, deterministic) and 0 for the rows past the sequence. One invocation per table element.

struct Params {
    batch: u32,
    seq: u32,
    dim: u32,
    grid_x: u32,
    max_len: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> dy: array<f32>;
@group(0) @binding(2) var<storage, read_write> d_table: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.max_len * params.dim {
        return;
    }
    var s = 0.0;
    if i < params.seq * params.dim {
        for (var b = 0u; b < params.batch; b++) {
            s += dy[b * params.seq * params.dim + i];
        }
    }
    d_table[i] = s;
}
