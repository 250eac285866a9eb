// Attention backward, step 3 (SPEC.md): dQ_i = scale * sum_j dS_ij k_j with
// dS_ij = p_ij (dO_i . v_j - D_i) and p_ij = exp(s_ij - lse_i) recomputed from the saved lse.
// Parallel over query blocks like the forward kernel, so no float atomics and bitwise reproducible.
// Each invocation owns four query rows, one per vec4 lane (q and dO transposed, dQ accumulator in
// registers); K/V tiles are staged. The key loop runs over [chunk_begin, chunk_end); later chunks add
// to dQ.
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
override K_TILE: u32 = BLOCK_N * DK4;
override V_TILE: u32 = BLOCK_N * DV4;
// Buckets of the learned relative table whose gradient this pipeline accumulates (0: none).
override REL_BUCKETS: u32 = 0u;

const MAX_D: u32 = 256u;
const MAX_REL: u32 = 132u;

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> dq_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> rel_rows: array<f32>;

var<workgroup> k_tile: array<vec4<f32>, K_TILE>;
var<workgroup> v_tile: array<vec4<f32>, V_TILE>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    for (var d = 0u; d < DK4 * 4u; d++) {
        qt[d] = vec4<f32>(0.0);
        dq[d] = vec4<f32>(0.0);
    }
    for (var d = 0u; d < DV4 * 4u; d++) {
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
            let jj = t / DK4;
            let c4 = t % DK4;
            var x = vec4<f32>(0.0);
            if jj < n_tile {
                let base = view_index(VIEW_K, b, n0 + jj, h_kv) + c4 * 4u;
                for (var c = 0u; c < 4u; c++) {
                    if c4 * 4u + c < DK {
                        x[c] = k_buf[base + c];
                    }
                }
            }
            k_tile[t] = x;
        }
        for (var t = lid; t < V_TILE; t += WG) {
            let jj = t / DV4;
            let c4 = t % DV4;
            var x = vec4<f32>(0.0);
            if jj < n_tile {
                let base = view_index(VIEW_V, b, n0 + jj, h_kv) + c4 * 4u;
                for (var c = 0u; c < 4u; c++) {
                    if c4 * 4u + c < DV {
                        x[c] = v_buf[base + c];
                    }
                }
            }
            v_tile[t] = x;
        }
        workgroupBarrier();

        // Two keys (a, b = a + 1) per step: every private q, dO and dQ entry is read or updated once
        // for both, halving the private-memory traffic that dominates on CPU drivers. BLOCK_N is even
        // and keys past n_tile are staged as zeros; key b is masked there.
        for (var ja = 0u; ja < n_tile; ja += 2u) {
            let jb = ja + 1u;
            var s_a = vec4<f32>(0.0);
            var s_b = vec4<f32>(0.0);
            for (var d4 = 0u; d4 < DK4; d4++) {
                let ka = k_tile[ja * DK4 + d4];
                let kb = k_tile[jb * DK4 + d4];
                let d = d4 * 4u;
                let q0 = qt[d];
                let q1 = qt[d + 1u];
                let q2 = qt[d + 2u];
                let q3 = qt[d + 3u];
                s_a += q0 * ka.x + q1 * ka.y + q2 * ka.z + q3 * ka.w;
                s_b += q0 * kb.x + q1 * kb.y + q2 * kb.z + q3 * kb.w;
            }
            var dp_a = vec4<f32>(0.0);
            var dp_b = vec4<f32>(0.0);
            for (var d4 = 0u; d4 < DV4; d4++) {
                let va = v_tile[ja * DV4 + d4];
                let vb = v_tile[jb * DV4 + d4];
                let d = d4 * 4u;
                let o0 = dot_t[d];
                let o1 = dot_t[d + 1u];
                let o2 = dot_t[d + 2u];
                let o3 = dot_t[d + 3u];
                dp_a += o0 * va.x + o1 * va.y + o2 * va.z + o3 * va.w;
                dp_b += o0 * vb.x + o1 * vb.y + o2 * vb.z + o3 * vb.w;
            }
            // Masked pairs (and so every pair of a row whose lse is -inf) contribute exactly 0.
            let x_a = modify_scores(s_a, rows, vec4<u32>(n0 + ja), b, h);
            let x_b = modify_scores(s_b, rows, vec4<u32>(n0 + jb), b, h);
            let key_a = visible(n0 + ja, row_start, row_end) & score_visible(x_a);
            let p_a = select(vec4<f32>(0.0), exp(x_a - lse), key_a);
            let key_b = visible(n0 + jb, row_start, row_end) & vec4<bool>(jb < n_tile) & score_visible(x_b);
            let p_b = select(vec4<f32>(0.0), exp(x_b - lse), key_b);
            // Masked pairs contribute exactly 0, whatever their dP or score holds (a NaN in a key
            // or value the row does not see is not the row's).
            let zero = vec4<f32>(0.0);
            let d_score_a = select(zero, p_a * (dp_a - delta), key_a);
            let d_score_b = select(zero, p_b * (dp_b - delta), key_b);
            let ds_a = select(zero, d_score_a * score_grad(s_a), key_a);
            let ds_b = select(zero, d_score_b * score_grad(s_b), key_b);
            if REL_BUCKETS > 0u {
                for (var r = 0u; r < 4u; r++) {
                    let delta_a = i32(n0 + ja) - aligned(rows[r]);
                    let u_a = relative_bucket(delta_a);
                    rel[u_a][r] += d_score_a[r];
                    let u_b = relative_bucket(delta_a + 1);
                    rel[u_b][r] += d_score_b[r];
                }
            }
            if all(key_a & key_b) {
                for (var d4 = 0u; d4 < DK4; d4++) {
                    let ka = k_tile[ja * DK4 + d4];
                    let kb = k_tile[jb * DK4 + d4];
                    let d = d4 * 4u;
                    dq[d] += ds_a * ka.x + ds_b * kb.x;
                    dq[d + 1u] += ds_a * ka.y + ds_b * kb.y;
                    dq[d + 2u] += ds_a * ka.z + ds_b * kb.z;
                    dq[d + 3u] += ds_a * ka.w + ds_b * kb.w;
                }
            } else if any(key_a | key_b) {
                // Rows that mask a key skip its K.
                for (var d4 = 0u; d4 < DK4; d4++) {
                    let ka = k_tile[ja * DK4 + d4];
                    let kb = k_tile[jb * DK4 + d4];
                    let d = d4 * 4u;
                    dq[d] += masked_product(ds_a, ka.x, key_a) + masked_product(ds_b, kb.x, key_b);
                    dq[d + 1u] += masked_product(ds_a, ka.y, key_a) + masked_product(ds_b, kb.y, key_b);
                    dq[d + 2u] += masked_product(ds_a, ka.z, key_a) + masked_product(ds_b, kb.z, key_b);
                    dq[d + 3u] += masked_product(ds_a, ka.w, key_a) + masked_product(ds_b, kb.w, key_b);
                }
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
