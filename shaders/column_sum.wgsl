// Column sums of a row-major [rows, cols] matrix: sums[c] = sum over rows of x[r, c], one invocation
// per column adding rows [row_begin, row_end) in order (deterministic, no atomics): the bias gradient
// of a Linear layer. Later dispatches of a split row range add to the sums (accumulate = 1).

struct Params {
    rows: u32,
    cols: u32,
    row_begin: u32,
    row_end: u32,
    accumulate: u32,
    grid_x: u32,
    pad0: u32,
    pad1: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> sums: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.y * params.grid_x * WG + gid.x;
    if col >= params.cols {
        return;
    }
    var s = 0.0;
    for (var row = params.row_begin; row < params.row_end; row++) {
        s += x[row * params.cols + col];
    }
    if params.accumulate != 0u {
        s += sums[col];
    }
    sums[col] = s;
}
