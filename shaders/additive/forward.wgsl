// Fused additive (Bahdanau) attention forward (after attention/common.wgsl and additive/common.wgsl):
// scores e_ij from the query and key projections a [B, Lq, H, Da] (VIEW_Q) and b [B, Lk, H, Da]
// (VIEW_K), the online softmax over the visible keys (the shared header's masks: causal, per-batch
// lengths, windows), and O = P V (V [B, Lk, H, Dv], VIEW_V), with the row lse. [Lq, Lk, Da] never
// exists: each tanh is recomputed where it is used. Decoding from a cache (FLAG_ALIGN_LENS,
// additive_decode_into): rows align on each sequence's own lengths (key_start_in / key_end_in).
//
// One invocation per query row, WG rows of one (batch, head) per workgroup; key tiles of TILE keys
// (their b rows and V rows) staged in workgroup memory. Four keys at a time: their scores, a rescale
// of the running max m, sum l and accumulator when they raise m (rarely, once the row's largest
// scores are behind it), then their share of P V. No per-invocation array holds a tile: what an
// invocation keeps is its accumulator (Dv) and, where the host finds room (OWN_IN_WORKGROUP), not
// even its own a + bias row, which then sits in workgroup memory (a wave64 invocation on RDNA3 has
// 128 registers; the row in registers spilled them at Da = Dv = 64). The key loop runs
// over [chunk_begin, chunk_end): a dispatch with accumulate = 1 resumes from the O and lse an earlier
// dispatch wrote (O normalised with lse is the state m = lse, l = 1, acc = O), so llvmpipe's loop
// budget is kept by splitting long key ranges over dispatches.

@group(0) @binding(7) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> lse_buf: array<f32>;

// 1: each invocation's a + bias row in own_tile (row stride OWN_S vec4s, odd: conflict-free), 0: in a
// private array (own_tile is then one element).
override OWN_IN_WORKGROUP: u32 = 0u;
override OWN_S: u32 = DA4 | 1u;
override OWN_TILE: u32 = OWN_IN_WORKGROUP * (WG * OWN_S - 1u) + 1u;
var<workgroup> own_tile: array<vec4<f32>, OWN_TILE>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier below in uniform control flow.
    if group >= params.total_groups {
        return;
    }
    let block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let row0 = block * WG;
    let i = row0 + lid;
    let live = i < qlen;

    // The query's a row plus the bias (read before the key loop's first barrier).
    var own: array<vec4<f32>, MAX_DA4>;
    for (var c4 = 0u; c4 < DA4; c4++) {
        var x = vec4<f32>(0.0);
        if live {
            x = a_plus_bias4(b, i, h, c4);
        }
        if OWN_IN_WORKGROUP != 0u {
            own_tile[lid * OWN_S + c4] = x;
        } else {
            own[c4] = x;
        }
    }
    stage_w(h, lid);
    var start = 0u;
    var end = 0u;
    if live {
        start = key_start_in(b, i);
        end = key_end_in(b, i, kvlen);
    }

    var m = NEG_BIG;
    var l = 0.0;
    var acc: array<f32, MAX_DV>;
    for (var d = 0u; d < DV; d++) {
        acc[d] = 0.0;
    }
    let row = (b * params.heads + h) * params.q_seq + i;
    if params.accumulate != 0u && live {
        let lse = lse_buf[row];
        if not_masked(lse) {
            m = lse;
            l = 1.0;
            for (var d = 0u; d < DV; d++) {
                acc[d] = o_buf[view_index(VIEW_O, b, i, h) + d];
            }
        }
    }

    // The block's keys within this dispatch's chunk: from its first row's window start to its last
    // valid row's end.
    let keys = query_block_keys(row_shift(b), row0, WG, qlen, kvlen);
    let kv_hi = min(keys.y, params.chunk_end);
    let n_begin = max(params.chunk_begin, keys.x / TILE * TILE);
    for (var n0 = n_begin; n0 < kv_hi; n0 += TILE) {
        workgroupBarrier();
        stage_keys(n0, kv_hi, b, h, lid);
        workgroupBarrier();
        for (var q = 0u; q < TILE / 4u; q++) {
            // Four keys' scores (additive/common.wgsl), masked pairs NEG_BIG exactly (a score
            // never reaches it).
            var e = vec4<f32>(0.0);
            for (var c4 = 0u; c4 < DA4; c4++) {
                var x: vec4<f32>;
                if OWN_IN_WORKGROUP != 0u {
                    x = own_tile[lid * OWN_S + c4];
                } else {
                    x = own[c4];
                }
                e += w_tile[c4] * tanh_rows(x, 4u * q, c4);
            }
            let j = vec4<u32>(n0 + 4u * q) + vec4<u32>(0u, 1u, 2u, 3u);
            let seen = (j >= vec4<u32>(start)) & (j < vec4<u32>(end)) & (j < vec4<u32>(kv_hi));
            e = select(vec4<f32>(NEG_BIG), e, seen);
            let group_max = max(max(e.x, e.y), max(e.z, e.w));
            if group_max > m {
                let alpha = exp(m - group_max);
                l *= alpha;
                for (var d = 0u; d < DV; d++) {
                    acc[d] *= alpha;
                }
                m = group_max;
            }
            // A NaN score counts (score_visible): it reaches the row. Masked keys get masked_p,
            // and their values are not read (a NaN there is not the row's).
            let p = visible_exp(e, vec4<f32>(m));
            l += p.x + p.y + p.z + p.w;
            let keep = p_visible(p);
            for (var d = 0u; d < DV; d++) {
                let v = select(vec4<f32>(0.0), v_tile[q * DVS + d], keep);
                acc[d] += dot(p, v);
            }
        }
    }

    // Padded rows (and rows that see no key) get O = 0, lse = -inf.
    if i >= params.q_seq {
        return;
    }
    let seen = row_seen(vec4<f32>(l)).x;
    for (var d = 0u; d < DV; d++) {
        o_buf[view_index(VIEW_O, b, i, h) + d] = select(0.0, acc[d] / l, seen);
    }
    lse_buf[row] = select(neg_inf(), m + log(l), seen);
}
