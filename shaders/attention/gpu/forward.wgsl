// Fused attention forward for GPUs (SPEC.md), FlashAttention-2 style: the "tiled" kernel family.
// O = softmax(scale * Q K^T + masks) V and lse per row, one pass over K/V tiles with an online softmax.
//
// Occupancy first: a workgroup owns BM query rows (16-64) of one (batch, head) and WG invocations
// (64-128). Q is staged once in workgroup memory, then each K tile and V tile in turn through one
// shared staging buffer. Invocation (tr, tc) owns a register micro-tile: four query rows (vec4 lanes)
// by SK keys of S = Q K^T (keys tc + TC * c), and the same four rows by OC vec4 columns of O
// (columns tc + TC * c). The TC invocations that share a row group agree on the running row max
// each tile (row_group_max: subgroup shuffles where the adapter has a fixed subgroup size,
// attention/gpu/row_max_subgroup.wgsl, else workgroup memory, attention/gpu/row_max_workgroup.wgsl; the host
// appends one); each keeps its own partial row sum, added in a fixed order through workgroup memory at
// the end. No per-invocation array is head-dim sized.
//
// Split-KV: the grid may split each block's key range over `splits` workgroups; each writes its
// normalised partial O and lse (batch index split * B + b of the bound outputs), and
// attention/forward_merge.wgsl combines them in split order. With one split the outputs are O and lse.
// Causal: each block's key range ends at the last key its last row sees (masks are monotone in the
// row), so blocks above the diagonal are never loaded, and the blocks with the longest rows are
// scheduled first.

override WG: u32 = 128u;
override BM: u32 = 64u;
override BN: u32 = 32u;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
// Row groups of four query rows, invocations per row group, keys and O columns per invocation.
override TR: u32 = BM / 4u;
override TC: u32 = WG / TR;
override SK: u32 = BN / TC;
override OC: u32 = (DV4 + TC - 1u) / TC;
// Row strides of the staged tiles in vec4s; odd, so the TC invocations reading different keys of one
// d4 column hit different banks.
override QS: u32 = DK4 | 1u;
override KVS: u32 = max(QS, DV4);
override Q_TILE: u32 = BM * QS;
override KV_TILE: u32 = BN * KVS;
override P_TILE: u32 = BN * TR;

// The per-invocation arrays' sizes, declared by the pipeline's key (private arrays need constant
// lengths; src/kernels/attention/variant.rs): MAX_SK, MAX_OC: SK and OC.

// InElem / OutElem: the element types of the inputs and outputs (f32, or f16 with SHADER_F16),
// aliased by the host before the common header; arithmetic is f32.
// OutElem is f32 when O is a split-KV partial result. Q, K and V (bindings 2-4) and their row reads
// (q_row4, k_row4, v_row4) come from attention/input_rows.wgsl or its vec4 build, appended by the
// host.
@group(0) @binding(5) var<storage, read_write> o_buf: array<OutElem>;
@group(0) @binding(6) var<storage, read_write> lse_buf: array<f32>;

var<workgroup> q_tile: array<vec4<f32>, Q_TILE>;
var<workgroup> kv_tile: array<vec4<f32>, KV_TILE>;
// P of the tile, p_tile[key * TR + tr] = the four rows of row group tr.
var<workgroup> p_tile: array<vec4<f32>, P_TILE>;
// Per-invocation partial row maxima (each tile) and row sums (at the end), red[tc * TR + tr].
var<workgroup> red: array<vec4<f32>, WG>;

// The staged views (attention/gpu/tiles.wgsl): Q in q_tile, K and then V in kv_tile.
const MAX_DOTS: u32 = MAX_SK;

fn staged_stride(view: u32) -> u32 {
    return select(KVS, QS, view == VIEW_Q);
}

fn staged_at(view: u32, index: u32) -> vec4<f32> {
    if view == VIEW_Q {
        return q_tile[index];
    }
    return kv_tile[index];
}

fn store_staged(view: u32, row: u32, d4: u32, x: vec4<f32>) {
    let i = row * staged_stride(view) + d4;
    if view == VIEW_Q {
        q_tile[i] = x;
    } else {
        kv_tile[i] = x;
    }
}

fn input_row4(view: u32, index: u32, count: u32) -> vec4<f32> {
    return qkv_row4(view, index, count);
}

