// LayerNorm backward, parameter gradients, GPU family, first of two steps: partial sums of
// dgamma = sum over rows of dy * xhat and dbeta = sum over rows of dy over blocks of BLOCK_ROWS
// rows, one invocation per (block, column), neighbouring invocations on neighbouring columns
// (coalesced). partials holds [blocks, cols] of dgamma, then [blocks, cols] of dbeta (CENTERED
// only); layer_norm_param_sums.wgsl adds the blocks in order. Deterministic, no atomics.

struct Params {
    rows: u32,
    cols: u32,
    blocks: u32,
    grid_x: u32,
}

override WG: u32 = 64u;
override CENTERED: bool = true;
override BLOCK_ROWS: u32 = 32u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> dy: array<f32>;
@group(0) @binding(4) var<storage, read_write> partials: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let index = gid.y * params.grid_x * WG + gid.x;
    if index >= params.blocks * params.cols {
        return;
    }
    let block = index / params.cols;
    let col = index % params.cols;
    let row_end = min(params.rows, (block + 1u) * BLOCK_ROWS);
    var dg = 0.0;
    var db = 0.0;
    for (var row = block * BLOCK_ROWS; row < row_end; row++) {
        let st = stats[row];
        let i = row * params.cols + col;
        dg += dy[i] * (x[i] - st.x) * st.y;
        db += dy[i];
    }
    partials[index] = dg;
    if CENTERED {
        partials[params.blocks * params.cols + index] = db;
    }
}
