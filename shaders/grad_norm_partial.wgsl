// Global gradient norm, stage 1: invocation w sums the squares of the CHUNK elements of partial
// c = partial_base + w, which belongs to a tensor of the group (optimizer_common.wgsl), in order,
// into partials[c]. Each tensor's partials cover it from its first element; deterministic, no
// atomics.

struct Params {
    first: u32,
    count: u32,
    // Partials of this group and the global index of its first.
    partials: u32,
    partial_base: u32,
    grid_x: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

override WG: u32 = 64u;
override CHUNK: u32 = 256u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> partials: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let w = gid.y * params.grid_x * WG + gid.x;
    if w >= params.partials {
        return;
    }
    let c = params.partial_base + w;
    let segment = find_segment(params.first, params.count, c, true);
    let begin = (c - segment.partial_start) * CHUNK;
    let end = min(begin + CHUNK, segment.len);
    var sum = 0.0;
    for (var i = begin; i < end; i++) {
        let g = grad[segment.grad + i];
        sum += g * g;
    }
    partials[c] = sum;
}
