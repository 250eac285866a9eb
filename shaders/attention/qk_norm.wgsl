// Query/key norm transforms before the scores (issue #13; CPU reference in reference::attention):
//   NORMALIZE (cosine scores):  y = x / max(|x|, EPS)
//   CLIP (key-norm clipping):   y = x * min(1, clip / |x|), so no key's norm exceeds `clip`
//   SCALE (learned cosine scale, queries): y = s[h] * x / max(|x|, EPS)
// (both: normalise, then clip). `main` writes y for every row of a strided [B, L, H, D] view into a
// contiguous scratch tensor; `backward` turns dL/dy, in place in a strided gradient view, into
// dL/dx through the same steps, recomputed from x (under SCALE it first writes the row's share of
// dL/ds[h], g . x / max(|x|, EPS), to row_dots[row], and scales g by s[h]):
//   clip:       |y1| <= clip: g1 = g;  else u = y1 / |y1|, g1 = (clip / |y1|) (g - u (u . g))
//   normalise:  |x| > EPS: g0 = (g1 - y (y . g1)) / |x|;  else g0 = g1 / EPS
// One invocation per row; the head dim is at most 256, so every loop is short.

struct View {
    offset: u32,
    stride_b: u32,
    stride_s: u32,
    stride_h: u32,
}

struct Params {
    rows: u32,
    seq: u32,
    heads: u32,
    dim: u32,
    mode: u32,
    clip: f32,
    grid_x: u32,
    pad: u32,
    x: View,
    grad: View,
}

const NORMALIZE: u32 = 1u;
const CLIP: u32 = 2u;
const SCALE: u32 = 4u;
const EPS: f32 = 1e-6;

override WG: u32 = 64u;
// 0: the transform (`main`), 1: its backward.
override BACKWARD: u32 = 0u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x_buf: array<f32>;
@group(0) @binding(2) var<storage, read_write> out_buf: array<f32>;
// SCALE: the per-head scale [H], and the backward's per-row shares of its gradient [rows]. Dummies
// otherwise.
@group(0) @binding(3) var<storage, read> head_scale: array<f32>;
@group(0) @binding(4) var<storage, read_write> row_dots: array<f32>;

// The backward's factor on the incoming gradient: s[h] under SCALE, else 1.
var<private> grad_scale: f32;

fn g_at(index: u32) -> f32 {
    return grad_scale * out_buf[index];
}

fn row_scale(row: u32) -> f32 {
    if (params.mode & SCALE) != 0u {
        return head_scale[row % params.heads];
    }
    return 1.0;
}

fn row_index(v: View, row: u32) -> u32 {
    let h = row % params.heads;
    let s = (row / params.heads) % params.seq;
    let b = row / (params.heads * params.seq);
    return v.offset + b * v.stride_b + s * v.stride_s + h * v.stride_h;
}

fn norm_of_x(base: u32) -> f32 {
    var sum = 0.0;
    for (var d = 0u; d < params.dim; d++) {
        let v = x_buf[base + d];
        sum += v * v;
    }
    return sqrt(sum);
}

// The factor x is multiplied by after normalising (1 without it): 1 / max(|x|, EPS).
fn normalize_factor(norm: f32) -> f32 {
    if (params.mode & NORMALIZE) != 0u {
        return 1.0 / max(norm, EPS);
    }
    return 1.0;
}

// The clip factor of a row of norm n (after normalising): min(1, clip / n).
fn clip_factor(n: f32) -> f32 {
    if (params.mode & CLIP) != 0u && n > params.clip {
        return params.clip / n;
    }
    return 1.0;
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y * params.grid_x * WG + gid.x;
    if row >= params.rows {
        return;
    }
    if BACKWARD != 0u {
        backward(row);
    } else {
        forward(row);
    }
}

fn forward(row: u32) {
    let base = row_index(params.x, row);
    let norm = norm_of_x(base);
    let a = normalize_factor(norm);
    let factor = a * clip_factor(norm * a) * row_scale(row);
    for (var d = 0u; d < params.dim; d++) {
        out_buf[row * params.dim + d] = x_buf[base + d] * factor;
    }
}

fn backward(row: u32) {
    let base = row_index(params.x, row);
    let g_base = row_index(params.grad, row);
    let norm = norm_of_x(base);
    let a = normalize_factor(norm);
    let n1 = norm * a;
    grad_scale = 1.0;
    if (params.mode & SCALE) != 0u {
        var dot_g = 0.0;
        for (var d = 0u; d < params.dim; d++) {
            dot_g += out_buf[g_base + d] * x_buf[base + d] * a;
        }
        row_dots[row] = dot_g;
        grad_scale = row_scale(row);
    }
    // Through the clip: y1 = a x has norm n1; u = y1 / n1 = x / norm.
    let c = clip_factor(n1);
    // u = x / |x| is the direction of x, y1 and y alike (0 for a zero row, where no term needs it).
    let inv_norm = select(0.0, 1.0 / norm, norm > 0.0);
    var u_dot_g = 0.0;
    if c < 1.0 {
        for (var d = 0u; d < params.dim; d++) {
            u_dot_g += x_buf[base + d] * inv_norm * g_at(g_base + d);
        }
    }
    // g1 = c (g - u (u . g)) (u . g = 0 without clipping); then through the normalisation, whose
    // output direction is the same u.
    var u_dot_g1 = 0.0;
    if (params.mode & NORMALIZE) != 0u && norm > EPS {
        for (var d = 0u; d < params.dim; d++) {
            let u = x_buf[base + d] * inv_norm;
            u_dot_g1 += u * c * (g_at(g_base + d) - u * u_dot_g);
        }
    }
    for (var d = 0u; d < params.dim; d++) {
        let u = x_buf[base + d] * inv_norm;
        let g1 = c * (g_at(g_base + d) - u * u_dot_g);
        var g0 = g1;
        if (params.mode & NORMALIZE) != 0u {
            g0 = (g1 - u * u_dot_g1) * a;
        }
        out_buf[g_base + d] = g0;
    }
}
