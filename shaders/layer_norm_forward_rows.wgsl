// LayerNorm forward, GPU family: the math of layer_norm_forward.wgsl (SPEC.md; CENTERED = false is
// RMSNorm), with one workgroup per row whose invocations stride over the columns, so that loads
// are coalesced and a 1024-row batch fills a GPU (one invocation per row left most of it idle).
// The row's sums meet in workgroup_sum2 (workgroup_sum.wgsl, prepended), in a fixed order.

struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    // Workgroups along x of the 2-D grid.
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
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.y * params.grid_x + wid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.cols;
    let n = f32(params.cols);
    var mean = 0.0;
    if CENTERED {
        var sum = 0.0;
        for (var c = lid; c < params.cols; c += WG) {
            sum += x[base + c];
        }
        mean = workgroup_sum2(vec2<f32>(sum, 0.0), lid).x / n;
    }
    // The centred second pass: exact where E[x^2] - mean^2 would cancel.
    var sq = 0.0;
    for (var c = lid; c < params.cols; c += WG) {
        let d = x[base + c] - mean;
        sq += d * d;
    }
    let rstd = inverseSqrt(workgroup_sum2(vec2<f32>(sq, 0.0), lid).x / n + params.eps);
    for (var c = lid; c < params.cols; c += WG) {
        var v = (x[base + c] - mean) * rstd * gamma[c];
        if CENTERED {
            v += beta[c];
        }
        y[base + c] = v;
    }
    if lid == 0u {
        stats[row] = vec2<f32>(mean, rstd);
    }
}
