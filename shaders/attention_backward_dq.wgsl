// Attention backward, step 3 (SPEC.md): dQ_i = scale * sum_j dS_ij k_j with
// dS_ij = p_ij (dO_i . v_j - D_i) and p_ij = exp(s_ij - lse_i) recomputed from the saved lse.
// Parallel over query blocks like the forward kernel, so no float atomics and bitwise reproducible.
// Each invocation owns ROWS query rows (q, dO, dQ in registers); K/V tiles are staged.

override WG: u32 = 64u;
override ROWS: u32 = 1u;
override BLOCK_N: u32 = 32u;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
override K_TILE: u32 = BLOCK_N * DK4;
override V_TILE: u32 = BLOCK_N * DV4;

const MAX_ROWS: u32 = 4u;
const MAX_D4: u32 = 64u;

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> dq_buf: array<f32>;

var<workgroup> k_tile: array<vec4<f32>, K_TILE>;
var<workgroup> v_tile: array<vec4<f32>, V_TILE>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    let q_block = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let h_kv = h / (params.heads / params.kv_heads);
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let row0 = q_block * WG * ROWS;

    var q: array<array<vec4<f32>, MAX_D4>, MAX_ROWS>;
    var d_o: array<array<vec4<f32>, MAX_D4>, MAX_ROWS>;
    var dq: array<array<vec4<f32>, MAX_D4>, MAX_ROWS>;
    var lse: array<f32, MAX_ROWS>;
    var delta: array<f32, MAX_ROWS>;
    var row_end: array<u32, MAX_ROWS>;

    for (var r = 0u; r < ROWS; r++) {
        let i = row0 + lid + r * WG;
        row_end[r] = 0u;
        lse[r] = 0.0;
        delta[r] = 0.0;
        for (var d4 = 0u; d4 < DK4; d4++) {
            q[r][d4] = vec4<f32>(0.0);
            dq[r][d4] = vec4<f32>(0.0);
        }
        for (var d4 = 0u; d4 < DV4; d4++) {
            d_o[r][d4] = vec4<f32>(0.0);
        }
        if i < qlen {
            row_end[r] = key_end(i, kvlen);
            let st = stats[(b * params.heads + h) * params.q_seq + i];
            lse[r] = st.x;
            delta[r] = st.y;
            let q_base = view_index(VIEW_Q, b, i, h);
            for (var d = 0u; d < DK; d++) {
                q[r][d / 4u][d % 4u] = q_buf[q_base + d] * params.scale;
            }
            let do_base = view_index(VIEW_DO, b, i, h);
            for (var d = 0u; d < DV; d++) {
                d_o[r][d / 4u][d % 4u] = do_buf[do_base + d];
            }
        }
    }

    let rows_hi = min(row0 + WG * ROWS, qlen);
    var kv_hi = 0u;
    if rows_hi > row0 {
        kv_hi = key_end(rows_hi - 1u, kvlen);
    }

    for (var n0 = 0u; n0 < kv_hi; n0 += BLOCK_N) {
        let n_tile = min(BLOCK_N, kv_hi - n0);
        workgroupBarrier();
        for (var t = lid; t < K_TILE; t += WG) {
            let jj = t / DK4;
            let c4 = t % DK4;
            var x = vec4<f32>(0.0);
            if jj < n_tile {
                let base = view_index(VIEW_K, b, n0 + jj, h_kv) + c4 * 4u;
                for (var c = 0u; c < 4u; c++) {
                    if c4 * 4u + c < DK {
                        x[c] = k_buf[base + c];
                    }
                }
            }
            k_tile[t] = x;
        }
        for (var t = lid; t < V_TILE; t += WG) {
            let jj = t / DV4;
            let c4 = t % DV4;
            var x = vec4<f32>(0.0);
            if jj < n_tile {
                let base = view_index(VIEW_V, b, n0 + jj, h_kv) + c4 * 4u;
                for (var c = 0u; c < 4u; c++) {
                    if c4 * 4u + c < DV {
                        x[c] = v_buf[base + c];
                    }
                }
            }
            v_tile[t] = x;
        }
        workgroupBarrier();

        for (var jj = 0u; jj < n_tile; jj++) {
            var s: array<f32, MAX_ROWS>;
            var dp: array<f32, MAX_ROWS>;
            for (var d4 = 0u; d4 < DK4; d4++) {
                let kx = k_tile[jj * DK4 + d4];
                for (var r = 0u; r < ROWS; r++) {
                    s[r] += dot(q[r][d4], kx);
                }
            }
            for (var d4 = 0u; d4 < DV4; d4++) {
                let vx = v_tile[jj * DV4 + d4];
                for (var r = 0u; r < ROWS; r++) {
                    dp[r] += dot(d_o[r][d4], vx);
                }
            }
            var ds: array<f32, MAX_ROWS>;
            for (var r = 0u; r < ROWS; r++) {
                // Masked pairs (and so every pair of a row whose lse is -inf) contribute exactly 0.
                if n0 + jj < row_end[r] {
                    ds[r] = exp(s[r] - lse[r]) * (dp[r] - delta[r]);
                }
            }
            for (var d4 = 0u; d4 < DK4; d4++) {
                let kx = k_tile[jj * DK4 + d4];
                for (var r = 0u; r < ROWS; r++) {
                    dq[r][d4] += ds[r] * kx;
                }
            }
        }
    }

    for (var r = 0u; r < ROWS; r++) {
        let i = row0 + lid + r * WG;
        if i >= params.q_seq {
            continue;
        }
        let base = view_index(VIEW_DQ, b, i, h);
        for (var d = 0u; d < DK; d++) {
            dq_buf[base + d] = dq[r][d / 4u][d % 4u] * params.scale;
        }
    }
}
