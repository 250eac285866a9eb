// The strided GEMM with 128 x 64 output tiles (after matmul_common.wgsl), for GPUs: a 16x16
// workgroup stages 16-deep k tiles of A (128 rows) and B (64 columns) in workgroup memory as vec4s,
// and each invocation computes 8 consecutive rows by 4 consecutive columns of C: per k step two vec4
// reads of A and one of B feed 32 multiply-adds (the 64x64 kernel's 4x4 tile reads 8 scalars for 16).
// Rows and columns past m and n are computed from zeros and not stored.

const TILE_M: u32 = 128u;
const TILE_N: u32 = 64u;
const TILE_K: u32 = 16u;

var<workgroup> a_wide: array<vec4<f32>, 512>; // [TILE_K][TILE_M / 4]: rows 4r .. 4r + 3 of one k
var<workgroup> b_wide: array<vec4<f32>, 256>; // [TILE_K][TILE_N / 4]: columns 4c .. 4c + 3 of one k

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let group = wg.y * gp.grid_x + wg.x;
    if group >= gp.total_groups {
        return;
    }
    let at = tile_of(group, TILE_M, TILE_N);
    let bi = at.bi;
    let h = at.h;
    let m0 = at.m0;
    let n0 = at.n0;
    let tx = lid3.x;
    let ty = lid3.y;
    let lid = ty * 16u + tx;

    // Rows 8 ty + r of the invocation's tile are acc_r, its columns 4 tx .. 4 tx + 3 the vec4 lanes:
    // named registers, no indexed private array.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    var acc4 = vec4<f32>(0.0);
    var acc5 = vec4<f32>(0.0);
    var acc6 = vec4<f32>(0.0);
    var acc7 = vec4<f32>(0.0);
    // Rows 8 ty .. 8 ty + 7 of A summed over k (ROW_SUMS).
    var row_sum_lo = vec4<f32>(0.0);
    var row_sum_hi = vec4<f32>(0.0);
    let a_k_major = gp.a.stride_col == 1u;
    let b_k_major = gp.b.stride_row == 1u;
    for (var g = 0u; g < gp.groups; g++) {
        let a_base = base(gp.a, bi, h, g);
        let b_base = base(gp.b, bi, h, g);
        for (var k0 = 0u; k0 < gp.k; k0 += TILE_K) {
            workgroupBarrier();
            // Neighbouring invocations read neighbouring addresses (coalesced): along k when the
            // operand is contiguous in k, else along rows / columns.
            for (var t = lid; t < TILE_M * TILE_K; t += 256u) {
                let row = select(t % TILE_M, t / TILE_K, a_k_major);
                let kk = select(t / TILE_M, t % TILE_K, a_k_major);
                var x = 0.0;
                if m0 + row < gp.m && k0 + kk < gp.k {
                    x = a_value(a_base + (m0 + row) * gp.a.stride_row + (k0 + kk) * gp.a.stride_col);
                }
                a_wide[kk * (TILE_M / 4u) + row / 4u][row % 4u] = x;
            }
            for (var t = lid; t < TILE_N * TILE_K; t += 256u) {
                let col = select(t % TILE_N, t / TILE_K, b_k_major);
                let kk = select(t / TILE_N, t % TILE_K, b_k_major);
                var y = 0.0;
                if n0 + col < gp.n && k0 + kk < gp.k {
                    y = b_value(b_base + (k0 + kk) * gp.b.stride_row + (n0 + col) * gp.b.stride_col);
                }
                b_wide[kk * (TILE_N / 4u) + col / 4u][col % 4u] = y;
            }
            workgroupBarrier();
            for (var kk = 0u; kk < TILE_K; kk++) {
                let a_lo = a_wide[kk * (TILE_M / 4u) + 2u * ty];
                let a_hi = a_wide[kk * (TILE_M / 4u) + 2u * ty + 1u];
                let bv = b_wide[kk * (TILE_N / 4u) + tx];
                acc0 += a_lo.x * bv;
                acc1 += a_lo.y * bv;
                acc2 += a_lo.z * bv;
                acc3 += a_lo.w * bv;
                acc4 += a_hi.x * bv;
                acc5 += a_hi.y * bv;
                acc6 += a_hi.z * bv;
                acc7 += a_hi.w * bv;
                // Only the first column of tiles writes the sums: a workgroup-uniform branch.
                if ROW_SUMS && n0 == 0u {
                    row_sum_lo += a_lo;
                    row_sum_hi += a_hi;
                }
            }
        }
    }

    let row0 = m0 + 8u * ty;
    if ROW_SUMS && n0 == 0u && tx == 0u && bi == 0u && h == 0u {
        store_row_sums(row0, 1u, row_sum_lo);
        store_row_sums(row0 + 4u, 1u, row_sum_hi);
    }
    let c_base = base(gp.c, bi, h, 0u);
    let col0 = n0 + 4u * tx;
    store_cols(c_base, row0, col0, acc0);
    store_cols(c_base, row0 + 1u, col0, acc1);
    store_cols(c_base, row0 + 2u, col0, acc2);
    store_cols(c_base, row0 + 3u, col0, acc3);
    store_cols(c_base, row0 + 4u, col0, acc4);
    store_cols(c_base, row0 + 5u, col0, acc5);
    store_cols(c_base, row0 + 6u, col0, acc6);
    store_cols(c_base, row0 + 7u, col0, acc7);
}

// Columns col0 .. col0 + 3 of one output row, through store.
fn store_cols(c_base: u32, row: u32, col0: u32, acc: vec4<f32>) {
    if row >= gp.m {
        return;
    }
    for (var c = 0u; c < 4u; c++) {
        if col0 + c < gp.n {
            store(c_base, row, col0 + c, acc[c]);
        }
    }
}
