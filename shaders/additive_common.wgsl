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
// The projections and values every additive kernel reads: a [B, Lq, H, Da] (VIEW_Q),
// b [B, Lk, H, Da] (VIEW_K), V [B, Lk, H, Dv] (VIEW_V).
@group(0) @binding(4) var<storage, read> a_rows: array<f32>;
@group(0) @binding(5) var<storage, read> b_keys: array<f32>;
@group(0) @binding(6) var<storage, read> v_keys: array<f32>;

var<workgroup> pair_tile: array<f32, TILE * DA>;
var<workgroup> w_tile: array<f32, DA>;
// The query-side kernels' staged V rows.
var<workgroup> v_tile: array<f32, TILE * DV>;

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

// Query-side kernels: stage the b and V rows of keys n0 .. n0 + TILE (zeros from kv_hi on) into
// pair_tile and v_tile. Called between barriers.
fn stage_keys(n0: u32, kv_hi: u32, b: u32, h: u32, lid: u32) {
    for (var t = lid; t < TILE * DA; t += WG) {
        let j = n0 + t / DA;
        var x = 0.0;
        if j < kv_hi {
            x = b_keys[view_index(VIEW_K, b, j, h) + t % DA];
        }
        pair_tile[t] = x;
    }
    for (var t = lid; t < TILE * DV; t += WG) {
        let j = n0 + t / DV;
        var x = 0.0;
        if j < kv_hi {
            x = v_keys[view_index(VIEW_V, b, j, h) + t % DV];
        }
        v_tile[t] = x;
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

// tanh(x + pair_tile[..]) of component c of staged rows r .. r + 3: the kernels step four staged
// rows at a time, so each load of their own row, of w and of their accumulators serves four pairs.
fn tanh4(x: f32, r: u32, c: u32) -> vec4<f32> {
    let at = r * DA + c;
    return vec4<f32>(
        tanh1(x + pair_tile[at]),
        tanh1(x + pair_tile[at + DA]),
        tanh1(x + pair_tile[at + 2u * DA]),
        tanh1(x + pair_tile[at + 3u * DA]),
    );
}

// t_c = tanh(..) of this invocation's row and staged row r, and de/d(a_c) = de/d(b_c) = de/d(bias_c)
// = scale * w_c (1 - t_c^2), for component c.
fn additive_t(own: ptr<function, array<f32, MAX_DA>>, r: u32, c: u32) -> f32 {
    return tanh1((*own)[c] + pair_tile[r * DA + c]);
}

fn additive_dt(t: f32, c: u32) -> f32 {
    return w_tile[c] * (1.0 - t * t);
}
