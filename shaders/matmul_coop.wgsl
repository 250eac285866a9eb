// The strided GEMM on tensor cores (after matmul_common.wgsl; the matrix interface,
// matrix/cooperative.wgsl or matrix/portable.wgsl, appended by the host). A workgroup computes a
// TILE_M x TILE_N output tile with GROUPS_M x GROUPS_N tile groups (subgroups in the tensor-core
// build), each owning TM x TN 16x16 accumulator tiles (f32); the host declares those four and the
// staging counts LOADS_A, LOADS_B as module constants (64 x 64: 2 x 2 groups of 2 x 2 tiles;
// 128 x 128: 2 x 4 groups of 4 x 2 tiles). Per 32-deep k tile, A [TILE_M x 32] and B [32 x TILE_N]
// are staged in workgroup memory rounded to MatElem (f16: an f32 operand loses its low bits, an f16
// one nothing), and each group runs TM x TN x 2 16x16x16 multiply-adds with f32 accumulation. The
// next k tile is read into registers before the products of this one (software pipelining: the
// reads are in flight while the tensor cores work), so one staging buffer serves. The
// accumulators go out tile by tile through each group's 16 x 16 slice of workgroup memory to
// matmul_common.wgsl's `store`, so the epilogues (alpha, bias, accumulate, activation, residual)
// are the other kernels'. ROW_SUMS adds each row of A in k order from A as stored (not the rounded
// tile). Rows, columns and k past m, n and k are staged as zeros and not stored.

override SG: u32 = 32u;
const GROUPS: u32 = GROUPS_M * GROUPS_N;
override WG: u32 = GROUPS * SG;

const TILE_M: u32 = GROUPS_M * TM * 16u;
const TILE_N: u32 = GROUPS_N * TN * 16u;
const TILE_K: u32 = 32u;
// Row strides of the staged tiles, 16 bytes past the rows' length (bank conflicts, as in the
// attention's tensor-core kernels): A [TILE_M x TILE_K] at 0, B [TILE_K x TILE_N] at B_AT.
const AS: u32 = TILE_K + 8u;
const BS: u32 = TILE_N + 8u;
const B_AT: u32 = TILE_M * AS;
var<workgroup> mat_mem: array<MatElem, B_AT + TILE_K * BS>;
// Each group's 16 x 16 f32 slice on the accumulators' way out, rows CS apart.
const CS: u32 = 16u + 4u;
var<workgroup> acc_mem: array<f32, GROUPS * 16u * CS>;

// Element t (< TILE_M x TILE_K) of the A tile at k0 for this invocation's staging: its row and k.
// Neighbouring invocations read neighbouring addresses (coalesced): along k when A is contiguous
// in k, else along rows.
fn a_element(t: u32, k_major: bool) -> vec2<u32> {
    return select(vec2(t % TILE_M, t / TILE_M), vec2(t / TILE_K, t % TILE_K), k_major);
}

// Element t (< TILE_K x TILE_N) of the B tile: its column and k, along k when B is contiguous in k.
fn b_element(t: u32, k_major: bool) -> vec2<u32> {
    return select(vec2(t % TILE_N, t / TILE_N), vec2(t / TILE_K, t % TILE_K), k_major);
}

