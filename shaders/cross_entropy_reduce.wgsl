// Mean cross-entropy over the rows whose target is not the ignore index: one invocation sums the
// per-row losses in row order (deterministic) and writes [mean loss, counted rows].

struct Params {
    rows: u32,
    classes: u32,
    ignore_index: u32,
    grid_x: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> targets: array<u32>;
@group(0) @binding(2) var<storage, read> row_loss: array<f32>;
@group(0) @binding(3) var<storage, read_write> loss: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if gid.x != 0u || gid.y != 0u {
        return;
    }
    var sum = 0.0;
    var count = 0u;
    for (var row = 0u; row < params.rows; row++) {
        let target_id = targets[row];
        if target_id != params.ignore_index && target_id < params.classes {
            sum += row_loss[row];
            count += 1u;
        }
    }
    loss[0] = select(0.0, sum / f32(count), count > 0u);
    loss[1] = f32(count);
}
