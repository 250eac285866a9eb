// Shared by the fused additive attention kernels (after attention_common.wgsl): the one statement of
// the additive score
//   e_ij = scale * sum_c w[h, c] tanh(a[b, i, h, c] + b[b, j, h, c] + bias[h, c])
// and its derivative. Each invocation holds one side of the pair in a private row (`own`: a + bias
// for query-side kernels, b for the key side), the other side's rows are staged in `pair_tile`, and
// scale * w is staged in `w_tile`.

override WG: u32 = 64u;
// Rows of the other side per staged tile.
override TILE: u32 = 32u;
override DA: u32 = 64u;
override DV: u32 = 64u;

// Sizes of the per-invocation arrays; the host writes the pipeline's exact Da and Dv here.
const MAX_DA: u32 = 128u;
const MAX_DV: u32 = 128u;

// The score vector w and the bias, [H, Da] each.
@group(0) @binding(2) var<storage, read> w_buf: array<f32>;
@group(0) @binding(3) var<storage, read> bias_buf: array<f32>;

var<workgroup> pair_tile: array<f32, TILE * DA>;
var<workgroup> w_tile: array<f32, DA>;

// tanh where every implementation is exact to f32 (some compute it through exp(2x), which overflows).
fn tanh1(x: f32) -> f32 {
    return tanh(clamp(x, -15.0, 15.0));
}

// scale * w of head h into w_tile (before the first barrier of the tile loop).
fn stage_w(h: u32, lid: u32) {
    for (var c = lid; c < DA; c += WG) {
        w_tile[c] = params.scale * w_buf[h * DA + c];
    }
}

// e of this invocation's row and staged row r.
fn additive_score(own: ptr<function, array<f32, MAX_DA>>, r: u32) -> f32 {
    var e = 0.0;
    for (var c = 0u; c < DA; c++) {
        e += w_tile[c] * tanh1((*own)[c] + pair_tile[r * DA + c]);
    }
    return e;
}

// t_c = tanh(..) of this invocation's row and staged row r, and de/d(a_c) = de/d(b_c) = de/d(bias_c)
// = scale * w_c (1 - t_c^2), for component c.
fn additive_t(own: ptr<function, array<f32, MAX_DA>>, r: u32, c: u32) -> f32 {
    return tanh1((*own)[c] + pair_tile[r * DA + c]);
}

fn additive_dt(t: f32, c: u32) -> f32 {
    return w_tile[c] * (1.0 - t * t);
}
