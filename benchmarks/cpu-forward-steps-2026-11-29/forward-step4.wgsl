// Fused attention forward, FlashAttention-2 style (SPEC.md): O = softmax(modify(scale * Q K^T) + masks) V and
// lse = log-sum-exp of each row, in one pass over K/V tiles with an online softmax. The Lq x Lk score
// matrix is never materialised.
//
// A workgroup owns BLOCK_M = 4 * WG query rows of one (batch, head). Each invocation owns four rows,
// one per vec4 lane: q (transposed, qt[d] = the four rows' q[d]), the output accumulator, running max
// and sum. Every K/V component staged in workgroup memory then feeds one vec4 FMA, four rows at once,
// and the inner loops are short and of constant trip count. The loops step four keys by eight dims
// (a quad, attention/cpu/quads.wgsl): one read of the staged tile per 32 values where the device lets a
// subgroup share it.
//
// The key loop runs over [chunk_begin, chunk_end). When the host splits it into several dispatches
// (drivers that cap loop iterations), each later chunk merges its partial softmax into O and lse.

override WG: u32 = 64u;
override BLOCK_N: u32 = 32u;

// The per-invocation arrays' sizes, declared by the pipeline's key (private arrays need constant
// lengths; src/kernels/attention/variant.rs): MAX_D: the head dims rounded up to whole quads. The
// head dims (DK, DV, their staged strides DK4P, DV4P) and the staged tiles of K and V (tile_qk,
// tile_vo): attention/cpu/quads.wgsl. Tiles hold whole quads (BLOCK_N a multiple of 4).
override TILE_ROWS: u32 = BLOCK_N;
// Keys per step of the key loop: eight quads.
const STEP: u32 = 16u;

// Q, K and V (bindings 2-4) and their reads four elements at a time: attention/input_rows.wgsl or
// attention/input_rows_vec4.wgsl; the staged tiles' views: attention/cpu/views_kv.wgsl.
@group(0) @binding(5) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse_buf: array<f32>;

// Key n0 + jj's modified, masked score for the four rows (NEG_BIG where masked, or where jj is not
// among the tile's n_tile keys: only ever a max seed).
fn tile_score(
    s: vec4<f32>,
    rows: vec4<u32>,
    n0: u32,
    jj: u32,
    n_tile: u32,
    b: u32,
    h: u32,
    row_start: vec4<u32>,
    row_end: vec4<u32>,
) -> vec4<f32> {
    let j = n0 + jj;
    let m = modify_scores(s, rows, vec4<u32>(j), b, h);
    let seen = visible(j, row_start, row_end) & score_visible(m) & vec4<bool>(jj < n_tile);
    return select(vec4<f32>(NEG_BIG), m, seen);
}

// A step's eight quads of keys, a QuadLanes each: their scores, then their probabilities.
struct Step {
    q0: QuadLanes,
    q1: QuadLanes,
    q2: QuadLanes,
    q3: QuadLanes,
}

// Eight accumulator columns of the invocation's four rows.
struct Columns {
    c0: vec4<f32>,
    c1: vec4<f32>,
    c2: vec4<f32>,
    c3: vec4<f32>,
    c4: vec4<f32>,
    c5: vec4<f32>,
    c6: vec4<f32>,
    c7: vec4<f32>,
}

// The step's scores plus eight dims (8 d8 ..) of its quads that hold keys of the tile (`quads` of
// them; a quad past the tile's end is left as it is) against the invocation's columns x0 .. x7.
fn step_dots(
    s: Step,
    j0: u32,
    quads: u32,
    d8: u32,
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    x4: vec4<f32>,
    x5: vec4<f32>,
    x6: vec4<f32>,
    x7: vec4<f32>,
) -> Step {
    var t = s;
    t.q0 = quad_dots(t.q0, qk_quad(j0, d8), x0, x1, x2, x3, x4, x5, x6, x7);
    if quads > 1u {
        t.q1 = quad_dots(t.q1, qk_quad(j0 + 4u, d8), x0, x1, x2, x3, x4, x5, x6, x7);
    }
    if quads > 2u {
        t.q2 = quad_dots(t.q2, qk_quad(j0 + 8u, d8), x0, x1, x2, x3, x4, x5, x6, x7);
    }
    if quads > 3u {
        t.q3 = quad_dots(t.q3, qk_quad(j0 + 12u, d8), x0, x1, x2, x3, x4, x5, x6, x7);
    }
    return t;
}

