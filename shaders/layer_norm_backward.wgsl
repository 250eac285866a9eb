// LayerNorm backward, input gradient (SPEC.md): with xhat = (x - mean) * rstd and g = dy * gamma,
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))  (+ residual, the gradient of a residual
// connection around the LayerNorm, added here instead of in a pass of its own),
// from the (mean, rstd) the forward saved. One invocation per row. CENTERED = false is RMSNorm's
// (mean 0, and no mean(g) term: dx = rstd * (g - xhat * mean(g * xhat))).

struct Params {
    rows: u32,
    cols: u32,
    // 1: add residual[i] to dx.
    has_residual: u32,
    grid_x: u32,
}

override WG: u32 = 64u;
override CENTERED: bool = true;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> gamma: array<f32>;
@group(0) @binding(3) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read> dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> dx: array<f32>;
@group(0) @binding(6) var<storage, read> residual: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y * params.grid_x * WG + gid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.cols;
    let st = stats[row];
    let n = f32(params.cols);
    var sum_g = 0.0;
    var sum_gx = 0.0;
    for (var c = 0u; c < params.cols; c++) {
        let g = dy[base + c] * gamma[c];
        sum_g += g;
        sum_gx += g * (x[base + c] - st.x) * st.y;
    }
    let mean_g = select(0.0, sum_g / n, CENTERED);
    let mean_gx = sum_gx / n;
    for (var c = 0u; c < params.cols; c++) {
        let xhat = (x[base + c] - st.x) * st.y;
        var d = st.y * (dy[base + c] * gamma[c] - mean_g - xhat * mean_gx);
        if params.has_residual != 0u {
            d += residual[base + c];
        }
        dx[base + c] = d;
    }
}
