// Quads: four staged rows (keys, or query rows) by eight head dims, the CPU-driver kernels' step
// over a staged tile, read the same by every invocation of the workgroup (each owns other rows).
// This file holds what the three kernels share: the head dims and staged tiles, their staging, and
// the quad steps of the score, dP and gradient products. The backward kernels step several quads at
// a time (dQ two, dK/dV four): each private entry they read or update then serves 8 or 16 rows.
//
// tile_qk holds rows of the score's operand (K in the forward and dQ, Q in dK/dV), tile_vo rows of
// the value's (V, or dO). Each kernel says how many rows a tile holds (TILE_ROWS); which views the
// tiles are and how four elements of their rows are read (QK_VIEW, VO_VIEW, qk_row4, vo_row4) come
// from attention/cpu/views_kv.wgsl or attention/cpu/views_qdo.wgsl, and qk_quad and vo_quad from
// attention/cpu/quads_subgroup.wgsl or attention/cpu/quads_workgroup.wgsl, appended by the host.

override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
// Staged row strides in vec4s: whole quads (eight dims), the padding zero.
override DK4P: u32 = DK4 + (DK4 & 1u);
override DV4P: u32 = DV4 + (DV4 & 1u);
override QK_TILE: u32 = TILE_ROWS * DK4P;
override VO_TILE: u32 = TILE_ROWS * DV4P;

var<workgroup> tile_qk: array<vec4<f32>, QK_TILE>;
var<workgroup> tile_vo: array<vec4<f32>, VO_TILE>;

struct Quad {
    // Row c's dims 0..3 (a_c) and 4..7 (b_c).
    a0: vec4<f32>,
    b0: vec4<f32>,
    a1: vec4<f32>,
    b1: vec4<f32>,
    a2: vec4<f32>,
    b2: vec4<f32>,
    a3: vec4<f32>,
    b3: vec4<f32>,
}

// Per row of a quad, a vec4 over the invocation's four lanes (its rows or keys): their dot products
// with the row, or their weights for it.
struct QuadLanes {
    r0: vec4<f32>,
    r1: vec4<f32>,
    r2: vec4<f32>,
    r3: vec4<f32>,
}

// Per row of a quad, which of the invocation's four lanes see it.
struct QuadSeen {
    r0: vec4<bool>,
    r1: vec4<bool>,
    r2: vec4<bool>,
    r3: vec4<bool>,
}

// Dims 4 c4 .. 4 c4 + 3 of row `row` (head `head` of batch b) of `view` (QK_VIEW or VO_VIEW),
// zeros past `dims`: one 128-bit read where the host bound the views' vec4 build.
fn staged_row4(view: u32, dims: u32, b: u32, row: u32, head: u32, c4: u32) -> vec4<f32> {
    if c4 * 4u >= dims {
        return vec4<f32>(0.0);
    }
    let first = input_index(view, b, row, head);
    let index = first + c4 * 4u;
    if view == QK_VIEW {
        return qk_row4(index, dims - c4 * 4u) * row_scale(view, first);
    }
    return vo_row4(index, dims - c4 * 4u) * row_scale(view, first);
}


// Stages rows row0 .. row0 + count - 1 (count <= TILE_ROWS) of both operands into tile_qk and
// tile_vo; the rest of the tiles zero. Every invocation takes part.
fn stage_tiles(lid: u32, b: u32, row0: u32, count: u32, head: u32) {
    for (var t = lid; t < QK_TILE; t += WG) {
        let r = t / DK4P;
        var x = vec4<f32>(0.0);
        if r < count {
            x = staged_row4(QK_VIEW, DK, b, row0 + r, head, t % DK4P);
        }
        tile_qk[t] = x;
    }
    for (var t = lid; t < VO_TILE; t += WG) {
        let r = t / DV4P;
        var x = vec4<f32>(0.0);
        if r < count {
            x = staged_row4(VO_VIEW, DV, b, row0 + r, head, t % DV4P);
        }
        tile_vo[t] = x;
    }
}

// acc plus one quad row's eight dims (lo: 0..3, hi: 4..7) against eight private columns x0 .. x7 of
// the invocation's four rows or keys, added four dims at a time in dim order.
fn quad_row_dot(
    acc: vec4<f32>,
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    x4: vec4<f32>,
    x5: vec4<f32>,
    x6: vec4<f32>,
    x7: vec4<f32>,
    lo: vec4<f32>,
    hi: vec4<f32>,
) -> vec4<f32> {
    return (acc + (x0 * lo.x + x1 * lo.y + x2 * lo.z + x3 * lo.w))
        + (x4 * hi.x + x5 * hi.y + x6 * hi.z + x7 * hi.w);
}

// The kernels' score and dP step: `dots` plus each row of `quad` (eight dims of four staged rows)
// against the same eight dims x0 .. x7 of the invocation's four lanes (its transposed rows, x_k =
// the lanes' dim 8 d8 + k). The quad first: read before the columns, as the registers like it. The callers pass the columns as values: WGSL's pointer parameters become
// copies in and out of the whole array in GLSL, which llvmpipe's GL compiler takes minutes over.
fn quad_dots(
    dots: QuadLanes,
    quad: Quad,
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    x4: vec4<f32>,
    x5: vec4<f32>,
    x6: vec4<f32>,
    x7: vec4<f32>,
) -> QuadLanes {
    return QuadLanes(
        quad_row_dot(dots.r0, x0, x1, x2, x3, x4, x5, x6, x7, quad.a0, quad.b0),
        quad_row_dot(dots.r1, x0, x1, x2, x3, x4, x5, x6, x7, quad.a1, quad.b1),
        quad_row_dot(dots.r2, x0, x1, x2, x3, x4, x5, x6, x7, quad.a2, quad.b2),
        quad_row_dot(dots.r3, x0, x1, x2, x3, x4, x5, x6, x7, quad.a3, quad.b3),
    );
}

// Column e (0..7) of a quad: dim e of its four rows.
fn quad_column(quad: Quad, e: u32) -> vec4<f32> {
    let c = e % 4u;
    if e < 4u {
        return vec4<f32>(quad.a0[c], quad.a1[c], quad.a2[c], quad.a3[c]);
    }
    return vec4<f32>(quad.b0[c], quad.b1[c], quad.b2[c], quad.b3[c]);
}

// The backward kernels' gradient step, one dim of a quad (x: its four rows' values there): the
// rows' values times their weights w, summed in pairs, in the lanes that see each row (masked
// products: a lane that masks a row skips it, so a NaN there is not the lane's). The callers loop
// over the quad's eight dims and add to their transposed accumulators themselves (no pointer
// parameters: see quad_dots).
fn column_products(w: QuadLanes, x: vec4<f32>, seen: QuadSeen) -> vec4<f32> {
    return (masked_product(w.r0, x.x, seen.r0) + masked_product(w.r1, x.y, seen.r1))
        + (masked_product(w.r2, x.z, seen.r2) + masked_product(w.r3, x.w, seen.r3));
}

// Quad q of a backward step that starts at staged row `row` (the kernels step two or four quads at
// a time): rows row + 4 q .. row + 4 q + 3, or the tile's last four where the tile ends sooner (a
// short tile, or one that is not a whole number of steps). Those reads stay inside the tile; the
// caller masks the quad's rows by their place in the step, not by what it read.
fn step_quad(row: u32, q: u32) -> u32 {
    return min(row + 4u * q, TILE_ROWS - 4u);
}
