// Gradient of the mean cross-entropy with respect to the logits (SPEC.md), one invocation per row:
//   dlogits_iv = (softmax_iv - [v == target_i]) / count   for counted rows, 0 for ignored ones,
// with the softmax recomputed from the saved lse and `count` read from the reduction's output.
// LOSS_SCALED multiplies it by the loss scale (mixed precision, src/kernels/loss_scale.rs): the
// f32 bits of loss_scale[0], a power of two, so only the exponent changes.

struct Params {
    rows: u32,
    classes: u32,
    ignore_index: u32,
    grid_x: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read> row_lse: array<f32>;
@group(0) @binding(4) var<storage, read> loss: array<f32>;
@group(0) @binding(5) var<storage, read_write> d_logits: array<f32>;
@group(0) @binding(6) var<storage, read> loss_scale: array<u32>;

override LOSS_SCALED: bool = false;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y * params.grid_x * WG + gid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.classes;
    let target_id = targets[row];
    let counted = target_id != params.ignore_index && target_id < params.classes;
    let count = loss[1];
    var inv = 0.0;
    if counted && count > 0.0 {
        inv = 1.0 / count;
    }
    if LOSS_SCALED {
        inv *= bitcast<f32>(loss_scale[0]);
    }
    let lse = row_lse[row];
    for (var v = 0u; v < params.classes; v++) {
        var g = exp(logits[base + v] - lse);
        if v == target_id {
            g -= 1.0;
        }
        d_logits[base + v] = g * inv;
    }
}
