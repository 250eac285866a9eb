// The tensor-core backward kernels' shared steps (attention/coop/backward_dq.wgsl and
// backward_dkdv.wgsl): staging rows of Q, K, V or dO into the MatElem tiles of `mat_mem`, and the
// per-row values of a query tile. Each kernel declares `mat_mem`, `WG` and the row arrays; Q, K, V
// and dO are read through attention/input_rows.wgsl and attention/do_rows.wgsl (or their vec4
// builds), appended by the host.

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
