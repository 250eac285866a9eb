// Global gradient norm, stage 2: one invocation sums the partial sums in order and writes
// [norm, scale] with scale = min(1, max_norm / (norm + 1e-6)) when clipping (clip = 1), else 1.
// The optimizer reads the scale from the buffer, so clipping needs no readback.
//
// Non-finite guard: the first step whose gradient norm or a watched value (the loss) is Inf or NaN
// is latched into health = [step, what] (what: bit 0 gradient norm, bit 1 watched value); the AdamW
// kernel changes nothing while health[0] != 0, so the parameters stay those of the last good step.
//
// LOSS_SCALING (mixed precision, src/kernels/loss_scale.rs): the gradients are S times the loss's,
// for S the f32 bits of scaling[0]. The norm written is the unscaled one, norm[1] folds 1 / S into
// the clip scale, and a non-finite norm skips this step instead of latching (scaling[3] = 1, read by
// the AdamW kernel), halves S (not below 1) and counts the skip in scaling[2]; after
// growth_interval clean steps in a row (scaling[1]) S doubles, up to 2^24. Only the watched loss
// latches.

struct Params {
    partials: u32,
    clip: u32,
    max_norm: f32,
    step: u32,
    watched: u32,
    growth_interval: u32,
    pad1: u32,
    pad2: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> partials: array<f32>;
@group(0) @binding(2) var<storage, read_write> norm: array<f32>;
@group(0) @binding(3) var<storage, read> watched: array<f32>;
@group(0) @binding(4) var<storage, read_write> health: array<u32>;
@group(0) @binding(5) var<storage, read_write> scaling: array<u32>;

override LOSS_SCALING: bool = false;
const MAX_LOSS_SCALE: f32 = 16777216.0;

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
    var n = sqrt(sum);
    // The gradients' scale (1 without loss scaling), and whether a non-finite norm latches.
    var scale = 1.0;
    var latches = true;
    if LOSS_SCALING {
        scale = bitcast<f32>(scaling[0]);
        n /= scale;
        latches = false;
        let overflow = !is_finite(n);
        scaling[3] = u32(overflow);
        if overflow {
            scaling[0] = bitcast<u32>(max(scale * 0.5, 1.0));
            scaling[1] = 0u;
            scaling[2] += 1u;
        } else {
            scaling[1] += 1u;
            if scaling[1] >= params.growth_interval {
                scaling[0] = bitcast<u32>(min(scale * 2.0, MAX_LOSS_SCALE));
                scaling[1] = 0u;
            }
        }
    }
    norm[0] = n;
    let clip = select(1.0, min(1.0, params.max_norm / (n + 1e-6)), params.clip != 0u);
    // Without loss scaling exactly the clip scale (scale is 1 and the division is left out).
    norm[1] = select(clip, clip / scale, LOSS_SCALING);
    if health[0] == 0u {
        var what = select(1u, 0u, is_finite(n) || !latches);
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
