// Token embedding forward (SPEC.md): out[t, c] = table[tokens[t], c], one invocation per element.

struct Params {
    tokens: u32,
    dim: u32,
    vocab: u32,
    grid_x: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.tokens * params.dim {
        return;
    }
    let t = i / params.dim;
    let c = i % params.dim;
    // Ids are validated on the host; the clamp only keeps a stale buffer from reading out of bounds.
    let id = min(tokens[t], params.vocab - 1u);
    out[i] = table[id * params.dim + c];
}