// The masked scores of the quad of keys n0 + jj .. n0 + jj + 3 (tile_score).
fn quad_scores(
    s: QuadLanes,
    rows: vec4<u32>,
    n0: u32,
    jj: u32,
    n_tile: u32,
    b: u32,
    h: u32,
    row_start: vec4<u32>,
    row_end: vec4<u32>,
) -> QuadLanes {
    return QuadLanes(
        tile_score(s.r0, rows, n0, jj, n_tile, b, h, row_start, row_end),
        tile_score(s.r1, rows, n0, jj + 1u, n_tile, b, h, row_start, row_end),
        tile_score(s.r2, rows, n0, jj + 2u, n_tile, b, h, row_start, row_end),
        tile_score(s.r3, rows, n0, jj + 3u, n_tile, b, h, row_start, row_end),
    );
}

fn quad_max(p: QuadLanes) -> vec4<f32> {
    return max(max(p.r0, p.r1), max(p.r2, p.r3));
}

// The quad's probabilities against the running maximum m (visible_exp).
fn quad_exp(p: QuadLanes, m: vec4<f32>) -> QuadLanes {
    return QuadLanes(visible_exp(p.r0, m), visible_exp(p.r1, m), visible_exp(p.r2, m), visible_exp(p.r3, m));
}

// sum plus the quad's probabilities, key by key.
fn quad_sum(sum: vec4<f32>, e: QuadLanes) -> vec4<f32> {
    return (((sum + e.r0) + e.r1) + e.r2) + e.r3;
}

// Whether every row of the subgroup sees the quad's four keys (the same for every lane).
fn quad_full(e: QuadLanes) -> bool {
    return quad_all(all(p_visible(e.r0) & p_visible(e.r1) & p_visible(e.r2) & p_visible(e.r3)));
}

// The columns plus the quad's keys' values v weighted by their probabilities e, in key order (the
// one-key loop's bits); masked products where some row does not see all four (`full` false: a NaN
// in a masked key's value is not the row's).
fn add_quad(a: Columns, e: QuadLanes, v: Quad, full: bool) -> Columns {
    if full {
        return Columns(
            (((a.c0 + e.r0 * v.a0.x) + e.r1 * v.a1.x) + e.r2 * v.a2.x) + e.r3 * v.a3.x,
            (((a.c1 + e.r0 * v.a0.y) + e.r1 * v.a1.y) + e.r2 * v.a2.y) + e.r3 * v.a3.y,
            (((a.c2 + e.r0 * v.a0.z) + e.r1 * v.a1.z) + e.r2 * v.a2.z) + e.r3 * v.a3.z,
            (((a.c3 + e.r0 * v.a0.w) + e.r1 * v.a1.w) + e.r2 * v.a2.w) + e.r3 * v.a3.w,
            (((a.c4 + e.r0 * v.b0.x) + e.r1 * v.b1.x) + e.r2 * v.b2.x) + e.r3 * v.b3.x,
            (((a.c5 + e.r0 * v.b0.y) + e.r1 * v.b1.y) + e.r2 * v.b2.y) + e.r3 * v.b3.y,
            (((a.c6 + e.r0 * v.b0.z) + e.r1 * v.b1.z) + e.r2 * v.b2.z) + e.r3 * v.b3.z,
            (((a.c7 + e.r0 * v.b0.w) + e.r1 * v.b1.w) + e.r2 * v.b2.w) + e.r3 * v.b3.w,
        );
    }
    let k0 = p_visible(e.r0);
    let k1 = p_visible(e.r1);
    let k2 = p_visible(e.r2);
    let k3 = p_visible(e.r3);
    return Columns(
        masked_sum4(a.c0, e.r0, e.r1, e.r2, e.r3, v.a0.x, v.a1.x, v.a2.x, v.a3.x, k0, k1, k2, k3),
        masked_sum4(a.c1, e.r0, e.r1, e.r2, e.r3, v.a0.y, v.a1.y, v.a2.y, v.a3.y, k0, k1, k2, k3),
        masked_sum4(a.c2, e.r0, e.r1, e.r2, e.r3, v.a0.z, v.a1.z, v.a2.z, v.a3.z, k0, k1, k2, k3),
        masked_sum4(a.c3, e.r0, e.r1, e.r2, e.r3, v.a0.w, v.a1.w, v.a2.w, v.a3.w, k0, k1, k2, k3),
        masked_sum4(a.c4, e.r0, e.r1, e.r2, e.r3, v.b0.x, v.b1.x, v.b2.x, v.b3.x, k0, k1, k2, k3),
        masked_sum4(a.c5, e.r0, e.r1, e.r2, e.r3, v.b0.y, v.b1.y, v.b2.y, v.b3.y, k0, k1, k2, k3),
        masked_sum4(a.c6, e.r0, e.r1, e.r2, e.r3, v.b0.z, v.b1.z, v.b2.z, v.b3.z, k0, k1, k2, k3),
        masked_sum4(a.c7, e.r0, e.r1, e.r2, e.r3, v.b0.w, v.b1.w, v.b2.w, v.b3.w, k0, k1, k2, k3),
    );
}

