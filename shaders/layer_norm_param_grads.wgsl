// LayerNorm backward, parameter gradients (SPEC.md): dgamma = sum over rows of dy * xhat,
// dbeta = sum over rows of dy. One invocation per column sums the rows [row_begin, row_end) in order:
// deterministic, no atomics. The host splits long row ranges into several dispatches (llvmpipe's loop
// cap); every dispatch after the first adds to the sums (accumulate = 1). CENTERED = false is
// RMSNorm's: no shift, so d_beta is not written (the host may bind d_gamma there).

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
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> dy: array<f32>;
@group(0) @binding(4) var<storage, read_write> d_gamma: array<f32>;
@group(0) @binding(5) var<storage, read_write> d_beta: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.y * params.grid_x * WG + gid.x;
    if col >= params.cols {
        return;
    }
    var dg = 0.0;
    var db = 0.0;
    for (var row = params.row_begin; row < params.row_end; row++) {
        let st = stats[row];
        let i = row * params.cols + col;
        dg += dy[i] * (x[i] - st.x) * st.y;
        db += dy[i];
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
