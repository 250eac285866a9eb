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
// tile_vo): attention/cpu/quads.wgsl.
const MAX_BN: u32 = 64u;
override TILE_ROWS: u32 = BLOCK_N;

// Q, K and V (bindings 2-4) and their reads four elements at a time: attention/input_rows.wgsl or
// attention/input_rows_vec4.wgsl; the staged tiles' views: attention/cpu/views_kv.wgsl.
@group(0) @binding(5) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse_buf: array<f32>;

// Key j's modified, masked score for the four rows (NEG_BIG where masked: only ever a max seed).
fn tile_score(
    s: vec4<f32>,
    rows: vec4<u32>,
    j: u32,
    b: u32,
    h: u32,
    row_start: vec4<u32>,
    row_end: vec4<u32>,
) -> vec4<f32> {
    let m = modify_scores(s, rows, vec4<u32>(j), b, h);
    return select(vec4<f32>(NEG_BIG), m, visible(j, row_start, row_end) & score_visible(m));
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
    var p: array<vec4<f32>, MAX_BN>;
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

        // Scores of the tile for the four rows; masked ones are NEG_BIG (only ever a max seed).
        // A quad at a time: each q component loaded once feeds four keys (the sums keep the
        // one-key order, four dims per addition, so the scores are the same bits).
        var tile_max = vec4<f32>(NEG_BIG);
        var jj = 0u;
        for (; jj + 4u <= n_tile; jj += 4u) {
            var s = QuadLanes();
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let d = d8 * 8u;
                s = quad_dots(
                    s,
                    qk_quad(jj, d8),
                    qt[d], qt[d + 1u], qt[d + 2u], qt[d + 3u],
                    qt[d + 4u], qt[d + 5u], qt[d + 6u], qt[d + 7u],
                );
            }
            p[jj] = tile_score(s.r0, rows, n0 + jj, b, h, row_start, row_end);
            p[jj + 1u] = tile_score(s.r1, rows, n0 + jj + 1u, b, h, row_start, row_end);
            p[jj + 2u] = tile_score(s.r2, rows, n0 + jj + 2u, b, h, row_start, row_end);
            p[jj + 3u] = tile_score(s.r3, rows, n0 + jj + 3u, b, h, row_start, row_end);
            tile_max = max(tile_max, max(max(p[jj], p[jj + 1u]), max(p[jj + 2u], p[jj + 3u])));
        }
        for (; jj < n_tile; jj++) {
            var s = vec4<f32>(0.0);
            for (var d4 = 0u; d4 < DK4; d4++) {
                let kx = tile_qk[jj * DK4P + d4];
                let d = d4 * 4u;
                s += qt[d] * kx.x + qt[d + 1u] * kx.y + qt[d + 2u] * kx.z + qt[d + 3u] * kx.w;
            }
            p[jj] = tile_score(s, rows, n0 + jj, b, h, row_start, row_end);
            tile_max = max(tile_max, p[jj]);
        }

        // Online softmax: one rescale of the accumulator per tile, folded into the P.V pass below.
        // Both maxima are finite, so alpha is 1 while a row has seen no key and 0 when its first
        // key arrives.
        let m_new = max(m, tile_max);
        let alpha = exp(m - m_new);
        // Masked scores are NEG_BIG exactly, so score_visible tells them apart; their p is masked_p,
        // so the products below skip them. Quad q of the tile is `full` (bit q) where every row of
        // the subgroup sees its four keys (quad_all: the same for every lane).
        var row_sum = vec4<f32>(0.0);
        var full = 0u;
        let quads = n_tile / 4u;
        for (var q4 = 0u; q4 < quads; q4++) {
            let j4 = q4 * 4u;
            let e0 = visible_exp(p[j4], m_new);
            let e1 = visible_exp(p[j4 + 1u], m_new);
            let e2 = visible_exp(p[j4 + 2u], m_new);
            let e3 = visible_exp(p[j4 + 3u], m_new);
            p[j4] = e0;
            p[j4 + 1u] = e1;
            p[j4 + 2u] = e2;
            p[j4 + 3u] = e3;
            row_sum = (((row_sum + e0) + e1) + e2) + e3;
            if quad_all(all(p_visible(e0) & p_visible(e1) & p_visible(e2) & p_visible(e3))) {
                full |= 1u << q4;
            }
        }
        for (var jj = quads * 4u; jj < n_tile; jj++) {
            let e = visible_exp(p[jj], m_new);
            p[jj] = e;
            row_sum += e;
        }
        l = l * alpha + row_sum;
        m = m_new;
        // P.V with the head dims outermost: eight accumulator columns held across the whole tile,
        // loaded and stored once (private arrays are what CPU drivers move slowest), the keys added
        // in order (the one-key loop's bits). Rows that mask a key skip its value (a NaN there is
        // not theirs): masked products in the quads that are not full and the tile's last keys.
        for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
            let d = d8 * 8u;
            var a0 = acc[d] * alpha;
            var a1 = acc[d + 1u] * alpha;
            var a2 = acc[d + 2u] * alpha;
            var a3 = acc[d + 3u] * alpha;
            var a4 = acc[d + 4u] * alpha;
            var a5 = acc[d + 5u] * alpha;
            var a6 = acc[d + 6u] * alpha;
            var a7 = acc[d + 7u] * alpha;
            for (var q4 = 0u; q4 < quads; q4++) {
                let j4 = q4 * 4u;
                let p0 = p[j4];
                let p1 = p[j4 + 1u];
                let p2 = p[j4 + 2u];
                let p3 = p[j4 + 3u];
                let v = vo_quad(j4, d8);
                if ((full >> q4) & 1u) != 0u {
                    a0 = (((a0 + p0 * v.a0.x) + p1 * v.a1.x) + p2 * v.a2.x) + p3 * v.a3.x;
                    a1 = (((a1 + p0 * v.a0.y) + p1 * v.a1.y) + p2 * v.a2.y) + p3 * v.a3.y;
                    a2 = (((a2 + p0 * v.a0.z) + p1 * v.a1.z) + p2 * v.a2.z) + p3 * v.a3.z;
                    a3 = (((a3 + p0 * v.a0.w) + p1 * v.a1.w) + p2 * v.a2.w) + p3 * v.a3.w;
                    a4 = (((a4 + p0 * v.b0.x) + p1 * v.b1.x) + p2 * v.b2.x) + p3 * v.b3.x;
                    a5 = (((a5 + p0 * v.b0.y) + p1 * v.b1.y) + p2 * v.b2.y) + p3 * v.b3.y;
                    a6 = (((a6 + p0 * v.b0.z) + p1 * v.b1.z) + p2 * v.b2.z) + p3 * v.b3.z;
                    a7 = (((a7 + p0 * v.b0.w) + p1 * v.b1.w) + p2 * v.b2.w) + p3 * v.b3.w;
                } else {
                    let keep0 = p_visible(p0);
                    let keep1 = p_visible(p1);
                    let keep2 = p_visible(p2);
                    let keep3 = p_visible(p3);
                    a0 = masked_sum4(a0, p0, p1, p2, p3, v.a0.x, v.a1.x, v.a2.x, v.a3.x, keep0, keep1, keep2, keep3);
                    a1 = masked_sum4(a1, p0, p1, p2, p3, v.a0.y, v.a1.y, v.a2.y, v.a3.y, keep0, keep1, keep2, keep3);
                    a2 = masked_sum4(a2, p0, p1, p2, p3, v.a0.z, v.a1.z, v.a2.z, v.a3.z, keep0, keep1, keep2, keep3);
                    a3 = masked_sum4(a3, p0, p1, p2, p3, v.a0.w, v.a1.w, v.a2.w, v.a3.w, keep0, keep1, keep2, keep3);
                    a4 = masked_sum4(a4, p0, p1, p2, p3, v.b0.x, v.b1.x, v.b2.x, v.b3.x, keep0, keep1, keep2, keep3);
                    a5 = masked_sum4(a5, p0, p1, p2, p3, v.b0.y, v.b1.y, v.b2.y, v.b3.y, keep0, keep1, keep2, keep3);
                    a6 = masked_sum4(a6, p0, p1, p2, p3, v.b0.z, v.b1.z, v.b2.z, v.b3.z, keep0, keep1, keep2, keep3);
                    a7 = masked_sum4(a7, p0, p1, p2, p3, v.b0.w, v.b1.w, v.b2.w, v.b3.w, keep0, keep1, keep2, keep3);
                }
            }
            for (var jj = quads * 4u; jj < n_tile; jj++) {
                let pj = p[jj];
                let keep = p_visible(pj);
                let va = tile_vo[jj * DV4P + 2u * d8];
                let vb = tile_vo[jj * DV4P + 2u * d8 + 1u];
                a0 += masked_product(pj, va.x, keep);
                a1 += masked_product(pj, va.y, keep);
                a2 += masked_product(pj, va.z, keep);
                a3 += masked_product(pj, va.w, keep);
                a4 += masked_product(pj, vb.x, keep);
                a5 += masked_product(pj, vb.y, keep);
                a6 += masked_product(pj, vb.z, keep);
                a7 += masked_product(pj, vb.w, keep);
            }
            acc[d] = a0;
            acc[d + 1u] = a1;
            acc[d + 2u] = a2;
            acc[d + 3u] = a3;
            acc[d + 4u] = a4;
            acc[d + 5u] = a5;
            acc[d + 6u] = a6;
            acc[d + 7u] = a7;
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
