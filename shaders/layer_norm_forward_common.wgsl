// LayerNorm forward (SPEC.md), the statement both kernel families share: over the last dimension of
// `rows x cols`,
//   y = (x - mean) * rstd * gamma + beta,   rstd = 1 / sqrt(var + eps),   var the biased variance,
// saving (mean, rstd) per row for the backward. CENTERED = false is RMSNorm (LLaMA's):
//   y = x * rstd * gamma,   rstd = 1 / sqrt(mean(x^2) + eps),   saved as (0, rstd), beta unread.
// Both compute the mean, then the centred variance (exact where E[x^2] - mean^2 would cancel), then
// the output: layer_norm_forward.wgsl with one invocation per row, layer_norm_forward_rows.wgsl with a
// workgroup per row.

struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    // Invocations (a row per invocation) or workgroups (a row per workgroup) along x of the grid.
    grid_x: u32,
}

override WG: u32 = 64u;
override CENTERED: bool = true;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> gamma: array<f32>;
@group(0) @binding(3) var<storage, read> beta: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> stats: array<vec2<f32>>;

// rstd from the sum of squared deviations of a row.
fn layer_norm_rstd(squares: f32) -> f32 {
    return inverseSqrt(squares / f32(params.cols) + params.eps);
}

// Writes y at column c of the row starting at `base`.
fn layer_norm_output(base: u32, c: u32, mean: f32, rstd: f32) {
    var v = (x[base + c] - mean) * rstd * gamma[c];
    if CENTERED {
        v += beta[c];
    }
    y[base + c] = v;
}
