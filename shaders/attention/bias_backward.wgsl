// Gradient of an additive score bias (SPEC.md: dBias_ij = dS_ij, reduced over the broadcast
// dimensions), for both kernel families: d_score = p (dP - D) with p = exp(score - lse) and
// dP = dO_i . v_j, recomputed from Q, K, V, dO and the backward's (lse, D) stats. Writes d_bias
// [bias_batch, bias_heads, Lq, Lk], each element summed over the (batch, query head) members its
// bias element serves, batch-major then head: a fixed order.
//
// A workgroup owns BM = 32 query rows of one slice (a (bias batch, bias head) pair) and the key
// tiles of its split; invocation (tr, tc) owns four rows (vec4 lanes) by four keys tc + 8 c. Head
// dims are staged 32 at a time. Members [chunk_begin, chunk_end) run in this dispatch; later
// dispatches add to what earlier ones wrote (drivers that cap loop iterations). Deterministic: no
// atomics. Every element is written, zeros where masked.

override WG: u32 = 64u;
const BM: u32 = 32u;
const BN: u32 = 32u;
// Head-dim vec4s staged per step.
const DC4: u32 = 8u;

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> d_bias: array<f32>;

// Staged rows of Q then dO (a_tile) and K then V (b_tile), DC4 vec4s each.
var<workgroup> a_tile: array<vec4<f32>, BM * DC4>;
var<workgroup> b_tile: array<vec4<f32>, BN * DC4>;

// Stages rows [r0, r0 + 32) x dims [4 c0, 4 c0 + 4 DC4) of `view` (query or key rows) into a_tile
// (which = 0) or b_tile (which = 1); rows past `rows_end` and dims past `dim` are zeros.
fn stage(which: u32, view: u32, b: u32, h: u32, r0: u32, rows_end: u32, c0: u32, dim: u32, lid: u32) {
    for (var t = lid; t < BM * DC4; t += WG) {
        let r = t / DC4;
        let c4 = t % DC4;
        var x = vec4<f32>(0.0);
        if r0 + r < rows_end {
            let base = view_index(view, b, r0 + r, h) + (c0 + c4) * 4u;
            for (var e = 0u; e < 4u; e++) {
                if (c0 + c4) * 4u + e < dim {
                    x[e] = read_view(view, base + e);
                }
            }
        }
        if which == 0u {
            a_tile[t] = x;
        } else {
            b_tile[t] = x;
        }
    }
}

fn read_view(view: u32, index: u32) -> f32 {
    switch view {
        case 0u: { return q_buf[index]; }
        case 1u: { return k_buf[index]; }
        case 2u: { return v_buf[index]; }
        default: { return do_buf[index]; }
    }
}

// The products of rows [row0, row0 + 32) of `rows_view` (query head h) with keys [n0, n0 + 32) of
// `keys_view` (kv head h_kv) over head dim `dim`, staged 32 dims at a time; this invocation's four
// rows by four keys are added to acc. Called in uniform control flow (it has barriers).
fn products(acc: ptr<function, array<vec4<f32>, 4>>, rows_view: u32, keys_view: u32, dim: u32, b: u32, h: u32, h_kv: u32, row0: u32, n0: u32, lid: u32) {
    for (var c0 = 0u; c0 < (dim + 3u) / 4u; c0 += DC4) {
        workgroupBarrier();
        stage(0u, rows_view, b, h, row0, params.q_seq, c0, dim, lid);
        stage(1u, keys_view, b, h_kv, n0, params.kv_seq, c0, dim, lid);
        workgroupBarrier();
        tile_products(acc, lid / 8u, lid % 8u);
    }
}

