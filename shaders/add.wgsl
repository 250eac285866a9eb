// Elementwise sum out = a + b: the residual connection forward, and in the backward the sum of the
// gradients that reach one tensor through two branches.

struct Params {
    len: u32,
    grid_x: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.len {
        return;
    }
    out[i] = a[i] + b[i];
}
