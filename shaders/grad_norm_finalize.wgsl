// Global gradient norm, stage 2: one invocation sums the partial sums in order and writes
// [norm, scale] with scale = min(1, max_norm / (norm + 1e-6)) when clipping (clip = 1), else 1.
// The optimizer reads the scale from the buffer, so clipping needs no readback.

struct Params {
    partials: u32,
    clip: u32,
    max_norm: f32,
    pad: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> partials: array<f32>;
@group(0) @binding(2) var<storage, read_write> norm: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if gid.x != 0u || gid.y != 0u {
        return;
    }
    var sum = 0.0;
    for (var i = 0u; i < params.partials; i++) {
        sum += partials[i];
    }
    let n = sqrt(sum);
    norm[0] = n;
    norm[1] = select(1.0, min(1.0, params.max_norm / (n + 1e-6)), params.clip != 0u);
}