// Four rows (vec4 lanes) times four keys of a_tile . b_tile over the staged dims, added to acc.
fn tile_products(acc: ptr<function, array<vec4<f32>, 4>>, tr: u32, tc: u32) {
    for (var d4 = 0u; d4 < DC4; d4++) {
        let a0 = a_tile[(tr * 4u) * DC4 + d4];
        let a1 = a_tile[(tr * 4u + 1u) * DC4 + d4];
        let a2 = a_tile[(tr * 4u + 2u) * DC4 + d4];
        let a3 = a_tile[(tr * 4u + 3u) * DC4 + d4];
        for (var c = 0u; c < 4u; c++) {
            let bx = b_tile[(tc + 8u * c) * DC4 + d4];
            (*acc)[c] += vec4<f32>(dot(a0, bx), dot(a1, bx), dot(a2, bx), dot(a3, bx));
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    // group = (slice * blocks + row block) * splits + split.
    let split = group % params.splits;
    let row_block = (group / params.splits) % params.blocks;
    let slice = group / (params.splits * params.blocks);
    let slice_b = slice / params.bias_heads;
    let slice_h = slice % params.bias_heads;
    // Members: every batch (and every head) a broadcast bias dimension stands for.
    let members_b = select(1u, params.batch, params.bias_batch == 1u);
    let members_h = select(1u, params.heads, params.bias_heads == 1u);
    let group_size = params.heads / params.kv_heads;
    let tr = lid / 8u;
    let tc = lid % 8u;
    let row0 = row_block * BM;
    let rows = vec4<u32>(row0 + tr * 4u) + vec4<u32>(0u, 1u, 2u, 3u);

    // This split's key tiles, within the keys any row of the block can see (before lengths).
    let rows_hi = min(row0 + BM, params.q_seq);
    let kv_hi = key_end(rows_hi - 1u, params.kv_seq);
    let n_tiles = (params.kv_seq + BN - 1u) / BN;
    let per_split = (n_tiles + params.splits - 1u) / params.splits;
    let tile_begin = min(split * per_split, n_tiles);
    let tile_end = min(tile_begin + per_split, n_tiles);
    let first_live = key_start(row0) / BN;
    let live_end = (kv_hi + BN - 1u) / BN;

    let accumulate = params.accumulate != 0u;

    for (var tile = tile_begin; tile < tile_end; tile++) {
        let n0 = tile * BN;
        let keys = vec4<u32>(n0 + tc) + vec4<u32>(0u, 8u, 16u, 24u);
        var acc: array<vec4<f32>, 4>;
        for (var c = 0u; c < 4u; c++) {
            acc[c] = vec4<f32>(0.0);
        }
        // Uniform across the workgroup: tiles no row of the block sees have d_score = 0.
        let live = tile >= first_live && tile < live_end;
        for (var m = params.chunk_begin; m < params.chunk_end && live; m++) {
            let b = select(slice_b, m / members_h, members_b > 1u);
            let h = select(slice_h, m % members_h, members_h > 1u);
            let h_kv = h / group_size;
            let qlen = q_len(b);
            let kvlen = kv_len(b);
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
                        lse[r] = select(0.0, st.x, not_masked(st.x));
                        delta[r] = st.y;
                    }
                }
            }
            var s: array<vec4<f32>, 4>;
            var dp: array<vec4<f32>, 4>;
            for (var c = 0u; c < 4u; c++) {
                s[c] = vec4<f32>(0.0);
                dp[c] = vec4<f32>(0.0);
            }
            // S = Q K^T and dP = dO V^T of the tile.
            products(&s, VIEW_Q, VIEW_K, params.dk, b, h, h_kv, row0, n0, lid);
            products(&dp, VIEW_DO, VIEW_V, params.dv, b, h, h_kv, row0, n0, lid);
            for (var c = 0u; c < 4u; c++) {
                let j = keys[c];
                let x = modify_scores(params.scale * s[c], rows, vec4<u32>(j), b, h);
                let seen = visible(j, row_start, row_end) & score_visible(x);
                let p = select(vec4<f32>(0.0), exp(x - lse), seen);
                // Masked pairs add exactly 0, whatever their dP holds.
                acc[c] += select(vec4<f32>(0.0), p * (dp[c] - delta), seen);
            }
        }

        // Every element of the tile is written (zeros where masked, or where no row sees the tile).
        if !live && accumulate {
            continue;
        }
        let base = slice * params.q_seq;
        for (var c = 0u; c < 4u; c++) {
            let j = keys[c];
            for (var r = 0u; r < 4u; r++) {
                let i = rows[r];
                if i < params.q_seq && j < params.kv_seq {
                    let index = (base + i) * params.kv_seq + j;
                    var g = acc[c][r];
                    if accumulate {
                        g += d_bias[index];
                    }
                    d_bias[index] = g;
                }
            }
        }
    }
}
