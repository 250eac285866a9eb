// The GPU family's steps over its staged tiles, shared by the forward, dQ and dK/dV kernels: staging
// rows of an input view into workgroup memory, and the register micro-tile of dot products read back
// from there (S = Q K^T and dP = dO V^T, or their transposes in dK/dV).
//
// Each kernel says where the views it stages live: staged_stride(view) (vec4s between staged rows),
// staged_at(view, index) and store_staged(view, row, d4, x) (vec4 d4 of staged row `row`);
// input_row4(view, index, count) reads four elements of a view from its binding (the backward
// kernels' in attention/gpu/backward_tiles.wgsl), and MAX_DOTS bounds a micro-tile's columns (the
// key's MAX_SK or MAX_SQ). Rows are found by input_index (attention/kv_pages*.wgsl: a paged cache's
// through its block table) and scaled by row_scale (attention/input_rows*.wgsl: an int8 cache's
// row scale, else 1). The view is a constant at every call, so a call compiles to the one tile
// and binding it names.

// Whether a view holds the score's head dim DK (Q and K) rather than the value's DV (V, O, dO).
fn score_side(view: u32) -> bool {
    return view == VIEW_Q || view == VIEW_K;
}

// vec4s per staged row of a view.
fn view_d4s(view: u32) -> u32 {
    return select(DV4, DK4, score_side(view));
}

// Elements index .. index + 3 of Q, K or V (the first `count` of them) from its binding
// (attention/input_rows.wgsl or its vec4 build): what a kernel's input_row4 reads for those views.
fn qkv_row4(view: u32, index: u32, count: u32) -> vec4<f32> {
    switch view {
        case VIEW_Q: {
            return q_row4(index, count);
        }
        case VIEW_K: {
            return k_row4(index, count);
        }
        default: {
            return v_row4(index, count);
        }
    }
}

// vec4 d4 of staged row `row` of a view.
fn staged(view: u32, row: u32, d4: u32) -> vec4<f32> {
    return staged_at(view, row * staged_stride(view) + d4);
}

// Stages the workgroup's rows of `view`: rows row0 .. row0 + BM - 1 of a query-side view, BN of a
// key-side one (head `head` of batch b), times `scale`; rows at or past `end` are zeros. Every
// invocation takes part; the caller places the barriers.
fn stage_rows(lid: u32, view: u32, b: u32, head: u32, row0: u32, end: u32, scale: f32) {
    let dims = select(DV, DK, score_side(view));
    let d4s = view_d4s(view);
    let rows = select(BM, BN, key_side(view));
    for (var t = lid; t < rows * d4s; t += WG) {
        let r = t / d4s;
        let d4 = t % d4s;
        let i = row0 + r;
        var x = vec4<f32>(0.0);
        if i < end {
            let row = input_index(view, b, i, head);
            x = input_row4(view, row + 4u * d4, dims - 4u * d4) * row_scale(view, row) * scale;
        }
        store_staged(view, r, d4, x);
    }
}

// The invocation's register micro-tile: the dot products of four staged rows of `rows_view` (rows
// 4 group .. 4 group + 3, the vec4 lanes) with `count` staged rows of `cols_view` (row
// lane + lanes * c for column c), over their head dim. Each d4 reads the four rows once, ahead of
// the columns. Returned by value: WGSL's pointer parameters become GLSL copies of the whole array.
fn tile_dots(
    rows_view: u32,
    group: u32,
    cols_view: u32,
    lane: u32,
    lanes: u32,
    count: u32,
) -> array<vec4<f32>, MAX_DOTS> {
    var dots: array<vec4<f32>, MAX_DOTS>;
    let stride = staged_stride(rows_view);
    let row = 4u * group * stride;
    for (var d4 = 0u; d4 < view_d4s(rows_view); d4++) {
        let x0 = staged_at(rows_view, row + d4);
        let x1 = staged_at(rows_view, row + stride + d4);
        let x2 = staged_at(rows_view, row + 2u * stride + d4);
        let x3 = staged_at(rows_view, row + 3u * stride + d4);
        for (var c = 0u; c < count; c++) {
            let y = staged_at(cols_view, (lane + lanes * c) * staged_stride(cols_view) + d4);
            dots[c] += vec4<f32>(dot(x0, y), dot(x1, y), dot(x2, y), dot(x3, y));
        }
    }
    return dots;
}
