// Fused additive attention backward, key side: for each key j, over the query rows i that see it
// (recomputed: t = tanh(a_i + b_j + bias), e = scale w . t, p = exp(e - lse_i)),
//   dv_j += p dO_i,   ds_ij = p (dO_i . v_j - D_i),   db_j += ds_ij * scale w (1 - t^2)
// with D_i from additive_backward_da.wgsl (d_rows). db_j is written to VIEW_DK, dv_j to VIEW_DV.
// One invocation per key, WG keys of one (batch, head) per workgroup; query tiles of BM rows (a + bias,
// dO, lse, D) staged in workgroup memory. The query loop runs over [chunk_begin, chunk_end) and later
// dispatches (accumulate = 1) add to db and dv.

override WG: u32 = 64u;
override BM: u32 = 32u;
override DA: u32 = 64u;
override DV: u32 = 64u;

const MAX_DA: u32 = 128u;
const MAX_DV: u32 = 128u;

@group(0) @binding(2) var<storage, read> a_buf: array<f32>;
@group(0) @binding(3) var<storage, read> b_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> lse_buf: array<f32>;
@group(0) @binding(7) var<storage, read> d_rows: array<f32>;
@group(0) @binding(8) var<storage, read> w_buf: array<f32>;
@group(0) @binding(9) var<storage, read> bias_buf: array<f32>;
@group(0) @binding(10) var<storage, read_write> db_buf: array<f32>;
@group(0) @binding(11) var<storage, read_write> dv_buf: array<f32>;

var<workgroup> a_tile: array<f32, BM * DA>;
var<workgroup> g_tile: array<f32, BM * DV>;
// Per staged row: lse, D, and the first and last keys it sees (as f32-free u32 pairs below).
var<workgroup> lse_tile: array<f32, BM>;
var<workgroup> d_tile: array<f32, BM>;
var<workgroup> start_tile: array<u32, BM>;
var<workgroup> end_tile: array<u32, BM>;
var<workgroup> w_tile: array<f32, DA>;

fn tanh1(x: f32) -> f32 {
    return tanh(clamp(x, -15.0, 15.0));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    let block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let key0 = block * WG;
    let j = key0 + lid;
    let live = j < kvlen;

    var bj: array<f32, MAX_DA>;
    var vj: array<f32, MAX_DV>;
    var db: array<f32, MAX_DA>;
    var dv: array<f32, MAX_DV>;
    for (var c = 0u; c < DA; c++) {
        bj[c] = 0.0;
        db[c] = 0.0;
        if live {
            bj[c] = b_buf[view_index(VIEW_K, b, j, h) + c];
        }
    }
    for (var d = 0u; d < DV; d++) {
        vj[d] = 0.0;
        dv[d] = 0.0;
        if live {
            vj[d] = v_buf[view_index(VIEW_V, b, j, h) + d];
        }
    }
    for (var c = lid; c < DA; c += WG) {
        w_tile[c] = params.scale * w_buf[h * DA + c];
    }

    // The query rows that see any key of the block, within this dispatch's chunk.
    let keys_hi = min(key0 + WG, kvlen);
    var m_begin = params.chunk_end;
    var m_end = 0u;
    if keys_hi > key0 {
        m_begin = max(params.chunk_begin, query_start(key0));
        m_end = min(min(query_end(keys_hi - 1u), qlen), params.chunk_end);
    }
    for (var m0 = m_begin; m0 < m_end; m0 += BM) {
        workgroupBarrier();
        for (var t = lid; t < BM * DA; t += WG) {
            let i = m0 + t / DA;
            let c = t % DA;
            var x = 0.0;
            if i < m_end {
                x = a_buf[view_index(VIEW_Q, b, i, h) + c] + bias_buf[h * DA + c];
            }
            a_tile[t] = x;
        }
        for (var t = lid; t < BM * DV; t += WG) {
            let i = m0 + t / DV;
            var x = 0.0;
            if i < m_end {
                x = do_buf[view_index(VIEW_DO, b, i, h) + t % DV];
            }
            g_tile[t] = x;
        }
        for (var t = lid; t < BM; t += WG) {
            let i = m0 + t;
            var lse = neg_inf();
            var dr = 0.0;
            var s = 1u;
            var e = 0u;
            if i < m_end {
                let row = (b * params.heads + h) * params.q_seq + i;
                lse = lse_buf[row];
                dr = d_rows[row];
                s = key_start(i);
                e = key_end(i, kvlen);
            }
            lse_tile[t] = lse;
            d_tile[t] = dr;
            start_tile[t] = s;
            end_tile[t] = e;
        }
        workgroupBarrier();
        for (var ii = 0u; ii < BM; ii++) {
            if !live || j < start_tile[ii] || j >= end_tile[ii] || !(lse_tile[ii] > NEG_BIG) {
                continue;
            }
            var e = 0.0;
            for (var c = 0u; c < DA; c++) {
                e += w_tile[c] * tanh1(a_tile[ii * DA + c] + bj[c]);
            }
            let p = exp(e - lse_tile[ii]);
            var dp = 0.0;
            for (var d = 0u; d < DV; d++) {
                let g = g_tile[ii * DV + d];
                dp += g * vj[d];
                dv[d] += p * g;
            }
            let ds = p * (dp - d_tile[ii]);
            for (var c = 0u; c < DA; c++) {
                let t = tanh1(a_tile[ii * DA + c] + bj[c]);
                db[c] += ds * w_tile[c] * (1.0 - t * t);
            }
        }
    }

    // Padded keys get zero gradients.
    if j >= params.kv_seq {
        return;
    }
    let b_base = view_index(VIEW_DK, b, j, h);
    for (var c = 0u; c < DA; c++) {
        if params.accumulate != 0u {
            db[c] += db_buf[b_base + c];
        }
        db_buf[b_base + c] = db[c];
    }
    let v_base = view_index(VIEW_DV, b, j, h);
    for (var d = 0u; d < DV; d++) {
        if params.accumulate != 0u {
            dv[d] += dv_buf[v_base + d];
        }
        dv_buf[v_base + d] = dv[d];
    }
}
