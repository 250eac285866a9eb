// Attention backward, step 3 (SPEC.md): dQ_i = scale * sum_j dS_ij k_j with
// dS_ij = p_ij (dO_i . v_j - D_i) and p_ij = exp(s_ij - lse_i) recomputed from the saved lse.
// Parallel over query blocks like the forward kernel, so no float atomics and bitwise reproducible.
// Each invocation owns four query rows, one per vec4 lane (q and dO transposed, dQ accumulator in
// registers); K/V tiles are staged and read a quad (four keys by eight dims, attention/cpu/quads.wgsl) at
// a time. The key loop runs over [chunk_begin, chunk_end); later chunks add to dQ.
//
// With REL_BUCKETS > 0 (learned relative-position buckets) it also writes each query row's
// gradient of the relative table, d_score = p (dP - D) summed per bucket over the row's keys in
// order: rel_rows [B * Lq, H * REL_BUCKETS], whose column sums (in row order) are the table's
// gradient.

override WG: u32 = 64u;
override BLOCK_N: u32 = 32u;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
// Staged row strides in vec4s: whole quads (eight dims), the padding zero.
override DK4P: u32 = DK4 + (DK4 & 1u);
override DV4P: u32 = DV4 + (DV4 & 1u);
override K_TILE: u32 = BLOCK_N * DK4P;
override V_TILE: u32 = BLOCK_N * DV4P;
// Buckets of the learned relative table whose gradient this pipeline accumulates (0: none).
override REL_BUCKETS: u32 = 0u;

// The per-invocation arrays' sizes, declared by the pipeline's key (private arrays need constant
// lengths; src/kernels/attention/variant.rs): MAX_D: the head dims rounded up to whole quads;
// MAX_REL: REL_BUCKETS, at least 1.

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> dq_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> rel_rows: array<f32>;

// K and V.
var<workgroup> tile_qk: array<vec4<f32>, K_TILE>;
var<workgroup> tile_vo: array<vec4<f32>, V_TILE>;

// One key's share of the four rows' gradients: which rows see it, their score gradient d_score =
// p (dP - D) (the relative table's) and ds = d_score times the modifier's derivative (dQ's).
struct KeyGrad {
    seen: vec4<bool>,
    d_score: vec4<f32>,
    ds: vec4<f32>,
}

