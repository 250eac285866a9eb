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


// The P.V step of one row group for one quad of keys (p0..p3: the four keys' p of the group's four
// rows) and eight V columns: a_k plus the products, in key order.
struct Acc8 {
    a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>,
    a4: vec4<f32>, a5: vec4<f32>, a6: vec4<f32>, a7: vec4<f32>,
}

fn pv_full(a: Acc8, p0: vec4<f32>, p1: vec4<f32>, p2: vec4<f32>, p3: vec4<f32>, v: Quad) -> Acc8 {
    return Acc8(
        (((a.a0 + p0 * v.a0.x) + p1 * v.a1.x) + p2 * v.a2.x) + p3 * v.a3.x,
        (((a.a1 + p0 * v.a0.y) + p1 * v.a1.y) + p2 * v.a2.y) + p3 * v.a3.y,
        (((a.a2 + p0 * v.a0.z) + p1 * v.a1.z) + p2 * v.a2.z) + p3 * v.a3.z,
        (((a.a3 + p0 * v.a0.w) + p1 * v.a1.w) + p2 * v.a2.w) + p3 * v.a3.w,
        (((a.a4 + p0 * v.b0.x) + p1 * v.b1.x) + p2 * v.b2.x) + p3 * v.b3.x,
        (((a.a5 + p0 * v.b0.y) + p1 * v.b1.y) + p2 * v.b2.y) + p3 * v.b3.y,
        (((a.a6 + p0 * v.b0.z) + p1 * v.b1.z) + p2 * v.b2.z) + p3 * v.b3.z,
        (((a.a7 + p0 * v.b0.w) + p1 * v.b1.w) + p2 * v.b2.w) + p3 * v.b3.w,
    );
}

fn pv_masked(a: Acc8, p0: vec4<f32>, p1: vec4<f32>, p2: vec4<f32>, p3: vec4<f32>, v: Quad) -> Acc8 {
    let k0 = p_visible(p0);
    let k1 = p_visible(p1);
    let k2 = p_visible(p2);
    let k3 = p_visible(p3);
    return Acc8(
        masked_sum4(a.a0, p0, p1, p2, p3, v.a0.x, v.a1.x, v.a2.x, v.a3.x, k0, k1, k2, k3),
        masked_sum4(a.a1, p0, p1, p2, p3, v.a0.y, v.a1.y, v.a2.y, v.a3.y, k0, k1, k2, k3),
        masked_sum4(a.a2, p0, p1, p2, p3, v.a0.z, v.a1.z, v.a2.z, v.a3.z, k0, k1, k2, k3),
        masked_sum4(a.a3, p0, p1, p2, p3, v.a0.w, v.a1.w, v.a2.w, v.a3.w, k0, k1, k2, k3),
        masked_sum4(a.a4, p0, p1, p2, p3, v.b0.x, v.b1.x, v.b2.x, v.b3.x, k0, k1, k2, k3),
        masked_sum4(a.a5, p0, p1, p2, p3, v.b0.y, v.b1.y, v.b2.y, v.b3.y, k0, k1, k2, k3),
        masked_sum4(a.a6, p0, p1, p2, p3, v.b0.z, v.b1.z, v.b2.z, v.b3.z, k0, k1, k2, k3),
        masked_sum4(a.a7, p0, p1, p2, p3, v.b0.w, v.b1.w, v.b2.w, v.b3.w, k0, k1, k2, k3),
    );
}

fn pv_one(a: Acc8, pj: vec4<f32>, va: vec4<f32>, vb: vec4<f32>) -> Acc8 {
    let keep = p_visible(pj);
    return Acc8(
        a.a0 + masked_product(pj, va.x, keep), a.a1 + masked_product(pj, va.y, keep),
        a.a2 + masked_product(pj, va.z, keep), a.a3 + masked_product(pj, va.w, keep),
        a.a4 + masked_product(pj, vb.x, keep), a.a5 + masked_product(pj, vb.y, keep),
        a.a6 + masked_product(pj, vb.z, keep), a.a7 + masked_product(pj, vb.w, keep),
    );
}

