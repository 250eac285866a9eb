// Token embedding backward (SPEC.md): d_table[v, c] = sum over t with tokens[t] == v of dy[t, c].
// A deterministic scatter-add without atomics: one invocation owns column c of d_table, so no two
// invocations write the same element, and it adds tokens [token_begin, token_end) in order. The
// first dispatch (accumulate = 0) zeroes the column first; later dispatches of a split token range add.

struct Params {
    tokens: u32,
    dim: u32,
    vocab: u32,
    grid_x: u32,
    token_begin: u32,
    token_end: u32,
    accumulate: u32,
    pad: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read> dy: array<f32>;
@group(0) @binding(3) var<storage, read_write> d_table: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.y * params.grid_x * WG + gid.x;
    if c >= params.dim {
        return;
    }
    if params.accumulate == 0u {
        for (var v = 0u; v < params.vocab; v++) {
            d_table[v * params.dim + c] = 0.0;
        }
    }
    for (var t = params.token_begin; t < params.token_end; t++) {
        let id = min(tokens[t], params.vocab - 1u);
        let i = id * params.dim + c;
        d_table[i] = d_table[i] + dy[t * params.dim + c];
    }
}
