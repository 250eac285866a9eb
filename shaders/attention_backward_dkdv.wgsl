// Attention backward, step 2 (SPEC.md): for each key j, with p_ij recomputed from the saved lse,
//   dV_j = sum_i p_ij dO_i,   dK_j = scale * sum_i dS_ij q_i,   dS_ij = p_ij (dO_i . v_j - D_i),
// summed over every query head that shares kv head h_kv (grouped/multi-query attention), in a fixed
// order: deterministic, no atomics. A workgroup owns BLOCK_N = WG * ROWS keys of one (batch, kv head);
// each invocation keeps ROWS rows of k, v, dK, dV in registers and the workgroup stages Q, dO and
// (lse, D) tiles of BLOCK_M query rows. Under the causal mask, query tiles that see none of the
// block's keys are skipped.

override WG: u32 = 64u;
override ROWS: u32 = 1u;
override BLOCK_M: u32 = 32u;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
override Q_TILE: u32 = BLOCK_M * DK4;
override DO_TILE: u32 = BLOCK_M * DV4;

const MAX_ROWS: u32 = 4u;
const MAX_D4: u32 = 64u;

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> dk_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> dv_buf: array<f32>;

var<workgroup> q_tile: array<vec4<f32>, Q_TILE>;
var<workgroup> do_tile: array<vec4<f32>, DO_TILE>;
var<workgroup> stat_tile: array<vec2<f32>, BLOCK_M>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    let k_block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.kv_heads;
    let h_kv = bh % params.kv_heads;
    let group_size = params.heads / params.kv_heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let col0 = k_block * WG * ROWS;

    var k: array<array<vec4<f32>, MAX_D4>, MAX_ROWS>;
    var v: array<array<vec4<f32>, MAX_D4>, MAX_ROWS>;
    var dk: array<array<vec4<f32>, MAX_D4>, MAX_ROWS>;
    var dv: array<array<vec4<f32>, MAX_D4>, MAX_ROWS>;
    var q_lo: array<u32, MAX_ROWS>;
    var live: array<bool, MAX_ROWS>;

    for (var r = 0u; r < ROWS; r++) {
        let j = col0 + lid + r * WG;
        live[r] = j < kvlen;
        q_lo[r] = query_start(j);
        for (var d4 = 0u; d4 < DK4; d4++) {
            k[r][d4] = vec4<f32>(0.0);
            dk[r][d4] = vec4<f32>(0.0);
        }
        for (var d4 = 0u; d4 < DV4; d4++) {
            v[r][d4] = vec4<f32>(0.0);
            dv[r][d4] = vec4<f32>(0.0);
        }
        if live[r] {
            let k_base = view_index(VIEW_K, b, j, h_kv);
            for (var d = 0u; d < DK; d++) {
                k[r][d / 4u][d % 4u] = k_buf[k_base + d] * params.scale;
            }
            let v_base = view_index(VIEW_V, b, j, h_kv);
            for (var d = 0u; d < DV; d++) {
                v[r][d / 4u][d % 4u] = v_buf[v_base + d];
            }
        }
    }

    // Query rows that can see any key of the block start at the first key's causal start.
    var m_lo = query_start(col0);
    if col0 >= kvlen {
        m_lo = qlen;
    }

    for (var g = 0u; g < group_size; g++) {
        let h = h_kv * group_size + g;
        for (var m0 = m_lo; m0 < qlen; m0 += BLOCK_M) {
            let m_tile = min(BLOCK_M, qlen - m0);
            workgroupBarrier();
            for (var t = lid; t < Q_TILE; t += WG) {
                let ii = t / DK4;
                let c4 = t % DK4;
                var x = vec4<f32>(0.0);
                if ii < m_tile {
                    let base = view_index(VIEW_Q, b, m0 + ii, h) + c4 * 4u;
                    for (var c = 0u; c < 4u; c++) {
                        if c4 * 4u + c < DK {
                            x[c] = q_buf[base + c];
                        }
                    }
                }
                q_tile[t] = x;
            }
            for (var t = lid; t < DO_TILE; t += WG) {
                let ii = t / DV4;
                let c4 = t % DV4;
                var x = vec4<f32>(0.0);
                if ii < m_tile {
                    let base = view_index(VIEW_DO, b, m0 + ii, h) + c4 * 4u;
                    for (var c = 0u; c < 4u; c++) {
                        if c4 * 4u + c < DV {
                            x[c] = do_buf[base + c];
                        }
                    }
                }
                do_tile[t] = x;
            }
            for (var t = lid; t < BLOCK_M; t += WG) {
                var st = vec2<f32>(0.0);
                if t < m_tile {
                    st = stats[(b * params.heads + h) * params.q_seq + m0 + t];
                }
                stat_tile[t] = st;
            }
            workgroupBarrier();

            for (var ii = 0u; ii < m_tile; ii++) {
                let i = m0 + ii;
                var s: array<f32, MAX_ROWS>;
                var dp: array<f32, MAX_ROWS>;
                for (var d4 = 0u; d4 < DK4; d4++) {
                    let qx = q_tile[ii * DK4 + d4];
                    for (var r = 0u; r < ROWS; r++) {
                        s[r] += dot(k[r][d4], qx);
                    }
                }
                for (var d4 = 0u; d4 < DV4; d4++) {
                    let ox = do_tile[ii * DV4 + d4];
                    for (var r = 0u; r < ROWS; r++) {
                        dp[r] += dot(v[r][d4], ox);
                    }
                }
                let st = stat_tile[ii];
                var p: array<f32, MAX_ROWS>;
                var ds: array<f32, MAX_ROWS>;
                for (var r = 0u; r < ROWS; r++) {
                    // Key j is visible to row i iff j < kv_len and i >= query_start(j); then row i has a
                    // visible key, so its lse is finite.
                    if live[r] && i >= q_lo[r] {
                        p[r] = exp(s[r] - st.x);
                        ds[r] = p[r] * (dp[r] - st.y);
                    }
                }
                for (var d4 = 0u; d4 < DV4; d4++) {
                    let ox = do_tile[ii * DV4 + d4];
                    for (var r = 0u; r < ROWS; r++) {
                        dv[r][d4] += p[r] * ox;
                    }
                }
                for (var d4 = 0u; d4 < DK4; d4++) {
                    let qx = q_tile[ii * DK4 + d4];
                    for (var r = 0u; r < ROWS; r++) {
                        dk[r][d4] += ds[r] * qx;
                    }
                }
            }
        }
    }

    for (var r = 0u; r < ROWS; r++) {
        let j = col0 + lid + r * WG;
        if j >= params.kv_seq {
            continue;
        }
        let k_base = view_index(VIEW_DK, b, j, h_kv);
        for (var d = 0u; d < DK; d++) {
            dk_buf[k_base + d] = dk[r][d / 4u][d % 4u] * params.scale;
        }
        let v_base = view_index(VIEW_DV, b, j, h_kv);
        for (var d = 0u; d < DV; d++) {
            dv_buf[v_base + d] = dv[r][d / 4u][d % 4u];
        }
    }
}
