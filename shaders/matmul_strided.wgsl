// The strided GEMM (after matmul_common.wgsl): a 16x16 workgroup computes a 64x64 tile of C, each
// invocation a 4x4 register tile.
// SKINNY (products with a few rows, e.g. a decoding step's tokens): each invocation computes one
// element of C, 256 consecutive elements per workgroup, no tiles (a 64-row tile would be mostly
// padding).

const TILE: u32 = 64u;
const TILE_K: u32 = 16u;

override SKINNY: bool = false;

var<workgroup> a_tile: array<f32, 1024>; // [TILE_K][TILE]: a_tile[kk * TILE + row]
var<workgroup> b_tile: array<f32, 1024>; // [TILE_K][TILE]: b_tile[kk * TILE + col]

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let group = wg.y * gp.grid_x + wg.x;
    if group >= gp.total_groups {
        return;
    }
    if SKINNY {
        skinny(group, lid3.y * 16u + lid3.x);
        return;
    }
    let at = tile_of(group, TILE, TILE);
    let bi = at.bi;
    let h = at.h;
    let m0 = at.m0;
    let n0 = at.n0;
    let tx = lid3.x;
    let ty = lid3.y;
    let lid = ty * 16u + tx;

    // Row r of the invocation's 4x4 tile is acc[r], its columns the vec4 lanes: no dynamically
    // indexed private array, so GPU compilers keep the tile in registers (an indexed
    // array<array<f32, 4>, 4> ran at 0.16 TFLOP/s on an H100).
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    // Rows ty + 16 r of A summed over k (ROW_SUMS).
    var row_sum = vec4<f32>(0.0);
    for (var g = 0u; g < gp.groups; g++) {
        let a_base = base(gp.a, bi, h, g);
        let b_base = base(gp.b, bi, h, g);
        for (var k0 = 0u; k0 < gp.k; k0 += TILE_K) {
            workgroupBarrier();
            for (var t = lid; t < TILE * TILE_K; t += 256u) {
                // Neighbouring invocations read neighbouring addresses (coalesced on GPUs): along k
                // when the operand is contiguous in k (x in x W^T, W in dy W), else along rows/cols.
                let a_k_major = gp.a.stride_col == 1u;
                let a_row = select(t % TILE, t / TILE_K, a_k_major);
                let a_kk = select(t / TILE, t % TILE_K, a_k_major);
                let row = m0 + a_row;
                var x = 0.0;
                if row < gp.m && k0 + a_kk < gp.k {
                    x = f32(a_buf[a_base + row * gp.a.stride_row + (k0 + a_kk) * gp.a.stride_col]);
                }
                a_tile[a_kk * TILE + a_row] = x;
                let b_k_major = gp.b.stride_row == 1u;
                let b_col = select(t % TILE, t / TILE_K, b_k_major);
                let b_kk = select(t / TILE, t % TILE_K, b_k_major);
                let col = n0 + b_col;
                var y = 0.0;
                if col < gp.n && k0 + b_kk < gp.k {
                    y = f32(b_buf[b_base + (k0 + b_kk) * gp.b.stride_row + col * gp.b.stride_col]);
                }
                b_tile[b_kk * TILE + b_col] = y;
            }
            workgroupBarrier();
            for (var kk = 0u; kk < TILE_K; kk++) {
                let a_at = kk * TILE + ty;
                let b_at = kk * TILE + tx;
                let av = vec4<f32>(a_tile[a_at], a_tile[a_at + 16u], a_tile[a_at + 32u], a_tile[a_at + 48u]);
                let bv = vec4<f32>(b_tile[b_at], b_tile[b_at + 16u], b_tile[b_at + 32u], b_tile[b_at + 48u]);
                acc0 += av.x * bv;
                acc1 += av.y * bv;
                acc2 += av.z * bv;
                acc3 += av.w * bv;
                // Only the first column of tiles writes the sums: a workgroup-uniform branch.
                if ROW_SUMS && n0 == 0u {
                    row_sum += av;
                }
            }
        }
    }

    if ROW_SUMS && n0 == 0u && tx == 0u && bi == 0u && h == 0u {
        store_row_sums(m0 + ty, 16u, row_sum);
    }
    let c_base = base(gp.c, bi, h, 0u);
    store_row(c_base, m0 + ty, n0 + tx, acc0);
    store_row(c_base, m0 + ty + 16u, n0 + tx, acc1);
    store_row(c_base, m0 + ty + 32u, n0 + tx, acc2);
    store_row(c_base, m0 + ty + 48u, n0 + tx, acc3);
}

// One element of C per invocation: groups (tiles_n per batch entry z) of 256 consecutive (row, col).
fn skinny(group: u32, lid: u32) {
    let z = group / gp.tiles_n;
    let t = (group % gp.tiles_n) * 256u + lid;
    if t >= gp.m * gp.n {
        return;
    }
    let row = t / gp.n;
    let col = t % gp.n;
    let bi = z / gp.heads;
    let h = z % gp.heads;
    var acc = 0.0;
    for (var g = 0u; g < gp.groups; g++) {
        let a_at = base(gp.a, bi, h, g) + row * gp.a.stride_row;
        let b_at = base(gp.b, bi, h, g) + col * gp.b.stride_col;
        for (var k = 0u; k < gp.k; k++) {
            acc += f32(a_buf[a_at + k * gp.a.stride_col]) * f32(b_buf[b_at + k * gp.b.stride_row]);
        }
    }
    store(base(gp.c, bi, h, 0u), row, col, acc);
}

// Columns col0 + 16 c (c < 4) of one output row, through store.
fn store_row(c_base: u32, row: u32, col0: u32, acc: vec4<f32>) {
    if row >= gp.m {
        return;
    }
    for (var c = 0u; c < 4u; c++) {
        let col = col0 + c * 16u;
        if col < gp.n {
            store(c_base, row, col, acc[c]);
        }
    }
}
