// LayerNorm forward (SPEC.md): over the last dimension of `rows x cols`,
//   y = (x - mean) * rstd * gamma + beta,   rstd = 1 / sqrt(var + eps),   var the biased variance,
// saving (mean, rstd) per row for the backward. CENTERED = false is RMSNorm (LLaMA's):
//   y = x * rstd * gamma,   rstd = 1 / sqrt(mean(x^2) + eps),   saved as (0, rstd), beta unread. One invocation per row: two passes over the row
// (mean, then the centred variance, which is exact where E[x^2] - mean^2 would cancel), then the
// output. Loop iterations stay 3 * cols per invocation (the host caps cols under llvmpipe's loop cap).

struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
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

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y * params.grid_x * WG + gid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.cols;
    let n = f32(params.cols);
    var sum = 0.0;
    if CENTERED {
        for (var c = 0u; c < params.cols; c++) {
            sum += x[base + c];
        }
    }
    let mean = sum / n;
    var sq = 0.0;
    for (var c = 0u; c < params.cols; c++) {
        let d = x[base + c] - mean;
        sq += d * d;
    }
    let rstd = inverseSqrt(sq / n + params.eps);
    for (var c = 0u; c < params.cols; c++) {
        var v = (x[base + c] - mean) * rstd * gamma[c];
        if CENTERED {
            v += beta[c];
        }
        y[base + c] = v;
    }
    stats[row] = vec2<f32>(mean, rstd);
}