// P V's operand (attention/gpu/key_products.wgsl).
const PRODUCT_VIEW: u32 = VIEW_V;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, ids: Lanes) {
    let lid = ids.index;
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier below in uniform control flow.
    if group >= params.total_groups {
        return;
    }
    let block = forward_block(group);
    let q_block = block.q_block;
    let split = block.split;
    let b = block.b;
    let h = block.h;
    let h_kv = block.h_kv;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    // Row i sits at key position i + shift (see row_shift).
    let shift = row_shift(b);
    let row0 = q_block * BM;
    // Row groups never straddle a subgroup where the subgroup path is compiled in.
    let tr = layout_index(ids) / TC;
    let tc = layout_index(ids) % TC;
    let rows = vec4<u32>(row0 + tr * 4u) + vec4<u32>(0u, 1u, 2u, 3u);

    // Keys [row_start, row_end) are visible to each of the four rows; none for padded rows.
    var row_start = vec4<u32>(0u);
    var row_end = vec4<u32>(0u);
    for (var r = 0u; r < 4u; r++) {
        if rows[r] < qlen {
            row_start[r] = keys_start_at(i32(rows[r]) + shift);
            row_end[r] = keys_end_at(i32(rows[r]) + shift, kvlen);
        }
    }

    stage_rows(lid, VIEW_Q, b, h, row0, qlen, params.scale);

    let tiles = split_key_tiles(shift, row0, BM, BN, split, qlen, kvlen);
    let kv_hi = tiles.kv_hi;

    var m = vec4<f32>(NEG_BIG);
    // This invocation's share of the row sums (its SK keys of every tile).
    var l = vec4<f32>(0.0);
    // The O accumulator, acc (attention/gpu/key_products.wgsl): row r, O columns 4 * (tc + TC * c)
    // .. + 3 at acc[r * MAX_OC + c].
    for (var c = 0u; c < 4u * OC; c++) {
        acc[c] = vec4<f32>(0.0);
    }

    for (var tile = tiles.begin; tile < tiles.end; tile++) {
        let n0 = tile * BN;
        workgroupBarrier();
        stage_rows(lid, VIEW_K, b, h_kv, n0, kv_hi, 1.0);
        workgroupBarrier();

        var s = tile_dots(VIEW_Q, tr, VIEW_K, tc, TC, SK);
        // Masked scores are NEG_BIG, only ever a max seed; their p is set to 0 explicitly.
        var tile_max = vec4<f32>(NEG_BIG);
        for (var c = 0u; c < SK; c++) {
            let j = n0 + tc + TC * c;
            s[c] = modify_scores(s[c], rows, vec4<u32>(j), b, h);
            s[c] = select(vec4<f32>(NEG_BIG), s[c], visible(j, row_start, row_end) & score_visible(s[c]));
            tile_max = max(tile_max, s[c]);
        }
        let m_new = max(m, row_group_max(tile_max, tr, tc));
        // Both maxima are finite: alpha is 1 while a row has seen no key, 0 when its first arrives.
        let alpha = exp(m - m_new);
        m = m_new;
        var row_sum = vec4<f32>(0.0);
        for (var c = 0u; c < SK; c++) {
            let j = n0 + tc + TC * c;
            // Masked scores are NEG_BIG exactly, so score_visible tells them apart; their p is
            // masked_p, so the products below skip them.
            let p = visible_exp(s[c], m_new);
            p_tile[(tc + TC * c) * TR + tr] = p;
            row_sum += p;
        }
        l = l * alpha + row_sum;
        for (var c = 0u; c < OC; c++) {
            acc[c] *= alpha.x;
            acc[MAX_OC + c] *= alpha.y;
            acc[2u * MAX_OC + c] *= alpha.z;
            acc[3u * MAX_OC + c] *= alpha.w;
        }
        // Every invocation is past the score loop (row_group_max ends with a barrier), so V may
        // replace K.
        stage_rows(lid, VIEW_V, b, h_kv, n0, kv_hi, 1.0);
        workgroupBarrier();

        for (var jj = 0u; jj < BN; jj++) {
            add_key_products(p_tile[jj * TR + tr], jj, tc);
        }
    }

    // Row sums: the TC partial sums of each row group, added in a fixed order.
    workgroupBarrier();
    red[tc * TR + tr] = l;
    workgroupBarrier();
    var l_row = vec4<f32>(0.0);
    for (var c = 0u; c < TC; c++) {
        l_row += red[c * TR + tr];
    }

    let out_b = split * params.batch + b;
    for (var r = 0u; r < 4u; r++) {
        let i = rows[r];
        if i >= params.q_seq {
            continue;
        }
        // l > 0 iff the row saw a key (its largest term is exp(0) = 1). Otherwise, and for padded
        // rows: O = 0, lse = -inf (SPEC.md).
        let seen = i < qlen && row_seen(l_row)[r];
        let inv_l = select(0.0, 1.0 / l_row[r], seen);
        if tc == 0u {
            let lse_index = (out_b * params.heads + h) * params.q_seq + i;
            lse_buf[lse_index] = select(neg_inf(), m[r] + log(l_row[r]), seen);
        }
        if !row_stored(VIEW_O, out_b, i) {
            continue;
        }
        let base = view_index(VIEW_O, out_b, i, h);
        for (var c = 0u; c < OC; c++) {
            let d4 = tc + TC * c;
            let o = acc[r * MAX_OC + c] * inv_l;
            for (var e = 0u; e < 4u; e++) {
                if d4 * 4u + e < DV {
                    o_buf[base + d4 * 4u + e] = OutElem(o[e]);
                }
            }
        }
    }
}
