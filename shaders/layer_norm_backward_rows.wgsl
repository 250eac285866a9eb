// LayerNorm backward, input gradient, GPU family: the math of layer_norm_backward.wgsl (SPEC.md;
// CENTERED = false is RMSNorm's), with one workgroup per row whose invocations stride over the
// columns; the row's two sums meet in workgroup_sum2 (workgroup_sum.wgsl, prepended).

struct Params {
    rows: u32,
    cols: u32,
    // 1: add residual[i] to dx.
    has_residual: u32,
    // Workgroups along x of the 2-D grid.
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
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.y * params.grid_x + wid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.cols;
    let st = stats[row];
    let n = f32(params.cols);
    var sums = vec2<f32>(0.0);
    for (var c = lid; c < params.cols; c += WG) {
        let g = dy[base + c] * gamma[c];
        sums += vec2<f32>(g, g * (x[base + c] - st.x) * st.y);
    }
    sums = workgroup_sum2(sums, lid);
    let mean_g = select(0.0, sums.x / n, CENTERED);
    let mean_gx = sums.y / n;
    for (var c = lid; c < params.cols; c += WG) {
        let xhat = (x[base + c] - st.x) * st.y;
        var d = st.y * (dy[base + c] * gamma[c] - mean_g - xhat * mean_gx);
        if params.has_residual != 0u {
            d += residual[base + c];
        }
        dx[base + c] = d;
    }
}
