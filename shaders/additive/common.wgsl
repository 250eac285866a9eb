// Shared by the fused additive attention kernels (after attention/common.wgsl): the one statement of
// the additive score
//   e_ij = scale * sum_c w[h, c] tanh(a[b, i, h, c] + b[b, j, h, c] + bias[h, c])
// and its derivative. Each invocation holds one side of the pair in a private row (`own`: a + bias
// for query-side kernels, b for the key side), the other side's rows are staged in `pair_tile`, and
// scale * w is staged in `w_tile`.
//
// The score dim is packed in vec4s (DA4 of them per row, zero-padded: a padded component has w = 0
// and tanh(0) = 0, so it adds nothing), and the kernels step four staged rows at a time: one step
// takes a vec4 of its own row and of w and four vec4s of staged rows for 16 (pair, component) terms,
// where a scalar loop over the score dim spent a load of each per term.

override WG: u32 = 64u;
// Rows of the other side per staged tile (a multiple of 4).
override TILE: u32 = 32u;
override DA: u32 = 64u;
override DV: u32 = 64u;
// Invocations sharing one row (the backward kernels, additive/backward_lanes.wgsl; 1 elsewhere).
// Staged rows are zero-padded to a multiple of LANES vec4s of the score dim (DA4) and of LANES value
// dims (DVS), so that lane l of a row takes every LANES-th of them, from l, without a bound check.
override LANES: u32 = 1u;
override DA4: u32 = ((DA + 3u) / 4u + LANES - 1u) / LANES * LANES;
override DVS: u32 = (DV + LANES - 1u) / LANES * LANES;
override PAIR_TILE: u32 = TILE * DA4;
override V_TILE: u32 = TILE / 4u * DVS;

// Sizes of the per-invocation arrays: MAX_DA and MAX_DV, the pipeline's exact Da and Dv, declared by
// the host (private arrays need constant lengths).
const MAX_DA4: u32 = (MAX_DA + 3u) / 4u;

// The projections and values every additive kernel reads: a [B, Lq, H, Da] (VIEW_Q),
// b [B, Lk, H, Da] (VIEW_K), V [B, Lk, H, Dv] (VIEW_V).
@group(0) @binding(2) var<storage, read> a_rows: array<f32>;
@group(0) @binding(3) var<storage, read> b_keys: array<f32>;
@group(0) @binding(4) var<storage, read> v_keys: array<f32>;

// additive_w and additive_bias: score_params.wgsl (the forward kernels') or
// backward_workspace.wgsl (the backward's).

// Staged row r's components 4 c4 .. 4 c4 + 3 at r * DA4 + c4.
var<workgroup> pair_tile: array<vec4<f32>, PAIR_TILE>;
var<workgroup> w_tile: array<vec4<f32>, DA4>;
// Staged value rows, packed by fours of rows: rows 4 q .. 4 q + 3 of value dim d at q * DVS + d
// (the query-side kernels' V; the key side stages dO the same way). The lanes of a row read
// consecutive entries.
var<workgroup> v_tile: array<vec4<f32>, V_TILE>;

// Components 4 c4 .. 4 c4 + 3 of a + bias (query row i) or of b (key row j), zero past Da.
fn a_plus_bias4(b: u32, i: u32, h: u32, c4: u32) -> vec4<f32> {
    let base = view_index(VIEW_Q, b, i, h);
    var x = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        let c = 4u * c4 + k;
        if c < DA {
            x[k] = a_rows[base + c] + additive_bias(h * DA + c);
        }
    }
    return x;
}

fn b_key4(b: u32, j: u32, h: u32, c4: u32) -> vec4<f32> {
    let base = view_index(VIEW_K, b, j, h);
    var x = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        let c = 4u * c4 + k;
        if c < DA {
            x[k] = b_keys[base + c];
        }
    }
    return x;
}

// scale * w of head h into w_tile (before the first barrier of the tile loop).
fn stage_w(h: u32, lid: u32) {
    for (var c4 = lid; c4 < DA4; c4 += WG) {
        var x = vec4<f32>(0.0);
        for (var k = 0u; k < 4u; k++) {
            let c = 4u * c4 + k;
            if c < DA {
                x[k] = params.scale * additive_w(h * DA + c);
            }
        }
        w_tile[c4] = x;
    }
}

// Query-side kernels: stage the b and V rows of keys n0 .. n0 + TILE (zeros from kv_hi on) into
// pair_tile and v_tile. Called between barriers.
fn stage_keys(n0: u32, kv_hi: u32, b: u32, h: u32, lid: u32) {
    for (var t = lid; t < PAIR_TILE; t += WG) {
        let j = n0 + t / DA4;
        var x = vec4<f32>(0.0);
        if j < kv_hi {
            x = b_key4(b, j, h, t % DA4);
        }
        pair_tile[t] = x;
    }
    for (var t = lid; t < TILE * DVS; t += WG) {
        let jj = t / DVS;
        let d = t % DVS;
        var x = 0.0;
        if n0 + jj < kv_hi && d < DV {
            x = v_keys[view_index(VIEW_V, b, n0 + jj, h) + d];
        }
        v_tile[jj / 4u * DVS + d][jj % 4u] = x;
    }
}

// The tanh of this invocation's components 4 c4 .. 4 c4 + 3 (x) with staged rows r .. r + 3: column
// k is row r + k's. Then w * T is the four rows' share of their scores, T * ds their share of
// sum_k ds_k t_k.
fn tanh_rows(x: vec4<f32>, r: u32, c4: u32) -> mat4x4<f32> {
    let at = r * DA4 + c4;
    return mat4x4<f32>(
        capped_tanh(x + pair_tile[at]),
        capped_tanh(x + pair_tile[at + DA4]),
        capped_tanh(x + pair_tile[at + 2u * DA4]),
        capped_tanh(x + pair_tile[at + 3u * DA4]),
    );
}

// The columns of t (four pairs) whose pair is masked set to 0: a NaN in the key or query row of a
// pair the row does not see must not reach it through a product with its zero weight.
fn mask_pairs(t: mat4x4<f32>, keep: vec4<bool>) -> mat4x4<f32> {
    let zero = vec4<f32>(0.0);
    return mat4x4<f32>(
        select(zero, t[0], keep.x),
        select(zero, t[1], keep.y),
        select(zero, t[2], keep.z),
        select(zero, t[3], keep.w),
    );
}

// sum_k ds_k (1 - t_k^2): the four rows' share of de/dx (times scale * w, which the kernels apply
// once at the end).
fn dtanh_rows(t: mat4x4<f32>, ds: vec4<f32>) -> vec4<f32> {
    return ds.x * (1.0 - t[0] * t[0]) + ds.y * (1.0 - t[1] * t[1]) + ds.z * (1.0 - t[2] * t[2])
        + ds.w * (1.0 - t[3] * t[3]);
}
