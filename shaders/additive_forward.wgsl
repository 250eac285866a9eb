// Fused additive (Bahdanau) attention forward (after attention_common.wgsl and additive_common.wgsl):
// scores e_ij from the query and key projections a [B, Lq, H, Da] (VIEW_Q) and b [B, Lk, H, Da]
// (VIEW_K), the online softmax over the visible keys (the shared header's masks: causal, per-batch
// lengths, windows), and O = P V (V [B, Lk, H, Dv], VIEW_V), with the row lse. [Lq, Lk, Da] never
// exists: each tanh is recomputed where it is used.
//
// One invocation per query row, WG rows of one (batch, head) per workgroup; key tiles of TILE keys
// (their b rows and V rows) staged in workgroup memory. Per key, the running max m, sum l and
// accumulator are updated in place (one exp per key; a rescale when the max grows). The key loop runs
// over [chunk_begin, chunk_end): a dispatch with accumulate = 1 resumes from the O and lse an earlier
// dispatch wrote (O normalised with lse is the state m = lse, l = 1, acc = O), so llvmpipe's loop
// budget is kept by splitting long key ranges over dispatches.

@group(0) @binding(7) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> lse_buf: array<f32>;

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

    // The query's a row plus the bias.
    var own: array<f32, MAX_DA>;
    for (var c = 0u; c < DA; c++) {
        own[c] = 0.0;
        if live {
            own[c] = a_rows[view_index(VIEW_Q, b, i, h) + c] + bias_buf[h * DA + c];
        }
    }
    stage_w(h, lid);
    var start = 0u;
    var end = 0u;
    if live {
        start = key_start(i);
        end = key_end(i, kvlen);
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
        if lse > NEG_BIG {
            m = lse;
            l = 1.0;
            for (var d = 0u; d < DV; d++) {
                acc[d] = o_buf[view_index(VIEW_O, b, i, h) + d];
            }
        }
    }

    // The block's keys within this dispatch's chunk: from its first row's window start to its last
    // valid row's end.
    let rows_hi = min(row0 + WG, qlen);
    var kv_hi = 0u;
    if rows_hi > row0 {
        kv_hi = min(key_end(rows_hi - 1u, kvlen), params.chunk_end);
    }
    let n_begin = max(params.chunk_begin, key_start(row0) / TILE * TILE);
    for (var n0 = n_begin; n0 < kv_hi; n0 += TILE) {
        workgroupBarrier();
        stage_keys(n0, kv_hi, b, h, lid);
        workgroupBarrier();
        for (var jj = 0u; jj < TILE; jj++) {
            let j = n0 + jj;
            if j < start || j >= end || j >= kv_hi {
                continue;
            }
            let e = additive_score(&own, jj);
            if e > m {
                let alpha = exp(m - e);
                l *= alpha;
                for (var d = 0u; d < DV; d++) {
                    acc[d] *= alpha;
                }
                m = e;
            }
            let p = exp(e - m);
            l += p;
            for (var d = 0u; d < DV; d++) {
                acc[d] += p * v_tile[jj * DV + d];
            }
        }
    }

    // Padded rows (and rows that see no key) get O = 0, lse = -inf.
    if i >= params.q_seq {
        return;
    }
    let seen = l > 0.0;
    for (var d = 0u; d < DV; d++) {
        o_buf[view_index(VIEW_O, b, i, h) + d] = select(0.0, acc[d] / l, seen);
    }
    lse_buf[row] = select(neg_inf(), m + log(l), seen);
}
