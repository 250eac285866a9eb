// LayerNorm backward, parameter gradients, GPU family, second step: each column adds the partial
// sums of layer_norm_param_partials.wgsl over blocks [row_begin, row_end) in order. The host
// splits long block ranges into several dispatches (llvmpipe's loop cap); every dispatch after the
// first adds to the sums (accumulate = 1). CENTERED = false is RMSNorm's: no d_beta (the host may
// bind d_gamma there).

// The column reductions' parameters (dispatch.rs ColumnParams): the rows are the blocks of partials.
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
override CENTERED: bool = true;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> partials: array<f32>;
@group(0) @binding(2) var<storage, read_write> d_gamma: array<f32>;
@group(0) @binding(3) var<storage, read_write> d_beta: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.y * params.grid_x * WG + gid.x;
    if col >= params.cols {
        return;
    }
    var dg = 0.0;
    var db = 0.0;
    let beta_at = params.rows * params.cols;
    for (var block = params.row_begin; block < params.row_end; block++) {
        dg += partials[block * params.cols + col];
        if CENTERED {
            db += partials[beta_at + block * params.cols + col];
        }
    }
    if params.accumulate != 0u {
        dg += d_gamma[col];
    }
    d_gamma[col] = dg;
    if CENTERED {
        if params.accumulate != 0u {
            db += d_beta[col];
        }
        d_beta[col] = db;
    }
}
