// Softmax cross-entropy forward (SPEC.md), one invocation per row of `logits [rows, classes]`:
//   lse_i = log sum_v exp(logit_iv),   loss_i = lse_i - logit_i,target_i,
// and loss_i = 0 for rows whose target is the ignore index. Writes loss and lse per row; the
// reduction kernel turns them into the mean over the counted rows.

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
@group(0) @binding(3) var<storage, read_write> row_loss: array<f32>;
@group(0) @binding(4) var<storage, read_write> row_lse: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y * params.grid_x * WG + gid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.classes;
    var top = logits[base];
    for (var v = 1u; v < params.classes; v++) {
        top = max(top, logits[base + v]);
    }
    var sum = 0.0;
    for (var v = 0u; v < params.classes; v++) {
        sum += exp(logits[base + v] - top);
    }
    let lse = top + log(sum);
    row_lse[row] = lse;
    let target_id = targets[row];
    if target_id == params.ignore_index || target_id >= params.classes {
        row_loss[row] = 0.0;
    } else {
        row_loss[row] = lse - logits[base + target_id];
    }
}
