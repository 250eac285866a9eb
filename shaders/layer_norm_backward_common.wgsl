// LayerNorm backward, input gradient (SPEC.md), the statement both kernel families share: with
// xhat = (x - mean) * rstd and g = dy * gamma,
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))  (+ residual, the gradient of a residual
// connection around the LayerNorm, added here instead of in a pass of its own),
// from the (mean, rstd) the forward saved. CENTERED = false is RMSNorm's (mean 0, and no mean(g)
// term: dx = rstd * (g - xhat * mean(g * xhat))). layer_norm_backward.wgsl gives a row an
// invocation, layer_norm_backward_rows.wgsl a workgroup.

struct Params {
    rows: u32,
    cols: u32,
    // 1: add residual[i] to dx.
    has_residual: u32,
    // Invocations (a row per invocation) or workgroups (a row per workgroup) along x of the grid.
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

// (g, g * xhat) at column c of the row starting at `base`: the terms of the row's two sums.
fn layer_norm_grad_terms(base: u32, c: u32, st: vec2<f32>) -> vec2<f32> {
    let g = dy[base + c] * gamma[c];
    return vec2<f32>(g, g * (x[base + c] - st.x) * st.y);
}

// Writes dx at column c from the row's sums of layer_norm_grad_terms.
fn layer_norm_dx(base: u32, c: u32, st: vec2<f32>, sums: vec2<f32>) {
    let n = f32(params.cols);
    let mean_g = select(0.0, sums.x / n, CENTERED);
    let xhat = (x[base + c] - st.x) * st.y;
    var d = st.y * (dy[base + c] * gamma[c] - mean_g - xhat * (sums.y / n));
    if params.has_residual != 0u {
        d += residual[base + c];
    }
    dx[base + c] = d;
}
