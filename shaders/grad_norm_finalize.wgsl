// Global gradient norm, stage 2: one invocation sums the partial sums in order and writes
// [norm, scale] with scale = min(1, max_norm / (norm + 1e-6)) when clipping (clip = 1), else 1.
// The optimizer reads the scale from the buffer, so clipping needs no readback.
//
// Non-finite guard: the first step whose gradient norm or a watched value (the loss) is Inf or NaN
// is latched into health = [step, what] (what: bit 0 gradient norm, bit 1 watched value); the AdamW
// kernel changes nothing while health[0] != 0, so the parameters stay those of the last good step.

struct Params {
    partials: u32,
    clip: u32,
    max_norm: f32,
    step: u32,
    watched: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> partials: array<f32>;
@group(0) @binding(2) var<storage, read_write> norm: array<f32>;
@group(0) @binding(3) var<storage, read> watched: array<f32>;
@group(0) @binding(4) var<storage, read_write> health: array<u32>;

// By the bits, so that no compiler's float assumptions can fold it away.
fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

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
    if health[0] == 0u {
        var what = select(1u, 0u, is_finite(n));
        for (var i = 0u; i < params.watched; i++) {
            if !is_finite(watched[i]) {
                what |= 2u;
            }
        }
        if what != 0u {
            health[0] = params.step;
            health[1] = what;
        }
    }
}