// The k tile `kt` (k tiles of every group g in order) of A and B, read into registers: invocation
// lid holds elements lid + u WG of each. Branch-free: an element past m, n or k reads the operand's
// first element (which exists: the dispatch has rows and k) and keeps zero, so the reads of a tile
// issue back to back.
fn read_k_tile(
    a_next: ptr<function, array<MatElem, LOADS_A>>,
    b_next: ptr<function, array<MatElem, LOADS_B>>,
    kt: u32,
    k_tiles: u32,
    lid: u32,
    bi: u32,
    h: u32,
    m0: u32,
    n0: u32,
) {
    let g = kt / k_tiles;
    let k0 = (kt % k_tiles) * TILE_K;
    let a = gp.a;
    let b = gp.b;
    let a_base = base(a, bi, h, g);
    let b_base = base(b, bi, h, g);
    let a_k_major = a.stride_col == 1u;
    let b_k_major = b.stride_row == 1u;
    for (var u = 0u; u < LOADS_A; u++) {
        let e = a_element(lid + u * WG, a_k_major);
        let inside = lid + u * WG < TILE_M * TILE_K && m0 + e.x < gp.m && k0 + e.y < gp.k;
        let at = (m0 + e.x) * a.stride_row + (k0 + e.y) * a.stride_col;
        let x = a_value(a_base + select(0u, at, inside));
        (*a_next)[u] = MatElem(select(0.0, x, inside));
    }
    for (var u = 0u; u < LOADS_B; u++) {
        let e = b_element(lid + u * WG, b_k_major);
        let inside = lid + u * WG < TILE_K * TILE_N && n0 + e.x < gp.n && k0 + e.y < gp.k;
        let at = (k0 + e.y) * b.stride_row + (n0 + e.x) * b.stride_col;
        let y = b_value(b_base + select(0u, at, inside));
        (*b_next)[u] = MatElem(select(0.0, y, inside));
    }
}

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
    // This tile group's part of the output tile.
    let tile_group = lid / SG;
    let rows_at = TM * 16u * (tile_group / GROUPS_N);
    let cols_at = TN * 16u * (tile_group % GROUPS_N);
    var acc: array<TileC, TM * TN>;
    for (var c = 0u; c < TM * TN; c++) {
        acc[c] = mat_zero();
    }
    // ROW_SUMS: invocation lid < TILE_M sums row lid over every k tile, in k order.
    var row_sum = 0.0;
    let sums = ROW_SUMS && n0 == 0u;
    let a_k_major = gp.a.stride_col == 1u;
    let b_k_major = gp.b.stride_row == 1u;
    let k_tiles = (gp.k + TILE_K - 1u) / TILE_K;
    let all_tiles = gp.groups * k_tiles;

    var a_next: array<MatElem, LOADS_A>;
    var b_next: array<MatElem, LOADS_B>;
    if all_tiles > 0u {
        read_k_tile(&a_next, &b_next, 0u, k_tiles, lid, bi, h, m0, n0);
    }
    for (var kt = 0u; kt < all_tiles; kt++) {
        // The previous k tile's products have read the staged tiles.
        workgroupBarrier();
        for (var u = 0u; u < LOADS_A; u++) {
            let t = lid + u * WG;
            if t < TILE_M * TILE_K {
                let e = a_element(t, a_k_major);
                mat_mem[e.x * AS + e.y] = a_next[u];
            }
        }
        for (var u = 0u; u < LOADS_B; u++) {
            let t = lid + u * WG;
            if t < TILE_K * TILE_N {
                let e = b_element(t, b_k_major);
                mat_mem[B_AT + e.y * BS + e.x] = b_next[u];
            }
        }
        workgroupBarrier();
        if kt + 1u < all_tiles {
            read_k_tile(&a_next, &b_next, kt + 1u, k_tiles, lid, bi, h, m0, n0);
        }
        for (var kk = 0u; kk < TILE_K; kk += 16u) {
            var b_tiles: array<TileB, TN>;
            for (var j = 0u; j < TN; j++) {
                b_tiles[j] = mat_load_b(B_AT + kk * BS + cols_at + 16u * j, BS);
            }
            for (var i = 0u; i < TM; i++) {
                let a_tile = mat_load_a((rows_at + 16u * i) * AS + kk, AS);
                for (var j = 0u; j < TN; j++) {
                    acc[i * TN + j] = mat_mma(a_tile, b_tiles[j], acc[i * TN + j]);
                }
            }
        }
        // The row sums read A again, in f32 and k order (the staged tile is rounded).
        if sums && lid < TILE_M && m0 + lid < gp.m {
            let g = kt / k_tiles;
            let k0 = (kt % k_tiles) * TILE_K;
            let row = base(gp.a, bi, h, g) + (m0 + lid) * gp.a.stride_row;
            for (var kk = k0; kk < min(k0 + TILE_K, gp.k); kk++) {
                row_sum += f32(a_buf[row + kk * gp.a.stride_col]);
            }
        }
    }

    if sums && lid < TILE_M && bi == 0u && h == 0u {
        store_row_sum(m0 + lid, row_sum);
    }
    let c_base = base(gp.c, bi, h, 0u);
    let slice = tile_group * 16u * CS;
    let lane = lid % SG;
    for (var i = 0u; i < TM; i++) {
        for (var j = 0u; j < TN; j++) {
            // Every group has the same tiles, so the barriers are uniform: the previous tile is
            // out of this group's slice.
            workgroupBarrier();
            mat_store(acc[i * TN + j], slice, CS);
            workgroupBarrier();
            for (var e = lane; e < 256u; e += SG) {
                let row = m0 + rows_at + 16u * i + e / 16u;
                let col = n0 + cols_at + 16u * j + e % 16u;
                if row < gp.m && col < gp.n {
                    store(c_base, row, col, acc_mem[slice + (e / 16u) * CS + e % 16u]);
                }
            }
        }
    }
}
