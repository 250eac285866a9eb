// Positional encoding forward: y[b, l, c] = x[b, l, c] + table[l, c] for a [max_len, dim] table,
// sinusoidal (computed once on the host in f64) or learned. The backward to x is the identity.

struct Params {
    batch: u32,
    seq: u32,
    dim: u32,
    grid_x: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.batch * params.seq * params.dim {
        return;
    }
    y[i] = x[i] + table[i % (params.seq * params.dim)];
}
