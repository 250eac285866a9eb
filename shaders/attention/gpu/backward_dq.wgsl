// Attention backward, dQ, for GPUs (the tiled family; SPEC.md): dQ_i = scale * sum_j dS_ij k_j with
// dS_ij = p_ij (dO_i . v_j - D_i) and p_ij = exp(s_ij - lse_i) recomputed from the saved lse.
// Parallel over query blocks like the forward, so no float atomics and bitwise reproducible.
//
// A workgroup owns BM query rows of one (batch, head): Q (pre-scaled), dO and (lse, D) are staged
// once; it steps over tiles of BN keys (K and V staged). Invocation (tr, tc) owns four query rows
// (vec4 lanes) by SK keys of S and dP (keys tc + TC * c) and the same four rows by OC vec4 columns
// of dQ (columns tc + TC * c); dS passes through workgroup memory between the two products.
// The key loop runs over [chunk_begin, chunk_end); later chunks add to dQ.
//
// With REL_BUCKETS > 0 (learned relative-position buckets) it also writes each query row's
// gradient of the relative table, d_score = p (dP - D) summed per bucket over the row's keys in key
// order: rel_rows [B * Lq, H * REL_BUCKETS], whose column sums (in row order) are the table's
// gradient. The sums live in workgroup memory, each row's added by one invocation after every tile
// (a bucket is known only at run time, and a private array indexed by it is scratch memory on GPUs).

override WG: u32 = 128u;
override BM: u32 = 32u;
override BN: u32 = 32u;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
override TR: u32 = BM / 4u;
override TC: u32 = WG / TR;
override SK: u32 = BN / TC;
override OC: u32 = (DK4 + TC - 1u) / TC;
// Odd row strides (vec4s): invocations reading different rows of one column hit different banks.
override KS: u32 = DK4 | 1u;
override VS: u32 = DV4 | 1u;
override Q_TILE: u32 = BM * KS;
override DO_TILE: u32 = BM * VS;
override K_TILE: u32 = BN * KS;
override V_TILE: u32 = BN * VS;
override DS_TILE: u32 = BN * TR;
// Buckets of the learned relative table whose gradient this pipeline accumulates (0: none), and the
// workgroup memory that takes: each row's bucket sums, the tile's d_score (one element without).
override REL_BUCKETS: u32 = 0u;
override REL_SUMS: u32 = BM * REL_BUCKETS + 1u;
override REL_DS_TILE: u32 = min(REL_BUCKETS, 1u) * (DS_TILE - 1u) + 1u;

// The per-invocation arrays' sizes, declared by the pipeline's key (private arrays need constant
// lengths; src/kernels/attention/variant.rs): MAX_SK, MAX_OC: SK and OC.

// InElem / OutElem: the element types of the inputs and outputs (f32, or f16 with SHADER_F16),
// aliased by the host before the common header; arithmetic is f32. Q, K, V and dO (bindings 2-5)
// and their row reads (q_row4, k_row4, v_row4, do_row4) come from attention/input_rows.wgsl or its
// vec4 build, appended by the host.
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> dq_buf: array<OutElem>;
@group(0) @binding(8) var<storage, read_write> rel_rows: array<f32>;

var<workgroup> q_tile: array<vec4<f32>, Q_TILE>;
var<workgroup> do_tile: array<vec4<f32>, DO_TILE>;
var<workgroup> k_tile: array<vec4<f32>, K_TILE>;
var<workgroup> v_tile: array<vec4<f32>, V_TILE>;
// dS of the tile: [key * TR + tr] = the four rows of row group tr.
var<workgroup> ds_tile: array<vec4<f32>, DS_TILE>;
// Relative buckets: row r's sum for bucket u at r * REL_BUCKETS + u, and the tile's d_score laid out
// as ds_tile.
var<workgroup> rel_sums: array<f32, REL_SUMS>;
var<workgroup> rel_ds_tile: array<vec4<f32>, REL_DS_TILE>;

// dS K's operand (attention/gpu/key_products.wgsl): K, staged in k_tile.
override PRODUCT_D4: u32 = DK4;

