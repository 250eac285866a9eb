// Fused additive (Bahdanau) attention forward: scores
//   e_ij = scale * sum_c w[h, c] tanh(a[b, i, h, c] + b[b, j, h, c] + bias[h, c])
// from the query and key projections a [B, Lq, H, Da] (VIEW_Q) and b [B, Lk, H, Da] (VIEW_K), the
// online softmax over the visible keys (the shared header's masks: causal, per-batch lengths,
// windows), and O = P V (V [B, Lk, H, Dv], VIEW_V), with the row lse. [Lq, Lk, Da] never exists:
// each tanh is recomputed where it is used.
//
// One invocation per query row, WG rows of one (batch, head) per workgroup; key tiles of BN keys
// (their b rows and V rows) staged in workgroup memory. Per key, the running max m, sum l and
// accumulator are updated in place (one exp per key; a rescale when the max grows). The key loop runs
// over [chunk_begin, chunk_end): a dispatch with accumulate = 1 resumes from the O and lse an earlier
// dispatch wrote (O normalised with lse is the state m = lse, l = 1, acc = O), so llvmpipe's loop
// budget is kept by splitting long key ranges over dispatches.

override WG: u32 = 64u;
override BN: u32 = 32u;
override DA: u32 = 64u;
override DV: u32 = 64u;

// Sizes of the per-invocation arrays; the host writes the pipeline's exact Da and Dv here.
const MAX_DA: u32 = 128u;
const MAX_DV: u32 = 128u;

@group(0) @binding(2) var<storage, read> a_buf: array<f32>;
@group(0) @binding(3) var<storage, read> b_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse_buf: array<f32>;
// The score vector w and the bias, [H, Da] each.
@group(0) @binding(7) var<storage, read> w_buf: array<f32>;
@group(0) @binding(8) var<storage, read> bias_buf: array<f32>;

var<workgroup> b_tile: array<f32, BN * DA>;
var<workgroup> v_tile: array<f32, BN * DV>;
var<workgroup> w_tile: array<f32, DA>;

// tanh where every implementation is exact to f32 (some compute it through exp(2x), which overflows).
fn tanh1(x: f32) -> f32 {
    return tanh(clamp(x, -15.0, 15.0));
}

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

    // The query's a row plus the bias; w (times the scale) for the whole workgroup.
    var ab: array<f32, MAX_DA>;
    for (var c = 0u; c < DA; c++) {
        ab[c] = 0.0;
        if live {
            ab[c] = a_buf[view_index(VIEW_Q, b, i, h) + c] + bias_buf[h * DA + c];
        }
    }
    for (var c = lid; c < DA; c += WG) {
        w_tile[c] = params.scale * w_buf[h * DA + c];
    }
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
    let n_begin = max(params.chunk_begin, key_start(row0) / BN * BN);
    for (var n0 = n_begin; n0 < kv_hi; n0 += BN) {
        workgroupBarrier();
        for (var t = lid; t < BN * DA; t += WG) {
            let j = n0 + t / DA;
            var x = 0.0;
            if j < kv_hi {
                x = b_buf[view_index(VIEW_K, b, j, h) + t % DA];
            }
            b_tile[t] = x;
        }
        for (var t = lid; t < BN * DV; t += WG) {
            let j = n0 + t / DV;
            var x = 0.0;
            if j < kv_hi {
                x = v_buf[view_index(VIEW_V, b, j, h) + t % DV];
            }
            v_tile[t] = x;
        }
        workgroupBarrier();
        for (var jj = 0u; jj < BN; jj++) {
            let j = n0 + jj;
            if j < start || j >= end || j >= kv_hi {
                continue;
            }
            var e = 0.0;
            for (var c = 0u; c < DA; c++) {
                e += w_tile[c] * tanh1(ab[c] + b_tile[jj * DA + c]);
            }
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
