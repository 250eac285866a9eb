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

// Q, dO, K and V staged in attention/gpu/backward_tiles.wgsl.
// dS of the tile: [key * TR + tr] = the four rows of row group tr.
var<workgroup> ds_tile: array<vec4<f32>, DS_TILE>;
// Relative buckets: row r's sum for bucket u at r * REL_BUCKETS + u, and the tile's d_score laid out
// as ds_tile.
var<workgroup> rel_sums: array<f32, REL_SUMS>;
var<workgroup> rel_ds_tile: array<vec4<f32>, REL_DS_TILE>;

// The micro-tiles' columns (attention/gpu/tiles.wgsl), and dS K's operand
// (attention/gpu/key_products.wgsl).
const MAX_DOTS: u32 = MAX_SK;
const PRODUCT_VIEW: u32 = VIEW_K;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    let owned = query_block(group);
    let q_block = owned.block;
    let b = owned.b;
    let h = owned.h;
    let h_kv = owned.h_kv;
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
    stage_rows(lid, VIEW_Q, b, h, row0, qlen, params.scale);
    stage_rows(lid, VIEW_DO, b, h, row0, qlen, 1.0);

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
        stage_rows(lid, VIEW_K, b, h_kv, n0, n_end, 1.0);
        stage_rows(lid, VIEW_V, b, h_kv, n0, n_end, 1.0);
        workgroupBarrier();

        var s = tile_dots(VIEW_Q, tr, VIEW_K, tc, TC, SK);
        var dp = tile_dots(VIEW_DO, tr, VIEW_V, tc, TC, SK);
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
