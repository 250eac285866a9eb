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
const STEP: u32 = 32u;

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
    q4: QuadLanes,
    q5: QuadLanes,
    q6: QuadLanes,
    q7: QuadLanes,
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
    if quads > 4u {
        t.q4 = quad_dots(t.q4, qk_quad(j0 + 16u, d8), x0, x1, x2, x3, x4, x5, x6, x7);
    }
    if quads > 5u {
        t.q5 = quad_dots(t.q5, qk_quad(j0 + 20u, d8), x0, x1, x2, x3, x4, x5, x6, x7);
    }
    if quads > 6u {
        t.q6 = quad_dots(t.q6, qk_quad(j0 + 24u, d8), x0, x1, x2, x3, x4, x5, x6, x7);
    }
    if quads > 7u {
        t.q7 = quad_dots(t.q7, qk_quad(j0 + 28u, d8), x0, x1, x2, x3, x4, x5, x6, x7);
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
    if quads > 4u {
        c = add_quad(c, e.q4, vo_quad(j0 + 16u, d8), (full & 16u) != 0u);
    }
    if quads > 5u {
        c = add_quad(c, e.q5, vo_quad(j0 + 20u, d8), (full & 32u) != 0u);
    }
    if quads > 6u {
        c = add_quad(c, e.q6, vo_quad(j0 + 24u, d8), (full & 64u) != 0u);
    }
    if quads > 7u {
        c = add_quad(c, e.q7, vo_quad(j0 + 28u, d8), (full & 128u) != 0u);
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
    // Head dim 64 written out (experiment): q's columns and the accumulator's as values.
    let q0 = qt[0];
    let q1 = qt[1];
    let q2 = qt[2];
    let q3 = qt[3];
    let q4 = qt[4];
    let q5 = qt[5];
    let q6 = qt[6];
    let q7 = qt[7];
    let q8 = qt[8];
    let q9 = qt[9];
    let q10 = qt[10];
    let q11 = qt[11];
    let q12 = qt[12];
    let q13 = qt[13];
    let q14 = qt[14];
    let q15 = qt[15];
    let q16 = qt[16];
    let q17 = qt[17];
    let q18 = qt[18];
    let q19 = qt[19];
    let q20 = qt[20];
    let q21 = qt[21];
    let q22 = qt[22];
    let q23 = qt[23];
    let q24 = qt[24];
    let q25 = qt[25];
    let q26 = qt[26];
    let q27 = qt[27];
    let q28 = qt[28];
    let q29 = qt[29];
    let q30 = qt[30];
    let q31 = qt[31];
    let q32 = qt[32];
    let q33 = qt[33];
    let q34 = qt[34];
    let q35 = qt[35];
    let q36 = qt[36];
    let q37 = qt[37];
    let q38 = qt[38];
    let q39 = qt[39];
    let q40 = qt[40];
    let q41 = qt[41];
    let q42 = qt[42];
    let q43 = qt[43];
    let q44 = qt[44];
    let q45 = qt[45];
    let q46 = qt[46];
    let q47 = qt[47];
    let q48 = qt[48];
    let q49 = qt[49];
    let q50 = qt[50];
    let q51 = qt[51];
    let q52 = qt[52];
    let q53 = qt[53];
    let q54 = qt[54];
    let q55 = qt[55];
    let q56 = qt[56];
    let q57 = qt[57];
    let q58 = qt[58];
    let q59 = qt[59];
    let q60 = qt[60];
    let q61 = qt[61];
    let q62 = qt[62];
    let q63 = qt[63];
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    var c4 = vec4<f32>(0.0);
    var c5 = vec4<f32>(0.0);
    var c6 = vec4<f32>(0.0);
    var c7 = vec4<f32>(0.0);
    var c8 = vec4<f32>(0.0);
    var c9 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0);
    var c11 = vec4<f32>(0.0);
    var c12 = vec4<f32>(0.0);
    var c13 = vec4<f32>(0.0);
    var c14 = vec4<f32>(0.0);
    var c15 = vec4<f32>(0.0);
    var c16 = vec4<f32>(0.0);
    var c17 = vec4<f32>(0.0);
    var c18 = vec4<f32>(0.0);
    var c19 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0);
    var c21 = vec4<f32>(0.0);
    var c22 = vec4<f32>(0.0);
    var c23 = vec4<f32>(0.0);
    var c24 = vec4<f32>(0.0);
    var c25 = vec4<f32>(0.0);
    var c26 = vec4<f32>(0.0);
    var c27 = vec4<f32>(0.0);
    var c28 = vec4<f32>(0.0);
    var c29 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0);
    var c31 = vec4<f32>(0.0);
    var c32 = vec4<f32>(0.0);
    var c33 = vec4<f32>(0.0);
    var c34 = vec4<f32>(0.0);
    var c35 = vec4<f32>(0.0);
    var c36 = vec4<f32>(0.0);
    var c37 = vec4<f32>(0.0);
    var c38 = vec4<f32>(0.0);
    var c39 = vec4<f32>(0.0);
    var c40 = vec4<f32>(0.0);
    var c41 = vec4<f32>(0.0);
    var c42 = vec4<f32>(0.0);
    var c43 = vec4<f32>(0.0);
    var c44 = vec4<f32>(0.0);
    var c45 = vec4<f32>(0.0);
    var c46 = vec4<f32>(0.0);
    var c47 = vec4<f32>(0.0);
    var c48 = vec4<f32>(0.0);
    var c49 = vec4<f32>(0.0);
    var c50 = vec4<f32>(0.0);
    var c51 = vec4<f32>(0.0);
    var c52 = vec4<f32>(0.0);
    var c53 = vec4<f32>(0.0);
    var c54 = vec4<f32>(0.0);
    var c55 = vec4<f32>(0.0);
    var c56 = vec4<f32>(0.0);
    var c57 = vec4<f32>(0.0);
    var c58 = vec4<f32>(0.0);
    var c59 = vec4<f32>(0.0);
    var c60 = vec4<f32>(0.0);
    var c61 = vec4<f32>(0.0);
    var c62 = vec4<f32>(0.0);
    var c63 = vec4<f32>(0.0);
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
            s = step_dots(s, j0, quads, 0u, q0, q1, q2, q3, q4, q5, q6, q7);
            s = step_dots(s, j0, quads, 1u, q8, q9, q10, q11, q12, q13, q14, q15);
            s = step_dots(s, j0, quads, 2u, q16, q17, q18, q19, q20, q21, q22, q23);
            s = step_dots(s, j0, quads, 3u, q24, q25, q26, q27, q28, q29, q30, q31);
            s = step_dots(s, j0, quads, 4u, q32, q33, q34, q35, q36, q37, q38, q39);
            s = step_dots(s, j0, quads, 5u, q40, q41, q42, q43, q44, q45, q46, q47);
            s = step_dots(s, j0, quads, 6u, q48, q49, q50, q51, q52, q53, q54, q55);
            s = step_dots(s, j0, quads, 7u, q56, q57, q58, q59, q60, q61, q62, q63);
            let sc = Step(
                quad_scores(s.q0, rows, n0, j0, n_tile, b, h, row_start, row_end),
                quad_scores(s.q1, rows, n0, j0 + 4u, n_tile, b, h, row_start, row_end),
                quad_scores(s.q2, rows, n0, j0 + 8u, n_tile, b, h, row_start, row_end),
                quad_scores(s.q3, rows, n0, j0 + 12u, n_tile, b, h, row_start, row_end),
                quad_scores(s.q4, rows, n0, j0 + 16u, n_tile, b, h, row_start, row_end),
                quad_scores(s.q5, rows, n0, j0 + 20u, n_tile, b, h, row_start, row_end),
                quad_scores(s.q6, rows, n0, j0 + 24u, n_tile, b, h, row_start, row_end),
                quad_scores(s.q7, rows, n0, j0 + 28u, n_tile, b, h, row_start, row_end),
            );
            let step_max = max(
                max(max(quad_max(sc.q0), quad_max(sc.q1)), max(quad_max(sc.q2), quad_max(sc.q3))),
                max(max(quad_max(sc.q4), quad_max(sc.q5)), max(quad_max(sc.q6), quad_max(sc.q7))),
            );

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
                quad_exp(sc.q4, m_new),
                quad_exp(sc.q5, m_new),
                quad_exp(sc.q6, m_new),
                quad_exp(sc.q7, m_new),
            );
            var row_sum = quad_sum(vec4<f32>(0.0), e.q0);
            row_sum = quad_sum(row_sum, e.q1);
            row_sum = quad_sum(row_sum, e.q2);
            row_sum = quad_sum(row_sum, e.q3);
            row_sum = quad_sum(row_sum, e.q4);
            row_sum = quad_sum(row_sum, e.q5);
            row_sum = quad_sum(row_sum, e.q6);
            row_sum = quad_sum(row_sum, e.q7);
            // Bit q: every row of the subgroup sees quad q's four keys (quad_all: the same for
            // every lane).
            let full = u32(quad_full(e.q0)) | (u32(quad_full(e.q1)) << 1u)
                | (u32(quad_full(e.q2)) << 2u) | (u32(quad_full(e.q3)) << 3u)
                | (u32(quad_full(e.q4)) << 4u) | (u32(quad_full(e.q5)) << 5u)
                | (u32(quad_full(e.q6)) << 6u) | (u32(quad_full(e.q7)) << 7u);
            l = l * alpha + row_sum;
            m = m_new;
            // P.V with the head dims outermost: eight accumulator columns loaded and stored once
            // per step (private arrays are what CPU drivers move slowest), the keys added in order.
            {
                var a = Columns(c0 * alpha, c1 * alpha, c2 * alpha, c3 * alpha, c4 * alpha, c5 * alpha, c6 * alpha, c7 * alpha);
                a = step_values(a, e, j0, quads, full, 0u);
                c0 = a.c0;
                c1 = a.c1;
                c2 = a.c2;
                c3 = a.c3;
                c4 = a.c4;
                c5 = a.c5;
                c6 = a.c6;
                c7 = a.c7;
            }
            {
                var a = Columns(c8 * alpha, c9 * alpha, c10 * alpha, c11 * alpha, c12 * alpha, c13 * alpha, c14 * alpha, c15 * alpha);
                a = step_values(a, e, j0, quads, full, 1u);
                c8 = a.c0;
                c9 = a.c1;
                c10 = a.c2;
                c11 = a.c3;
                c12 = a.c4;
                c13 = a.c5;
                c14 = a.c6;
                c15 = a.c7;
            }
            {
                var a = Columns(c16 * alpha, c17 * alpha, c18 * alpha, c19 * alpha, c20 * alpha, c21 * alpha, c22 * alpha, c23 * alpha);
                a = step_values(a, e, j0, quads, full, 2u);
                c16 = a.c0;
                c17 = a.c1;
                c18 = a.c2;
                c19 = a.c3;
                c20 = a.c4;
                c21 = a.c5;
                c22 = a.c6;
                c23 = a.c7;
            }
            {
                var a = Columns(c24 * alpha, c25 * alpha, c26 * alpha, c27 * alpha, c28 * alpha, c29 * alpha, c30 * alpha, c31 * alpha);
                a = step_values(a, e, j0, quads, full, 3u);
                c24 = a.c0;
                c25 = a.c1;
                c26 = a.c2;
                c27 = a.c3;
                c28 = a.c4;
                c29 = a.c5;
                c30 = a.c6;
                c31 = a.c7;
            }
            {
                var a = Columns(c32 * alpha, c33 * alpha, c34 * alpha, c35 * alpha, c36 * alpha, c37 * alpha, c38 * alpha, c39 * alpha);
                a = step_values(a, e, j0, quads, full, 4u);
                c32 = a.c0;
                c33 = a.c1;
                c34 = a.c2;
                c35 = a.c3;
                c36 = a.c4;
                c37 = a.c5;
                c38 = a.c6;
                c39 = a.c7;
            }
            {
                var a = Columns(c40 * alpha, c41 * alpha, c42 * alpha, c43 * alpha, c44 * alpha, c45 * alpha, c46 * alpha, c47 * alpha);
                a = step_values(a, e, j0, quads, full, 5u);
                c40 = a.c0;
                c41 = a.c1;
                c42 = a.c2;
                c43 = a.c3;
                c44 = a.c4;
                c45 = a.c5;
                c46 = a.c6;
                c47 = a.c7;
            }
            {
                var a = Columns(c48 * alpha, c49 * alpha, c50 * alpha, c51 * alpha, c52 * alpha, c53 * alpha, c54 * alpha, c55 * alpha);
                a = step_values(a, e, j0, quads, full, 6u);
                c48 = a.c0;
                c49 = a.c1;
                c50 = a.c2;
                c51 = a.c3;
                c52 = a.c4;
                c53 = a.c5;
                c54 = a.c6;
                c55 = a.c7;
            }
            {
                var a = Columns(c56 * alpha, c57 * alpha, c58 * alpha, c59 * alpha, c60 * alpha, c61 * alpha, c62 * alpha, c63 * alpha);
                a = step_values(a, e, j0, quads, full, 7u);
                c56 = a.c0;
                c57 = a.c1;
                c58 = a.c2;
                c59 = a.c3;
                c60 = a.c4;
                c61 = a.c5;
                c62 = a.c6;
                c63 = a.c7;
            }
        }
    }

    acc[0] = c0;
    acc[1] = c1;
    acc[2] = c2;
    acc[3] = c3;
    acc[4] = c4;
    acc[5] = c5;
    acc[6] = c6;
    acc[7] = c7;
    acc[8] = c8;
    acc[9] = c9;
    acc[10] = c10;
    acc[11] = c11;
    acc[12] = c12;
    acc[13] = c13;
    acc[14] = c14;
    acc[15] = c15;
    acc[16] = c16;
    acc[17] = c17;
    acc[18] = c18;
    acc[19] = c19;
    acc[20] = c20;
    acc[21] = c21;
    acc[22] = c22;
    acc[23] = c23;
    acc[24] = c24;
    acc[25] = c25;
    acc[26] = c26;
    acc[27] = c27;
    acc[28] = c28;
    acc[29] = c29;
    acc[30] = c30;
    acc[31] = c31;
    acc[32] = c32;
    acc[33] = c33;
    acc[34] = c34;
    acc[35] = c35;
    acc[36] = c36;
    acc[37] = c37;
    acc[38] = c38;
    acc[39] = c39;
    acc[40] = c40;
    acc[41] = c41;
    acc[42] = c42;
    acc[43] = c43;
    acc[44] = c44;
    acc[45] = c45;
    acc[46] = c46;
    acc[47] = c47;
    acc[48] = c48;
    acc[49] = c49;
    acc[50] = c50;
    acc[51] = c51;
    acc[52] = c52;
    acc[53] = c53;
    acc[54] = c54;
    acc[55] = c55;
    acc[56] = c56;
    acc[57] = c57;
    acc[58] = c58;
    acc[59] = c59;
    acc[60] = c60;
    acc[61] = c61;
    acc[62] = c62;
    acc[63] = c63;
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
