// The strided GEMM on tensor cores (after matmul_common.wgsl; the matrix interface,
// matrix/cooperative.wgsl or matrix/portable.wgsl, appended by the host): 64 x 64 output
// tiles, a workgroup of four tile groups (subgroups in the tensor-core build) each owning a 32 x 32
// quarter as 2 x 2 accumulator tiles. Per 32-deep k tile, A [64 x 32] and B [32 x 64] are staged
// in workgroup memory rounded to MatElem (f16: an f32 operand loses its low bits, an f16 one
// nothing), and each group runs 2 x 2 x 2 16x16x16 multiply-adds with f32 accumulation. The
// accumulators go out through workgroup memory to matmul_common.wgsl's `store`, so the epilogues
// (alpha, bias, accumulate, activation, residual) are the other kernels'. ROW_SUMS adds each row of
// A in k order from A as stored (not the rounded tile). The accumulators go out half a tile at a
// time (f32 tiles and a whole f32 output tile overflow 32 KiB). Rows, columns and k past m, n and
// k are staged as zeros and not stored.

override SG: u32 = 32u;
override WG: u32 = 4u * SG;

const TILE_M: u32 = 64u;
const TILE_N: u32 = 64u;
const TILE_K: u32 = 32u;
// Row strides of the staged tiles, 16 bytes past the rows' length (bank conflicts, as in the
// attention's tensor-core kernels): A [TILE_M x TILE_K] at 0, B [TILE_K x TILE_N] at B_AT.
const AS: u32 = TILE_K + 8u;
const BS: u32 = TILE_N + 8u;
const B_AT: u32 = TILE_M * AS;
var<workgroup> mat_mem: array<MatElem, B_AT + TILE_K * BS>;
// f32: half the output tile at a time on its way to `store`, rows CS apart: row r holds row
// 32 (r / 16) + 16 half + r % 16 of the tile (the first or second 16 rows of each group's 32).
const CS: u32 = TILE_N + 4u;
var<workgroup> acc_mem: array<f32, 32u * CS>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = wg.y * gp.grid_x + wg.x;
    // Uniform per workgroup, so returning here keeps every barrier and tile call uniform.
    if group >= gp.total_groups {
        return;
    }
    mat_init(lid % SG);
    let at = tile_of(group, TILE_M, TILE_N);
    let bi = at.bi;
    let h = at.h;
    let m0 = at.m0;
    let n0 = at.n0;
    // This tile group's quarter of the output tile.
    let quarter = lid / SG;
    let rows_at = 32u * (quarter / 2u);
    let cols_at = 32u * (quarter % 2u);
    var c00 = mat_zero();
    var c01 = mat_zero();
    var c10 = mat_zero();
    var c11 = mat_zero();
    // ROW_SUMS: invocation lid < TILE_M sums row lid over every k tile, in k order.
    var row_sum = 0.0;
    let sums = ROW_SUMS && n0 == 0u;
    let a_k_major = gp.a.stride_col == 1u;
    let b_k_major = gp.b.stride_row == 1u;
    for (var g = 0u; g < gp.groups; g++) {
        let a_base = base(gp.a, bi, h, g);
        let b_base = base(gp.b, bi, h, g);
        for (var k0 = 0u; k0 < gp.k; k0 += TILE_K) {
            // The previous k tile's products have read the staged tiles.
            workgroupBarrier();
            // Neighbouring invocations read neighbouring addresses (coalesced): along k when the
            // operand is contiguous in k, else along rows / columns.
            for (var t = lid; t < TILE_M * TILE_K; t += WG) {
                let row = select(t % TILE_M, t / TILE_K, a_k_major);
                let kk = select(t / TILE_M, t % TILE_K, a_k_major);
                var x = 0.0;
                if m0 + row < gp.m && k0 + kk < gp.k {
                    x = f32(a_buf[a_base + (m0 + row) * gp.a.stride_row + (k0 + kk) * gp.a.stride_col]);
                }
                mat_mem[row * AS + kk] = MatElem(x);
            }
            for (var t = lid; t < TILE_N * TILE_K; t += WG) {
                let col = select(t % TILE_N, t / TILE_K, b_k_major);
                let kk = select(t / TILE_N, t % TILE_K, b_k_major);
                var y = 0.0;
                if n0 + col < gp.n && k0 + kk < gp.k {
                    y = f32(b_buf[b_base + (k0 + kk) * gp.b.stride_row + (n0 + col) * gp.b.stride_col]);
                }
                mat_mem[B_AT + kk * BS + col] = MatElem(y);
            }
            workgroupBarrier();
            for (var kk = 0u; kk < TILE_K; kk += 16u) {
                let a0 = mat_load_a(rows_at * AS + kk, AS);
                let a1 = mat_load_a((rows_at + 16u) * AS + kk, AS);
                let b0 = mat_load_b(B_AT + kk * BS + cols_at, BS);
                let b1 = mat_load_b(B_AT + kk * BS + cols_at + 16u, BS);
                c00 = mat_mma(a0, b0, c00);
                c01 = mat_mma(a0, b1, c01);
                c10 = mat_mma(a1, b0, c10);
                c11 = mat_mma(a1, b1, c11);
            }
            // The row sums read A again, in f32 and k order (the staged tile is rounded).
            if sums && lid < TILE_M && m0 + lid < gp.m {
                let row = a_base + (m0 + lid) * gp.a.stride_row;
                for (var kk = k0; kk < min(k0 + TILE_K, gp.k); kk++) {
                    row_sum += f32(a_buf[row + kk * gp.a.stride_col]);
                }
            }
        }
    }

    if sums && lid < TILE_M && bi == 0u && h == 0u {
        store_row_sum(m0 + lid, row_sum);
    }
    let c_base = base(gp.c, bi, h, 0u);
    write_half(lid, c00, c01, 0u, c_base, m0, n0);
    write_half(lid, c10, c11, 1u, c_base, m0, n0);
}

// Rows 16 half .. 16 half + 15 of each group's 32 (its tiles `left` and `right`) through acc_mem to
// `store`.
fn write_half(lid: u32, left: TileC, right: TileC, half: u32, c_base: u32, m0: u32, n0: u32) {
    let quarter = lid / SG;
    let at = 16u * (quarter / 2u) * CS + 32u * (quarter % 2u);
    // The previous half is out of acc_mem.
    workgroupBarrier();
    mat_store(left, at, CS);
    mat_store(right, at + 16u, CS);
    workgroupBarrier();
    for (var t = lid; t < 32u * TILE_N; t += WG) {
        let r = t / TILE_N;
        let row = m0 + 32u * (r / 16u) + 16u * half + r % 16u;
        let col = n0 + t % TILE_N;
        if row < gp.m && col < gp.n {
            store(c_base, row, col, acc_mem[r * CS + t % TILE_N]);
        }
    }
}
