// The tensor-core backward kernels' shared declarations and steps (attention/coop/backward_dq.wgsl
// and backward_dkdv.wgsl): their common shape, the (lse, D) binding and the query rows' values and
// tile flags in workgroup memory; staging rows of Q, K, V or dO into the MatElem tiles of `mat_mem`
// (at once, or read into registers one tile ahead and stored when the tile's turn comes), and the
// per-row values of a query tile. Each kernel declares `mat_mem`, its tile of BM query rows and BN
// keys; Q, K, V and dO are read through attention/input_rows.wgsl and attention/do_rows.wgsl (or
// their vec4 builds), appended by the host. LOADS, declared by the pipeline's key, is the
// four-element reads per invocation of the larger of the two tiles a kernel reads ahead.

// The shape (SG, NSG, WG, DK, DV, DKP, DVP): attention/coop/shape.wgsl.
// Row strides of the staged Q / K and V / dO tiles, one 16-byte step past the rows' length (bank
// conflicts, as in attention/coop/forward.wgsl).
override KS: u32 = DKP + 8u;
override VS: u32 = DVP + 8u;

@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;

// The query tile's rows: visible keys [row_start, row_end), lse and D. As in the forward, every
// workgroup variable's size is a multiple of 16 bytes (BM is a multiple of 16), so each starts
// 16-byte aligned wherever the driver places it.
var<workgroup> row_start: array<u32, BM>;
var<workgroup> row_end: array<u32, BM>;
var<workgroup> row_lse: array<f32, BM>;
var<workgroup> row_delta: array<f32, BM>;
// Whether the tile's second factor (Q or dO in dK/dV, K in dQ) holds a non-finite value, and that
// as a uniform flag (slot 0; slot 1: dK/dV's keys where it adds dQ, attention/coop/dq_sums.wgsl).
var<workgroup> operand_bad: array<atomic<u32>, 4>;
var<workgroup> tile_flags: array<u32, 4>;

// Elements index .. index + 3 of a view (the first `count` of them) from its binding.
fn view_row4(view: u32, index: u32, count: u32) -> vec4<f32> {
    switch view {
        case VIEW_Q: {
            return q_row4(index, count);
        }
        case VIEW_K: {
            return k_row4(index, count);
        }
        case VIEW_V: {
            return v_row4(index, count);
        }
        default: {
            return do_row4(index, count);
        }
    }
}

// Stages `rows` rows of `view` (rows row0 .. of head `head` of batch b, `dims` wide), times `scale`
// and rounded to MatElem, at mat_mem[at + r * stride + d] for d below `padded` (a multiple of 16);
// rows at or past `end` and dims past `dims` are zeros. Whether any staged value is not finite
// (after rounding: an f32 beyond f16's range counts). Every invocation takes part; the caller
// places the barriers.
fn stage_tile(
    lid: u32,
    view: u32,
    b: u32,
    head: u32,
    row0: u32,
    rows: u32,
    end: u32,
    dims: u32,
    padded: u32,
    at: u32,
    stride: u32,
    scale: f32,
) -> bool {
    var bad = false;
    for (var t = 4u * lid; t < rows * padded; t += 4u * WG) {
        let r = t / padded;
        let d = t % padded;
        let i = row0 + r;
        var x = vec4<f32>(0.0);
        if i < end && d < dims {
            x = view_row4(view, view_index(view, b, i, head) + d, dims - d) * scale;
        }
        for (var c = 0u; c < 4u; c++) {
            let staged = MatElem(x[c]);
            bad = bad || !finite(f32(staged));
            mat_mem[at + r * stride + d + c] = staged;
        }
    }
    return bad;
}

// Invocation lid's share of `rows` rows of `view` as stage_tile reads them (unscaled), rounded to
// MatElem: elements 4 (lid + u WG) .. + 3 of the row-major [rows x padded] tile at [u]. Read one
// tile ahead, so that the loads are in flight while the tile before is multiplied.
fn read_tile(
    lid: u32,
    view: u32,
    b: u32,
    head: u32,
    row0: u32,
    rows: u32,
    end: u32,
    dims: u32,
    padded: u32,
) -> array<vec4<MatElem>, LOADS> {
    var x: array<vec4<MatElem>, LOADS>;
    for (var u = 0u; u < LOADS; u++) {
        let t = 4u * (lid + u * WG);
        let i = row0 + t / padded;
        let d = t % padded;
        var v = vec4<f32>(0.0);
        if t < rows * padded && i < end && d < dims {
            v = view_row4(view, view_index(view, b, i, head) + d, dims - d);
        }
        x[u] = vec4<MatElem>(v);
    }
    return x;
}

// Stores a tile read_tile read at mat_mem[at + r * stride + d]; whether any of its values is not
// finite.
fn store_tile(lid: u32, x: array<vec4<MatElem>, LOADS>, rows: u32, padded: u32, at: u32, stride: u32) -> bool {
    var bad = false;
    for (var u = 0u; u < LOADS; u++) {
        let t = 4u * (lid + u * WG);
        if t < rows * padded {
            for (var c = 0u; c < 4u; c++) {
                bad = bad || !finite(f32(x[u][c]));
                mat_mem[at + (t / padded) * stride + t % padded + c] = x[u][c];
            }
        }
    }
    return bad;
}

// The visible keys [key_start, key_end) and the forward's statistics (lse, D) of query rows
// row0 .. row0 + BM - 1 of head h (rows at or past `end` see no key), into the row arrays.
fn stage_row_values(lid: u32, b: u32, h: u32, row0: u32, end: u32, kvlen: u32) {
    for (var r = lid; r < BM; r += WG) {
        let i = row0 + r;
        var start = 0u;
        var stop = 0u;
        var st = vec2<f32>(0.0);
        if i < end {
            start = key_start(i);
            stop = key_end(i, kvlen);
            // lse is -inf for rows that see no key; such a row's pairs are all masked.
            if stop > start {
                st = stats[(b * params.heads + h) * params.q_seq + i];
            }
        }
        row_start[r] = start;
        row_end[r] = stop;
        row_lse[r] = st.x;
        row_delta[r] = st.y;
    }
}
