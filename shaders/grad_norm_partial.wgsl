// Global gradient norm, stage 1: invocation w sums the squares of elements [w * CHUNK, (w + 1) * CHUNK)
// of one gradient tensor, in order, into partials[partial_offset + w]. Deterministic, no atomics.

struct Params {
    len: u32,
    partial_offset: u32,
    grid_x: u32,
    pad: u32,
}

override WG: u32 = 64u;
override CHUNK: u32 = 256u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> grad: array<f32>;
@group(0) @binding(2) var<storage, read_write> partials: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let w = gid.y * params.grid_x * WG + gid.x;
    let begin = w * CHUNK;
    if begin >= params.len {
        return;
    }
    let end = min(begin + CHUNK, params.len);
    var sum = 0.0;
    for (var i = begin; i < end; i++) {
        sum += grad[i] * grad[i];
    }
    partials[params.partial_offset + w] = sum;
}