fn scaled(a: Acc8, alpha: vec4<f32>) -> Acc8 {
    return Acc8(a.a0 * alpha, a.a1 * alpha, a.a2 * alpha, a.a3 * alpha, a.a4 * alpha, a.a5 * alpha, a.a6 * alpha, a.a7 * alpha);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, ids: QuadIds) {
    quad_init(ids);
    let lid = ids.index;
    let group = linear_group(wg);
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
    let shift = row_shift(b);
    let row0 = q_block * WG * 8u;
    // Row group A: rows lid + {0..3} WG, B: lid + {4..7} WG.
    let rows_a = vec4<u32>(row0 + lid) + vec4<u32>(0u, 1u, 2u, 3u) * WG;
    let rows_b = vec4<u32>(row0 + lid) + vec4<u32>(4u, 5u, 6u, 7u) * WG;

    var qa: array<vec4<f32>, MAX_D>;
    var qb: array<vec4<f32>, MAX_D>;
    var acca: array<vec4<f32>, MAX_D>;
    var accb: array<vec4<f32>, MAX_D>;
    var pa: array<vec4<f32>, MAX_BN>;
    var pb: array<vec4<f32>, MAX_BN>;
    var start_a = vec4<u32>(0u);
    var end_a = vec4<u32>(0u);
    var start_b = vec4<u32>(0u);
    var end_b = vec4<u32>(0u);
    for (var r = 0u; r < 4u; r++) {
        let ia = rows_a[r];
        if ia < qlen {
            start_a[r] = keys_start_at(i32(ia) + shift);
            end_a[r] = keys_end_at(i32(ia) + shift, kvlen);
            let base = view_index(VIEW_Q, b, ia, h);
            for (var d4 = 0u; d4 < DK4; d4++) {
                let x = q_row4(base + 4u * d4, DK - 4u * d4) * params.scale;
                for (var c = 0u; c < 4u; c++) {
                    qa[4u * d4 + c][r] = x[c];
                }
            }
        }
        let ib = rows_b[r];
        if ib < qlen {
            start_b[r] = keys_start_at(i32(ib) + shift);
            end_b[r] = keys_end_at(i32(ib) + shift, kvlen);
            let base = view_index(VIEW_Q, b, ib, h);
            for (var d4 = 0u; d4 < DK4; d4++) {
                let x = q_row4(base + 4u * d4, DK - 4u * d4) * params.scale;
                for (var c = 0u; c < 4u; c++) {
                    qb[4u * d4 + c][r] = x[c];
                }
            }
        }
    }

    let keys = query_block_keys(shift, row0, WG * 8u, qlen, kvlen);
    let n_end = min(keys.y, params.chunk_end);
    let n_begin = max(params.chunk_begin, keys.x);

    var ma = vec4<f32>(NEG_BIG);
    var mb = vec4<f32>(NEG_BIG);
    var la = vec4<f32>(0.0);
    var lb = vec4<f32>(0.0);
    for (var n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        let n_tile = min(BLOCK_N, n_end - n0);
        workgroupBarrier();
        stage_tiles(lid, b, n0, n_tile, h_kv);
        workgroupBarrier();

        var max_a = vec4<f32>(NEG_BIG);
        var max_b = vec4<f32>(NEG_BIG);
        var jj = 0u;
        for (; jj + 4u <= n_tile; jj += 4u) {
            var sa = QuadLanes();
            var sb = QuadLanes();
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let d = d8 * 8u;
                let quad = qk_quad(jj, d8);
                sa = quad_dots(sa, quad, qa[d], qa[d + 1u], qa[d + 2u], qa[d + 3u], qa[d + 4u], qa[d + 5u], qa[d + 6u], qa[d + 7u]);
                sb = quad_dots(sb, quad, qb[d], qb[d + 1u], qb[d + 2u], qb[d + 3u], qb[d + 4u], qb[d + 5u], qb[d + 6u], qb[d + 7u]);
            }
            pa[jj] = tile_score(sa.r0, rows_a, n0 + jj, b, h, start_a, end_a);
            pa[jj + 1u] = tile_score(sa.r1, rows_a, n0 + jj + 1u, b, h, start_a, end_a);
            pa[jj + 2u] = tile_score(sa.r2, rows_a, n0 + jj + 2u, b, h, start_a, end_a);
            pa[jj + 3u] = tile_score(sa.r3, rows_a, n0 + jj + 3u, b, h, start_a, end_a);
            pb[jj] = tile_score(sb.r0, rows_b, n0 + jj, b, h, start_b, end_b);
            pb[jj + 1u] = tile_score(sb.r1, rows_b, n0 + jj + 1u, b, h, start_b, end_b);
            pb[jj + 2u] = tile_score(sb.r2, rows_b, n0 + jj + 2u, b, h, start_b, end_b);
            pb[jj + 3u] = tile_score(sb.r3, rows_b, n0 + jj + 3u, b, h, start_b, end_b);
            max_a = max(max_a, max(max(pa[jj], pa[jj + 1u]), max(pa[jj + 2u], pa[jj + 3u])));
            max_b = max(max_b, max(max(pb[jj], pb[jj + 1u]), max(pb[jj + 2u], pb[jj + 3u])));
        }
        for (; jj < n_tile; jj++) {
            var sa = vec4<f32>(0.0);
            var sb = vec4<f32>(0.0);
            for (var d4 = 0u; d4 < DK4; d4++) {
                let kx = tile_qk[jj * DK4P + d4];
                let d = d4 * 4u;
                sa += qa[d] * kx.x + qa[d + 1u] * kx.y + qa[d + 2u] * kx.z + qa[d + 3u] * kx.w;
                sb += qb[d] * kx.x + qb[d + 1u] * kx.y + qb[d + 2u] * kx.z + qb[d + 3u] * kx.w;
            }
            pa[jj] = tile_score(sa, rows_a, n0 + jj, b, h, start_a, end_a);
            pb[jj] = tile_score(sb, rows_b, n0 + jj, b, h, start_b, end_b);
            max_a = max(max_a, pa[jj]);
            max_b = max(max_b, pb[jj]);
        }

        let new_a = max(ma, max_a);
        let new_b = max(mb, max_b);
        let alpha_a = exp(ma - new_a);
        let alpha_b = exp(mb - new_b);
        var sum_a = vec4<f32>(0.0);
        var sum_b = vec4<f32>(0.0);
        var full = 0u;
        let quads = n_tile / 4u;
        for (var q4 = 0u; q4 < quads; q4++) {
            let j4 = q4 * 4u;
            let e0 = visible_exp(pa[j4], new_a);
            let e1 = visible_exp(pa[j4 + 1u], new_a);
            let e2 = visible_exp(pa[j4 + 2u], new_a);
            let e3 = visible_exp(pa[j4 + 3u], new_a);
            let f0 = visible_exp(pb[j4], new_b);
            let f1 = visible_exp(pb[j4 + 1u], new_b);
            let f2 = visible_exp(pb[j4 + 2u], new_b);
            let f3 = visible_exp(pb[j4 + 3u], new_b);
            pa[j4] = e0;
            pa[j4 + 1u] = e1;
            pa[j4 + 2u] = e2;
            pa[j4 + 3u] = e3;
            pb[j4] = f0;
            pb[j4 + 1u] = f1;
            pb[j4 + 2u] = f2;
            pb[j4 + 3u] = f3;
            sum_a = (((sum_a + e0) + e1) + e2) + e3;
            sum_b = (((sum_b + f0) + f1) + f2) + f3;
            let all_a = all(p_visible(e0) & p_visible(e1) & p_visible(e2) & p_visible(e3));
            let all_b = all(p_visible(f0) & p_visible(f1) & p_visible(f2) & p_visible(f3));
            if quad_all(all_a && all_b) {
                full |= 1u << q4;
            }
        }
        for (var jj = quads * 4u; jj < n_tile; jj++) {
            let e = visible_exp(pa[jj], new_a);
            let f = visible_exp(pb[jj], new_b);
            pa[jj] = e;
            pb[jj] = f;
            sum_a += e;
            sum_b += f;
        }
        la = la * alpha_a + sum_a;
        lb = lb * alpha_b + sum_b;
        ma = new_a;
        mb = new_b;
        for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
            let d = d8 * 8u;
            var xa = scaled(Acc8(acca[d], acca[d + 1u], acca[d + 2u], acca[d + 3u], acca[d + 4u], acca[d + 5u], acca[d + 6u], acca[d + 7u]), alpha_a);
            var xb = scaled(Acc8(accb[d], accb[d + 1u], accb[d + 2u], accb[d + 3u], accb[d + 4u], accb[d + 5u], accb[d + 6u], accb[d + 7u]), alpha_b);
            for (var q4 = 0u; q4 < quads; q4++) {
                let j4 = q4 * 4u;
                let v = vo_quad(j4, d8);
                if ((full >> q4) & 1u) != 0u {
                    xa = pv_full(xa, pa[j4], pa[j4 + 1u], pa[j4 + 2u], pa[j4 + 3u], v);
                    xb = pv_full(xb, pb[j4], pb[j4 + 1u], pb[j4 + 2u], pb[j4 + 3u], v);
                } else {
                    xa = pv_masked(xa, pa[j4], pa[j4 + 1u], pa[j4 + 2u], pa[j4 + 3u], v);
                    xb = pv_masked(xb, pb[j4], pb[j4 + 1u], pb[j4 + 2u], pb[j4 + 3u], v);
                }
            }
            for (var jj = quads * 4u; jj < n_tile; jj++) {
                let va = tile_vo[jj * DV4P + 2u * d8];
                let vb = tile_vo[jj * DV4P + 2u * d8 + 1u];
                xa = pv_one(xa, pa[jj], va, vb);
                xb = pv_one(xb, pb[jj], va, vb);
            }
            acca[d] = xa.a0;
            acca[d + 1u] = xa.a1;
            acca[d + 2u] = xa.a2;
            acca[d + 3u] = xa.a3;
            acca[d + 4u] = xa.a4;
            acca[d + 5u] = xa.a5;
            acca[d + 6u] = xa.a6;
            acca[d + 7u] = xa.a7;
            accb[d] = xb.a0;
            accb[d + 1u] = xb.a1;
            accb[d + 2u] = xb.a2;
            accb[d + 3u] = xb.a3;
            accb[d + 4u] = xb.a4;
            accb[d + 5u] = xb.a5;
            accb[d + 6u] = xb.a6;
            accb[d + 7u] = xb.a7;
        }
    }

    let first_chunk = params.accumulate == 0u;
    for (var g = 0u; g < 2u; g++) {
        let rows = select(rows_a, rows_b, g == 1u);
        let m = select(ma, mb, g == 1u);
        let l = select(la, lb, g == 1u);
        for (var r = 0u; r < 4u; r++) {
            let i = rows[r];
            if i >= params.q_seq {
                continue;
            }
            let base = view_index(VIEW_O, b, i, h);
            let lse_index = (b * params.heads + h) * params.q_seq + i;
            if i >= qlen || l[r] == 0.0 {
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
                var a = acca[d][r];
                if g == 1u {
                    a = accb[d][r];
                }
                var o = a * w_chunk;
                if w_prev > 0.0 {
                    o += o_buf[base + d] * w_prev;
                }
                o_buf[base + d] = o;
            }
            lse_buf[lse_index] = lse;
        }
    }
}