// The step's keys' values, eight dims (8 d8 ..), added to the columns (quads past the tile's end
// skipped; `full` bit q: quad q seen by every row of the subgroup).
fn step_values(a: Columns, e: Step, j0: u32, quads: u32, full: u32, d8: u32) -> Columns {
    var c = add_quad(a, e.q0, vo_quad(j0, d8), (full & 1u) != 0u);
    if quads > 1u {
        c = add_quad(c, e.q1, vo_quad(j0 + 4u, d8), (full & 2u) != 0u);
    }
    if quads > 2u {
        c = add_quad(c, e.q2, vo_quad(j0 + 8u, d8), (full & 4u) != 0u);
    }
    if quads > 3u {
        c = add_quad(c, e.q3, vo_quad(j0 + 12u, d8), (full & 8u) != 0u);
    }
    return c;
}

// acc plus the masked products p_n * x_n of four keys (masked_product with keep_n), added in key
// order: the bits of adding them one by one.
fn masked_sum4(
    acc: vec4<f32>,
    p0: vec4<f32>,
    p1: vec4<f32>,
    p2: vec4<f32>,
    p3: vec4<f32>,
    x0: f32,
    x1: f32,
    x2: f32,
    x3: f32,
    keep0: vec4<bool>,
    keep1: vec4<bool>,
    keep2: vec4<bool>,
    keep3: vec4<bool>,
) -> vec4<f32> {
    return (((acc + masked_product(p0, x0, keep0)) + masked_product(p1, x1, keep1))
        + masked_product(p2, x2, keep2)) + masked_product(p3, x3, keep3);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, ids: QuadIds) {
    quad_init(ids);
    let lid = ids.index;
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier below in uniform control flow.
    if group >= params.total_groups {
        return;
    }
    let q_block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let h_kv = h / (params.heads / params.kv_heads);
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    // Row i sits at key position i + shift (see row_shift).
    let shift = row_shift(b);
    let row0 = q_block * WG * 4u;
    let rows = vec4<u32>(row0 + lid) + vec4<u32>(0u, 1u, 2u, 3u) * WG;

    var qt: array<vec4<f32>, MAX_D>;
    var acc: array<vec4<f32>, MAX_D>;
    // Keys [row_start, row_end) are visible to each row; none for padded rows.
    var row_start = vec4<u32>(0u);
    var row_end = vec4<u32>(0u);
    for (var d = 0u; d < DK4P * 4u; d++) {
        qt[d] = vec4<f32>(0.0);
    }
    for (var d = 0u; d < DV4P * 4u; d++) {
        acc[d] = vec4<f32>(0.0);
    }
    for (var r = 0u; r < 4u; r++) {
        let i = rows[r];
        if i < qlen {
            row_start[r] = keys_start_at(i32(i) + shift);
            row_end[r] = keys_end_at(i32(i) + shift, kvlen);
            let q_base = view_index(VIEW_Q, b, i, h);
            for (var d4 = 0u; d4 < DK4; d4++) {
                let x = q_row4(q_base + 4u * d4, DK - 4u * d4) * params.scale;
                for (var c = 0u; c < 4u; c++) {
                    qt[4u * d4 + c][r] = x[c];
                }
            }
        }
    }

    // Keys visible to any row of the block: those of its last valid row (masks are monotone in i).
    let keys = query_block_keys(shift, row0, WG * 4u, qlen, kvlen);
    let n_end = min(keys.y, params.chunk_end);
    let n_begin = max(params.chunk_begin, keys.x);

    var m = vec4<f32>(NEG_BIG);
    var l = vec4<f32>(0.0);
    for (var n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        let n_tile = min(BLOCK_N, n_end - n0);
        workgroupBarrier();
        stage_tiles(lid, b, n0, n_tile, h_kv);
        workgroupBarrier();

        for (var j0 = 0u; j0 < n_tile; j0 += STEP) {
            // The step's quads that hold keys of the tile (the last may be partly past its end:
            // those keys are masked by tile_score; the reads stay inside the tile).
            let quads = min(STEP, n_tile - j0 + 3u) / 4u;
            // Scores, a quad at a time: each q component loaded once feeds 32 keys (the sums keep
            // the one-key order, four dims per addition).
            var s = Step();
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let d = d8 * 8u;
                s = step_dots(
                    s,
                    j0,
                    quads,
                    d8,
                    qt[d], qt[d + 1u], qt[d + 2u], qt[d + 3u],
                    qt[d + 4u], qt[d + 5u], qt[d + 6u], qt[d + 7u],
                );
            }
            let sc = Step(
                quad_scores(s.q0, rows, n0, j0, n_tile, b, h, row_start, row_end),
                quad_scores(s.q1, rows, n0, j0 + 4u, n_tile, b, h, row_start, row_end),
                quad_scores(s.q2, rows, n0, j0 + 8u, n_tile, b, h, row_start, row_end),
                quad_scores(s.q3, rows, n0, j0 + 12u, n_tile, b, h, row_start, row_end),
            );
            let step_max =
                max(max(quad_max(sc.q0), quad_max(sc.q1)), max(quad_max(sc.q2), quad_max(sc.q3)));

            // Online softmax: one rescale of the accumulator per step, folded into the P.V pass
            // below. Both maxima are finite, so alpha is 1 while a row has seen no key and 0 when
            // its first key arrives. Masked scores are NEG_BIG exactly, so score_visible tells
            // them apart; their p is masked_p, so the products below skip them.
            let m_new = max(m, step_max);
            let alpha = exp(m - m_new);
            let e = Step(
                quad_exp(sc.q0, m_new),
                quad_exp(sc.q1, m_new),
                quad_exp(sc.q2, m_new),
                quad_exp(sc.q3, m_new),
            );
            var row_sum = quad_sum(vec4<f32>(0.0), e.q0);
            row_sum = quad_sum(row_sum, e.q1);
            row_sum = quad_sum(row_sum, e.q2);
            row_sum = quad_sum(row_sum, e.q3);
            // Bit q: every row of the subgroup sees quad q's four keys (quad_all: the same for
            // every lane).
            let full = u32(quad_full(e.q0)) | (u32(quad_full(e.q1)) << 1u)
                | (u32(quad_full(e.q2)) << 2u) | (u32(quad_full(e.q3)) << 3u);
            l = l * alpha + row_sum;
            m = m_new;
            // P.V with the head dims outermost: eight accumulator columns loaded and stored once
            // per step (private arrays are what CPU drivers move slowest), the keys added in order.
            for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
                let d = d8 * 8u;
                var a = Columns(
                    acc[d] * alpha, acc[d + 1u] * alpha, acc[d + 2u] * alpha, acc[d + 3u] * alpha,
                    acc[d + 4u] * alpha, acc[d + 5u] * alpha, acc[d + 6u] * alpha, acc[d + 7u] * alpha,
                );
                a = step_values(a, e, j0, quads, full, d8);
                acc[d] = a.c0;
                acc[d + 1u] = a.c1;
                acc[d + 2u] = a.c2;
                acc[d + 3u] = a.c3;
                acc[d + 4u] = a.c4;
                acc[d + 5u] = a.c5;
                acc[d + 6u] = a.c6;
                acc[d + 7u] = a.c7;
            }
        }
    }

    let first_chunk = params.accumulate == 0u;
    for (var r = 0u; r < 4u; r++) {
        let i = rows[r];
        if i >= params.q_seq {
            continue;
        }
        let base = view_index(VIEW_O, b, i, h);
        let lse_index = (b * params.heads + h) * params.q_seq + i;
        // l > 0 iff the row saw a key in this chunk (its largest term is exp(0) = 1).
        if i >= qlen || l[r] == 0.0 {
            // Padded rows and rows with no visible key: O = 0, lse = -inf (SPEC.md); a later chunk
            // without keys for the row leaves the merged result alone.
            if first_chunk {
                if row_stored(VIEW_O, b, i) {
                    for (var d = 0u; d < DV; d++) {
                        o_buf[base + d] = 0.0;
                    }
                }
                lse_buf[lse_index] = neg_inf();
            }
            continue;
        }
        let lse_chunk = m[r] + log(l[r]);
        var w_chunk = 1.0 / l[r];
        var w_prev = 0.0;
        var lse = lse_chunk;
        if !first_chunk {
            // Split-softmax merge with the chunks before: weights exp(lse_k - lse_total).
            let lse_prev = lse_buf[lse_index];
            if not_masked(lse_prev) {
                let top = max(lse_prev, lse_chunk);
                let e_prev = exp(lse_prev - top);
                let e_chunk = exp(lse_chunk - top);
                let total = e_prev + e_chunk;
                lse = top + log(total);
                w_prev = e_prev / total;
                w_chunk *= e_chunk / total;
            }
        }
        for (var d = 0u; d < DV; d++) {
            var o = acc[d][r] * w_chunk;
            if w_prev > 0.0 {
                o += o_buf[base + d] * w_prev;
            }
            o_buf[base + d] = o;
        }
        lse_buf[lse_index] = lse;
    }
}