fn key_grad(
    s: vec4<f32>,
    dp: vec4<f32>,
    rows: vec4<u32>,
    j: u32,
    in_tile: bool,
    b: u32,
    h: u32,
    lse: vec4<f32>,
    delta: vec4<f32>,
    row_start: vec4<u32>,
    row_end: vec4<u32>,
) -> KeyGrad {
    let x = modify_scores(s, rows, vec4<u32>(j), b, h);
    let seen = visible(j, row_start, row_end) & vec4<bool>(in_tile) & score_visible(x);
    let zero = vec4<f32>(0.0);
    let p = select(zero, exp(x - lse), seen);
    let d_score = select(zero, p * (dp - delta), seen);
    return KeyGrad(seen, d_score, select(zero, d_score * score_grad(s), seen));
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
    let row0 = q_block * WG * 4u;
    let rows = vec4<u32>(row0 + lid) + vec4<u32>(0u, 1u, 2u, 3u) * WG;

    var qt: array<vec4<f32>, MAX_D>;
    var dot_t: array<vec4<f32>, MAX_D>;
    var dq: array<vec4<f32>, MAX_D>;
    // Rows that see no key keep lse = 0 here: every one of their pairs is masked and contributes 0.
    var lse = vec4<f32>(0.0);
    var delta = vec4<f32>(0.0);
    var row_start = vec4<u32>(0u);
    var row_end = vec4<u32>(0u);
    for (var d = 0u; d < DK4P * 4u; d++) {
        qt[d] = vec4<f32>(0.0);
        dq[d] = vec4<f32>(0.0);
    }
    for (var d = 0u; d < DV4P * 4u; d++) {
        dot_t[d] = vec4<f32>(0.0);
    }
    // Per bucket, the four rows' relative-table gradient.
    var rel: array<vec4<f32>, MAX_REL>;
    for (var u = 0u; u < REL_BUCKETS; u++) {
        rel[u] = vec4<f32>(0.0);
    }
    for (var r = 0u; r < 4u; r++) {
        let i = rows[r];
        if i < qlen {
            row_start[r] = key_start(i);
            row_end[r] = key_end(i, kvlen);
            if row_end[r] > row_start[r] {
                let st = stats[(b * params.heads + h) * params.q_seq + i];
                lse[r] = st.x;
                delta[r] = st.y;
            }
            let q_base = view_index(VIEW_Q, b, i, h);
            for (var d = 0u; d < DK; d++) {
                qt[d][r] = q_buf[q_base + d] * params.scale;
            }
            let do_base = view_index(VIEW_DO, b, i, h);
            for (var d = 0u; d < DV; d++) {
                dot_t[d][r] = do_buf[do_base + d];
            }
        }
    }

    let rows_hi = min(row0 + WG * 4u, qlen);
    var kv_hi = 0u;
    if rows_hi > row0 {
        kv_hi = key_end(rows_hi - 1u, kvlen);
    }
    let n_end = min(kv_hi, params.chunk_end);
    let n_begin = max(params.chunk_begin, key_start(row0));

    for (var n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        let n_tile = min(BLOCK_N, n_end - n0);
        workgroupBarrier();
        for (var t = lid; t < K_TILE; t += WG) {
            let jj = t / DK4P;
            let c4 = t % DK4P;
            var x = vec4<f32>(0.0);
            if jj < n_tile {
                let base = view_index(VIEW_K, b, n0 + jj, h_kv) + c4 * 4u;
                for (var c = 0u; c < 4u; c++) {
                    if c4 * 4u + c < DK {
                        x[c] = k_buf[base + c];
                    }
                }
            }
            tile_qk[t] = x;
        }
        for (var t = lid; t < V_TILE; t += WG) {
            let jj = t / DV4P;
            let c4 = t % DV4P;
            var x = vec4<f32>(0.0);
            if jj < n_tile {
                let base = view_index(VIEW_V, b, n0 + jj, h_kv) + c4 * 4u;
                for (var c = 0u; c < 4u; c++) {
                    if c4 * 4u + c < DV {
                        x[c] = v_buf[base + c];
                    }
                }
            }
            tile_vo[t] = x;
        }
        workgroupBarrier();

        // A quad of keys (j0 .. j0 + 3) per step: every private q, dO and dQ entry is read or
        // updated once for the four, the private-memory traffic that dominates on CPU drivers.
        // BLOCK_N is a multiple of 4 and keys past n_tile are staged as zeros and masked.
        for (var j0 = 0u; j0 < n_tile; j0 += 4u) {
            var s0 = vec4<f32>(0.0);
            var s1 = vec4<f32>(0.0);
            var s2 = vec4<f32>(0.0);
            var s3 = vec4<f32>(0.0);
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let k = qk_quad(j0, d8);
                let d = d8 * 8u;
                let q0 = qt[d];
                let q1 = qt[d + 1u];
                let q2 = qt[d + 2u];
                let q3 = qt[d + 3u];
                let q4 = qt[d + 4u];
                let q5 = qt[d + 5u];
                let q6 = qt[d + 6u];
                let q7 = qt[d + 7u];
                s0 = quad_row_dot(s0, q0, q1, q2, q3, q4, q5, q6, q7, k.a0, k.b0);
                s1 = quad_row_dot(s1, q0, q1, q2, q3, q4, q5, q6, q7, k.a1, k.b1);
                s2 = quad_row_dot(s2, q0, q1, q2, q3, q4, q5, q6, q7, k.a2, k.b2);
                s3 = quad_row_dot(s3, q0, q1, q2, q3, q4, q5, q6, q7, k.a3, k.b3);
            }
            var dp0 = vec4<f32>(0.0);
            var dp1 = vec4<f32>(0.0);
            var dp2 = vec4<f32>(0.0);
            var dp3 = vec4<f32>(0.0);
            for (var d8 = 0u; d8 < DV4P / 2u; d8++) {
                let v = vo_quad(j0, d8);
                let d = d8 * 8u;
                let o0 = dot_t[d];
                let o1 = dot_t[d + 1u];
                let o2 = dot_t[d + 2u];
                let o3 = dot_t[d + 3u];
                let o4 = dot_t[d + 4u];
                let o5 = dot_t[d + 5u];
                let o6 = dot_t[d + 6u];
                let o7 = dot_t[d + 7u];
                dp0 = quad_row_dot(dp0, o0, o1, o2, o3, o4, o5, o6, o7, v.a0, v.b0);
                dp1 = quad_row_dot(dp1, o0, o1, o2, o3, o4, o5, o6, o7, v.a1, v.b1);
                dp2 = quad_row_dot(dp2, o0, o1, o2, o3, o4, o5, o6, o7, v.a2, v.b2);
                dp3 = quad_row_dot(dp3, o0, o1, o2, o3, o4, o5, o6, o7, v.a3, v.b3);
            }
            // Masked pairs (and so every pair of a row whose lse is -inf) contribute exactly 0,
            // whatever their dP or score holds (a NaN in a key or value the row does not see is
            // not the row's).
            let g0 = key_grad(s0, dp0, rows, n0 + j0, j0 < n_tile, b, h, lse, delta, row_start, row_end);
            let g1 = key_grad(s1, dp1, rows, n0 + j0 + 1u, j0 + 1u < n_tile, b, h, lse, delta, row_start, row_end);
            let g2 = key_grad(s2, dp2, rows, n0 + j0 + 2u, j0 + 2u < n_tile, b, h, lse, delta, row_start, row_end);
            let g3 = key_grad(s3, dp3, rows, n0 + j0 + 3u, j0 + 3u < n_tile, b, h, lse, delta, row_start, row_end);
            if REL_BUCKETS > 0u {
                for (var r = 0u; r < 4u; r++) {
                    let delta0 = i32(n0 + j0) - aligned(rows[r]);
                    rel[relative_bucket(delta0)][r] += g0.d_score[r];
                    rel[relative_bucket(delta0 + 1)][r] += g1.d_score[r];
                    rel[relative_bucket(delta0 + 2)][r] += g2.d_score[r];
                    rel[relative_bucket(delta0 + 3)][r] += g3.d_score[r];
                }
            }
            let ds0 = g0.ds;
            let ds1 = g1.ds;
            let ds2 = g2.ds;
            let ds3 = g3.ds;
            let key0 = g0.seen;
            let key1 = g1.seen;
            let key2 = g2.seen;
            let key3 = g3.seen;
            // Rows that mask a key skip its K (masked products throughout: see the dK/dV kernel).
            for (var d8 = 0u; d8 < DK4P / 2u; d8++) {
                let k = qk_quad(j0, d8);
                let d = d8 * 8u;
                dq[d] += masked_products4(ds0, ds1, ds2, ds3, k.a0.x, k.a1.x, k.a2.x, k.a3.x, key0, key1, key2, key3);
                dq[d + 1u] += masked_products4(ds0, ds1, ds2, ds3, k.a0.y, k.a1.y, k.a2.y, k.a3.y, key0, key1, key2, key3);
                dq[d + 2u] += masked_products4(ds0, ds1, ds2, ds3, k.a0.z, k.a1.z, k.a2.z, k.a3.z, key0, key1, key2, key3);
                dq[d + 3u] += masked_products4(ds0, ds1, ds2, ds3, k.a0.w, k.a1.w, k.a2.w, k.a3.w, key0, key1, key2, key3);
                dq[d + 4u] += masked_products4(ds0, ds1, ds2, ds3, k.b0.x, k.b1.x, k.b2.x, k.b3.x, key0, key1, key2, key3);
                dq[d + 5u] += masked_products4(ds0, ds1, ds2, ds3, k.b0.y, k.b1.y, k.b2.y, k.b3.y, key0, key1, key2, key3);
                dq[d + 6u] += masked_products4(ds0, ds1, ds2, ds3, k.b0.z, k.b1.z, k.b2.z, k.b3.z, key0, key1, key2, key3);
                dq[d + 7u] += masked_products4(ds0, ds1, ds2, ds3, k.b0.w, k.b1.w, k.b2.w, k.b3.w, key0, key1, key2, key3);
            }
        }
    }

    for (var r = 0u; r < 4u; r++) {
        let i = rows[r];
        if i >= params.q_seq {
            continue;
        }
        let rel_base = ((b * params.q_seq + i) * params.heads + h) * REL_BUCKETS;
        for (var u = 0u; u < REL_BUCKETS; u++) {
            var x = rel[u][r];
            if params.accumulate != 0u {
                x += rel_rows[rel_base + u];
            }
            rel_rows[rel_base + u] = x;
        }
        if !row_stored(VIEW_DQ, b, i) {
            continue;
        }
        let base = view_index(VIEW_DQ, b, i, h);
        for (var d = 0u; d < DK; d++) {
            var g = dq[d][r] * params.scale;
            if params.accumulate != 0u {
                g += dq_buf[base + d];
            }
            dq_buf[base + d] = g;
        }
    }
}