fn product_row(jj: u32, d4: u32) -> vec4<f32> {
    return k_tile[jj * KS + d4];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    // Longest rows first under the causal mask: the last query block is the heaviest.
    let q_block = params.blocks - 1u - group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let h_kv = h / (params.heads / params.kv_heads);
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let row0 = q_block * BM;
    let tr = lid / TC;
    let tc = lid % TC;
    let rows = vec4<u32>(row0 + tr * 4u) + vec4<u32>(0u, 1u, 2u, 3u);

    // Keys [row_start, row_end) are visible to each row; none for padded rows. Rows that see no key
    // have lse = -inf: keep 0 there, every one of their pairs is masked.
    var row_start = vec4<u32>(0u);
    var row_end = vec4<u32>(0u);
    var lse = vec4<f32>(0.0);
    var delta = vec4<f32>(0.0);
    for (var r = 0u; r < 4u; r++) {
        if rows[r] < qlen {
            row_start[r] = key_start(rows[r]);
            row_end[r] = key_end(rows[r], kvlen);
            if row_end[r] > row_start[r] {
                let st = stats[(b * params.heads + h) * params.q_seq + rows[r]];
                lse[r] = st.x;
                delta[r] = st.y;
            }
        }
    }
    for (var t = lid; t < BM * DK4; t += WG) {
        let ii = t / DK4;
        let d4 = t % DK4;
        let i = row0 + ii;
        var x = vec4<f32>(0.0);
        if i < qlen {
            x = q_row4(view_index(VIEW_Q, b, i, h) + 4u * d4, DK - 4u * d4) * params.scale;
        }
        q_tile[ii * KS + d4] = x;
    }
    for (var t = lid; t < BM * DV4; t += WG) {
        let ii = t / DV4;
        let d4 = t % DV4;
        let i = row0 + ii;
        var x = vec4<f32>(0.0);
        if i < qlen {
            x = do_row4(view_index(VIEW_DO, b, i, h) + 4u * d4, DV - 4u * d4);
        }
        do_tile[ii * VS + d4] = x;
    }

    // The dQ accumulator, acc (attention/gpu/key_products.wgsl): row r, dQ columns
    // 4 * (tc + TC * c) .. + 3 at acc[r * MAX_OC + c].
    for (var c = 0u; c < 4u * OC; c++) {
        acc[c] = vec4<f32>(0.0);
    }
    // Ordered before their first use by the key loop's barriers.
    for (var t = lid; t < BM * REL_BUCKETS; t += WG) {
        rel_sums[t] = 0.0;
    }

    // Keys visible to any row of the block, within this dispatch's chunk.
    let keys = query_block_keys(aligned(0u), row0, BM, qlen, kvlen);
    let n_end = min(keys.y, params.chunk_end);
    for (var n0 = max(params.chunk_begin, keys.x); n0 < n_end; n0 += BN) {
        workgroupBarrier();
        for (var t = lid; t < BN * DK4; t += WG) {
            let jj = t / DK4;
            let d4 = t % DK4;
            let j = n0 + jj;
            var x = vec4<f32>(0.0);
            if j < n_end {
                x = k_row4(view_index(VIEW_K, b, j, h_kv) + 4u * d4, DK - 4u * d4);
            }
            k_tile[jj * KS + d4] = x;
        }
        for (var t = lid; t < BN * DV4; t += WG) {
            let jj = t / DV4;
            let d4 = t % DV4;
            let j = n0 + jj;
            var x = vec4<f32>(0.0);
            if j < n_end {
                x = v_row4(view_index(VIEW_V, b, j, h_kv) + 4u * d4, DV - 4u * d4);
            }
            v_tile[jj * VS + d4] = x;
        }
        workgroupBarrier();

        var s: array<vec4<f32>, MAX_SK>;
        var dp: array<vec4<f32>, MAX_SK>;
        for (var c = 0u; c < SK; c++) {
            s[c] = vec4<f32>(0.0);
            dp[c] = vec4<f32>(0.0);
        }
        let q_row = tr * 4u * KS;
        for (var d4 = 0u; d4 < DK4; d4++) {
            let q0 = q_tile[q_row + d4];
            let q1 = q_tile[q_row + KS + d4];
            let q2 = q_tile[q_row + 2u * KS + d4];
            let q3 = q_tile[q_row + 3u * KS + d4];
            for (var c = 0u; c < SK; c++) {
                let kx = k_tile[(tc + TC * c) * KS + d4];
                s[c] += vec4<f32>(dot(q0, kx), dot(q1, kx), dot(q2, kx), dot(q3, kx));
            }
        }
        let o_row = tr * 4u * VS;
        for (var d4 = 0u; d4 < DV4; d4++) {
            let o0 = do_tile[o_row + d4];
            let o1 = do_tile[o_row + VS + d4];
            let o2 = do_tile[o_row + 2u * VS + d4];
            let o3 = do_tile[o_row + 3u * VS + d4];
            for (var c = 0u; c < SK; c++) {
                let vx = v_tile[(tc + TC * c) * VS + d4];
                dp[c] += vec4<f32>(dot(o0, vx), dot(o1, vx), dot(o2, vx), dot(o3, vx));
            }
        }
        for (var c = 0u; c < SK; c++) {
            let j = n0 + tc + TC * c;
            let x = modify_scores(s[c], rows, vec4<u32>(j), b, h);
            // Keys past this dispatch's chunk are staged as zeros; they count in a later chunk.
            let seen = visible(j, row_start, row_end) & score_visible(x) & vec4<bool>(j < n_end);
            let p = select(vec4<f32>(0.0), exp(x - lse), seen);
            // Masked pairs: 0 for the relative table, masked_p in ds_tile so the dQ product
            // skips their K (a NaN in a key the row does not see is not the row's).
            let d_score = select(vec4<f32>(0.0), p * (dp[c] - delta), seen);
            ds_tile[(tc + TC * c) * TR + tr] =
                select(vec4<f32>(masked_p()), d_score * score_grad(s[c]), seen);
            if REL_BUCKETS > 0u {
                rel_ds_tile[(tc + TC * c) * TR + tr] = d_score;
            }
        }
        workgroupBarrier();
        if REL_BUCKETS > 0u {
            // Each row's keys in order, added by the invocation that owns the row's sums (masked
            // pairs and keys past the chunk have d_score 0).
            for (var r = lid; r < BM; r += WG) {
                let p = aligned(row0 + r);
                for (var jj = 0u; jj < BN; jj++) {
                    let u = relative_bucket(i32(n0 + jj) - p);
                    rel_sums[r * REL_BUCKETS + u] += rel_ds_tile[jj * TR + r / 4u][r % 4u];
                }
            }
        }

        for (var jj = 0u; jj < BN; jj++) {
            add_key_products(ds_tile[jj * TR + tr], jj, tc);
        }
    }

    let accumulate = params.accumulate != 0u;
    // Relative-table rows: each row's bucket sums, added to an earlier chunk's.
    workgroupBarrier();
    // (Never divided by zero: without buckets the loop is empty, but the divisor must be valid.)
    let buckets = max(REL_BUCKETS, 1u);
    for (var t = lid; t < BM * REL_BUCKETS; t += WG) {
        let i = row0 + t / buckets;
        if i < params.q_seq {
            let index = ((b * params.q_seq + i) * params.heads + h) * REL_BUCKETS + t % buckets;
            var x = rel_sums[t];
            if accumulate {
                x += rel_rows[index];
            }
            rel_rows[index] = x;
        }
    }
    for (var r = 0u; r < 4u; r++) {
        let i = rows[r];
        if !row_stored(VIEW_DQ, b, i) {
            continue;
        }
        let base = view_index(VIEW_DQ, b, i, h);
        for (var c = 0u; c < OC; c++) {
            let d4 = tc + TC * c;
            let g = acc[r * MAX_OC + c] * params.scale;
            for (var e = 0u; e < 4u; e++) {
                let d = d4 * 4u + e;
                if d < DK {
                    var x = g[e];
                    if accumulate {
                        x += f32(dq_buf[base + d]);
                    }
                    dq_buf[base + d] = OutElem(x);
                }
            }
        }
    }
}
