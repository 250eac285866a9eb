// Fused attention forward, FlashAttention-2 style (SPEC.md): O = softmax(scale * Q K^T + masks) V and
// lse = log-sum-exp of each row, in one pass over K/V tiles with an online softmax. The Lq x Lk score
// matrix is never materialised.
//
// A workgroup owns BLOCK_M = WG * ROWS query rows of one (batch, head). Each invocation keeps ROWS
// rows of q, the output accumulator, running max and sum in registers, so every K/V element staged in
// workgroup memory is reused ROWS times per load.

override WG: u32 = 64u;
override ROWS: u32 = 2u;
override BLOCK_N: u32 = 32u;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
override K_TILE: u32 = BLOCK_N * DK4;
override V_TILE: u32 = BLOCK_N * DV4;

const MAX_ROWS: u32 = 4u;
const MAX_D4: u32 = 64u;
const MAX_BN: u32 = 32u;

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse_buf: array<f32>;

var<workgroup> k_tile: array<vec4<f32>, K_TILE>;
var<workgroup> v_tile: array<vec4<f32>, V_TILE>;

fn load_k4(b: u32, j: u32, h: u32, c4: u32) -> vec4<f32> {
    let base = view_index(VIEW_K, b, j, h) + c4 * 4u;
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) {
        if c4 * 4u + c < DK {
            x[c] = k_buf[base + c];
        }
    }
    return x;
}

fn load_v4(b: u32, j: u32, h: u32, c4: u32) -> vec4<f32> {
    let base = view_index(VIEW_V, b, j, h) + c4 * 4u;
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < 4u; c++) {
        if c4 * 4u + c < DV {
            x[c] = v_buf[base + c];
        }
    }
    return x;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier below in uniform control flow.
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
    var acc: array<array<vec4<f32>, MAX_D4>, MAX_ROWS>;
    var m: array<f32, MAX_ROWS>;
    var l: array<f32, MAX_ROWS>;
    var row_end: array<u32, MAX_ROWS>;
    var p: array<array<f32, MAX_BN>, MAX_ROWS>;

    for (var r = 0u; r < ROWS; r++) {
        let i = row0 + lid + r * WG;
        m[r] = NEG_BIG;
        l[r] = 0.0;
        row_end[r] = 0u;
        for (var d4 = 0u; d4 < DV4; d4++) {
            acc[r][d4] = vec4<f32>(0.0);
        }
        for (var d4 = 0u; d4 < DK4; d4++) {
            q[r][d4] = vec4<f32>(0.0);
        }
        if i < qlen {
            row_end[r] = key_end(i, kvlen);
            let base = view_index(VIEW_Q, b, i, h);
            for (var d = 0u; d < DK; d++) {
                q[r][d / 4u][d % 4u] = q_buf[base + d] * params.scale;
            }
        }
    }

    // Keys visible to any row of the block: those of its last valid row (masks are monotone in i).
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
            var x = vec4<f32>(0.0);
            if jj < n_tile {
                x = load_k4(b, n0 + jj, h_kv, t % DK4);
            }
            k_tile[t] = x;
        }
        for (var t = lid; t < V_TILE; t += WG) {
            let jj = t / DV4;
            var x = vec4<f32>(0.0);
            if jj < n_tile {
                x = load_v4(b, n0 + jj, h_kv, t % DV4);
            }
            v_tile[t] = x;
        }
        workgroupBarrier();

        // Scores for the tile; each staged k vector is used by all ROWS rows.
        for (var jj = 0u; jj < n_tile; jj++) {
            var s: array<f32, MAX_ROWS>;
            for (var d4 = 0u; d4 < DK4; d4++) {
                let kx = k_tile[jj * DK4 + d4];
                for (var r = 0u; r < ROWS; r++) {
                    s[r] += dot(q[r][d4], kx);
                }
            }
            for (var r = 0u; r < ROWS; r++) {
                p[r][jj] = s[r];
            }
        }

        // Online softmax: one rescale of the accumulator per tile and row.
        for (var r = 0u; r < ROWS; r++) {
            var tile_max = NEG_BIG;
            for (var jj = 0u; jj < n_tile; jj++) {
                if n0 + jj < row_end[r] {
                    tile_max = max(tile_max, p[r][jj]);
                }
            }
            let m_new = max(m[r], tile_max);
            let alpha = exp(m[r] - m_new);
            var row_sum = 0.0;
            for (var jj = 0u; jj < n_tile; jj++) {
                var e = 0.0;
                if n0 + jj < row_end[r] {
                    e = exp(p[r][jj] - m_new);
                }
                p[r][jj] = e;
                row_sum += e;
            }
            l[r] = l[r] * alpha + row_sum;
            m[r] = m_new;
            for (var d4 = 0u; d4 < DV4; d4++) {
                acc[r][d4] *= alpha;
            }
        }

        for (var jj = 0u; jj < n_tile; jj++) {
            for (var d4 = 0u; d4 < DV4; d4++) {
                let vx = v_tile[jj * DV4 + d4];
                for (var r = 0u; r < ROWS; r++) {
                    acc[r][d4] += p[r][jj] * vx;
                }
            }
        }
    }

    for (var r = 0u; r < ROWS; r++) {
        let i = row0 + lid + r * WG;
        if i >= params.q_seq {
            continue;
        }
        // Padded rows and rows with no visible key: O = 0, lse = -inf (SPEC.md).
        let live = i < qlen && row_end[r] > 0u;
        var inv_l = 0.0;
        if live {
            inv_l = 1.0 / l[r];
        }
        let base = view_index(VIEW_O, b, i, h);
        for (var d = 0u; d < DV; d++) {
            o_buf[base + d] = acc[r][d / 4u][d % 4u] * inv_l;
        }
        var lse = neg_inf();
        if live {
            lse = m[r] + log(l[r]);
        }
        lse_buf[(b * params.heads + h) * params.q_seq + i] = lse;
    }
}
