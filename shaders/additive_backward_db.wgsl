// Fused additive attention backward, key side (after attention_common.wgsl and additive_common.wgsl):
// for each key j, over the query rows i that see it (recomputed: t = tanh(a_i + b_j + bias),
// e = scale w . t, p = exp(e - lse_i)),
//   dv_j += p dO_i,   ds_ij = p (dO_i . v_j - D_i),   db_j += ds_ij * scale w (1 - t^2)
// with D_i from additive_backward_da.wgsl (d_rows). db_j is written to VIEW_DK, dv_j to VIEW_DV.
// One invocation per key, WG keys of one (batch, head) per workgroup; query tiles of TILE rows
// (a + bias in pair_tile, dO, lse, D and their visible key ranges) staged in workgroup memory. The
// query loop runs over [chunk_begin, chunk_end) and later dispatches (accumulate = 1) add to db and dv.

@group(0) @binding(7) var<storage, read> do_buf: array<f32>;
@group(0) @binding(8) var<storage, read> lse_buf: array<f32>;
@group(0) @binding(9) var<storage, read> d_rows: array<f32>;
@group(0) @binding(10) var<storage, read_write> db_buf: array<f32>;
@group(0) @binding(11) var<storage, read_write> dv_buf: array<f32>;

var<workgroup> g_tile: array<f32, TILE * DV>;
var<workgroup> lse_tile: array<f32, TILE>;
var<workgroup> d_tile: array<f32, TILE>;
var<workgroup> start_tile: array<u32, TILE>;
var<workgroup> end_tile: array<u32, TILE>;

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

    var own: array<f32, MAX_DA>;
    var vj: array<f32, MAX_DV>;
    var db: array<f32, MAX_DA>;
    var dv: array<f32, MAX_DV>;
    for (var c = 0u; c < DA; c++) {
        own[c] = 0.0;
        db[c] = 0.0;
        if live {
            own[c] = b_keys[view_index(VIEW_K, b, j, h) + c];
        }
    }
    for (var d = 0u; d < DV; d++) {
        vj[d] = 0.0;
        dv[d] = 0.0;
        if live {
            vj[d] = v_keys[view_index(VIEW_V, b, j, h) + d];
        }
    }
    stage_w(h, lid);

    // The query rows that see any key of the block, within this dispatch's chunk.
    let keys_hi = min(key0 + WG, kvlen);
    var m_begin = params.chunk_end;
    var m_end = 0u;
    if keys_hi > key0 {
        m_begin = max(params.chunk_begin, query_start(key0));
        m_end = min(min(query_end(keys_hi - 1u), qlen), params.chunk_end);
    }
    for (var m0 = m_begin; m0 < m_end; m0 += TILE) {
        workgroupBarrier();
        for (var t = lid; t < TILE * DA; t += WG) {
            let i = m0 + t / DA;
            let c = t % DA;
            var x = 0.0;
            if i < m_end {
                x = a_rows[view_index(VIEW_Q, b, i, h) + c] + bias_buf[h * DA + c];
            }
            pair_tile[t] = x;
        }
        for (var t = lid; t < TILE * DV; t += WG) {
            let i = m0 + t / DV;
            var x = 0.0;
            if i < m_end {
                x = do_buf[view_index(VIEW_DO, b, i, h) + t % DV];
            }
            g_tile[t] = x;
        }
        for (var t = lid; t < TILE; t += WG) {
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
        // Four query rows at a time: each own[c], w[c], vj[d], db[c] and dv[d] access serves all four.
        for (var ii = 0u; ii < TILE; ii += 4u) {
            let lse = vec4<f32>(lse_tile[ii], lse_tile[ii + 1u], lse_tile[ii + 2u], lse_tile[ii + 3u]);
            let starts = vec4<u32>(start_tile[ii], start_tile[ii + 1u], start_tile[ii + 2u], start_tile[ii + 3u]);
            let ends = vec4<u32>(end_tile[ii], end_tile[ii + 1u], end_tile[ii + 2u], end_tile[ii + 3u]);
            let jv = vec4<u32>(j);
            let seen = vec4<bool>(live) & (jv >= starts) & (jv < ends) & (lse > vec4<f32>(NEG_BIG));
            if !any(seen) {
                continue;
            }
            // Each tanh once: kept for the derivative pass below.
            var t_row: array<vec4<f32>, MAX_DA>;
            var e = vec4<f32>(0.0);
            for (var c = 0u; c < DA; c++) {
                let t = tanh4(own[c], ii, c);
                t_row[c] = t;
                e += w_tile[c] * t;
            }
            // Rows that do not see this key (or saw none, lse = -inf) contribute nothing.
            let p = select(vec4<f32>(0.0), exp(e - lse), seen);
            var dp = vec4<f32>(0.0);
            for (var d = 0u; d < DV; d++) {
                let at = ii * DV + d;
                let g = vec4<f32>(g_tile[at], g_tile[at + DV], g_tile[at + 2u * DV], g_tile[at + 3u * DV]);
                dp += g * vj[d];
                dv[d] += dot(p, g);
            }
            let d_row = vec4<f32>(d_tile[ii], d_tile[ii + 1u], d_tile[ii + 2u], d_tile[ii + 3u]);
            let ds = p * (dp - d_row);
            for (var c = 0u; c < DA; c++) {
                let t = t_row[c];
                db[c] += dot(ds, w_tile[c] * (1.0 - t * t));
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
