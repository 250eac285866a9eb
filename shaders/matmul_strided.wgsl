// The strided GEMM (after matmul_common.wgsl): a 16x16 workgroup computes a 64x64 tile of C, each
// invocation a 4x4 register tile.
// SKINNY (products with at most 8 rows, e.g. a decoding step's tokens; no tiles, as a 64-row tile
// would be mostly padding), in two forms:
// - per element (CPU drivers): each invocation computes one element of C over all of k, 256
//   consecutive elements per workgroup;
// - SKINNY_SPLIT (GPUs, where that form waits on one load after another): a workgroup owns
//   256 / K_LANES columns of C for every row, and
//   K_LANES invocations split each column's k range, each B element read once for all rows; the
//   lanes' sums meet in workgroup memory in a fixed tree order. K_FAST lays lanes out along k
//   (neighbouring invocations read neighbouring k: coalesced when B is contiguous in k, as W^T of
//   a Linear layer is), else along columns. (On lavapipe it is the slower form; figures in
//   benchmarks/HISTORY.md, "Figures that code comments carried".)

const TILE: u32 = 64u;
const TILE_K: u32 = 16u;

override SKINNY: bool = false;
override SKINNY_SPLIT: bool = false;
// SKINNY_SPLIT's lanes per column (a power of two dividing 256) and their layout.
override K_LANES: u32 = 32u;
override K_FAST: bool = true;

var<workgroup> a_tile: array<f32, 1024>; // [TILE_K][TILE]: a_tile[kk * TILE + row]
var<workgroup> b_tile: array<f32, 1024>; // [TILE_K][TILE]: b_tile[kk * TILE + col]

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let group = wg.y * gp.grid_x + wg.x;
    if group >= gp.total_groups {
        return;
    }
    if SKINNY {
        if SKINNY_SPLIT {
            skinny_split(group, lid3.y * 16u + lid3.x);
        } else {
            skinny_per_element(group, lid3.y * 16u + lid3.x);
        }
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
    // array<array<f32, 4>, 4> was the slow form on an H100: benchmarks/HISTORY.md).
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
                    x = a_value(a_base + row * gp.a.stride_row + (k0 + a_kk) * gp.a.stride_col);
                }
                a_tile[a_kk * TILE + a_row] = x;
                let b_k_major = gp.b.stride_row == 1u;
                let b_col = select(t % TILE, t / TILE_K, b_k_major);
                let b_kk = select(t / TILE, t % TILE_K, b_k_major);
                let col = n0 + b_col;
                var y = 0.0;
                if col < gp.n && k0 + b_kk < gp.k {
                    y = b_value(b_base + (k0 + b_kk) * gp.b.stride_row + col * gp.b.stride_col);
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
fn skinny_per_element(group: u32, lid: u32) {
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
            acc += a_value(a_at + k * gp.a.stride_col) * b_value(b_at + k * gp.b.stride_row);
        }
    }
    store(base(gp.c, bi, h, 0u), row, col, acc);
}

// SKINNY_SPLIT: workgroups (tiles_n per batch entry z) of 256 / K_LANES columns, all rows.
fn skinny_split(group: u32, lid: u32) {
    let columns = 256u / K_LANES;
    let z = group / gp.tiles_n;
    var lane = lid / columns;
    var column = lid % columns;
    if K_FAST {
        lane = lid % K_LANES;
        column = lid / K_LANES;
    }
    let col = (group % gp.tiles_n) * columns + column;
    let bi = z / gp.heads;
    let h = z % gp.heads;
    // Invocations past the last column read its values and store nothing: every invocation
    // reaches the barriers below.
    let read_col = min(col, gp.n - 1u);
    // Rows 0-3 and 4-7 of C in the vec4 lanes: rows 0-3 are read only below m, rows 4-7 together
    // once m > 4 (rows past m repeat the last row there, unstored).
    var acc_lo = vec4<f32>(0.0);
    var acc_hi = vec4<f32>(0.0);
    let rows_lo = vec4<u32>(0u, 1u, 2u, 3u);
    let rows_hi = min(vec4<u32>(4u, 5u, 6u, 7u), vec4<u32>(gp.m - 1u));
    for (var g = 0u; g < gp.groups; g++) {
        let a_base = base(gp.a, bi, h, g);
        let a_lo = vec4<u32>(a_base) + rows_lo * gp.a.stride_row;
        let a_hi = vec4<u32>(a_base) + rows_hi * gp.a.stride_row;
        let b_at = base(gp.b, bi, h, g) + read_col * gp.b.stride_col;
        for (var k = lane; k < gp.k; k += K_LANES) {
            let bk = b_value(b_at + k * gp.b.stride_row);
            let ak = k * gp.a.stride_col;
            // Uniform branches: a decoding step has one row.
            acc_lo.x += a_value(a_lo.x + ak) * bk;
            if gp.m > 1u {
                acc_lo.y += a_value(a_lo.y + ak) * bk;
            }
            if gp.m > 2u {
                acc_lo.z += a_value(a_lo.z + ak) * bk;
            }
            if gp.m > 3u {
                acc_lo.w += a_value(a_lo.w + ak) * bk;
            }
            if gp.m > 4u {
                let a8 = vec4<f32>(
                    a_value(a_hi.x + ak),
                    a_value(a_hi.y + ak),
                    a_value(a_hi.z + ak),
                    a_value(a_hi.w + ak),
                );
                acc_hi += a8 * bk;
            }
        }
    }
    // The lanes of a column: slot column * K_LANES + lane of the staging tiles (a_tile rows 0-3,
    // b_tile rows 4-7), halved in a fixed order.
    let slot = (column * K_LANES + lane) * 4u;
    for (var r = 0u; r < 4u; r++) {
        a_tile[slot + r] = acc_lo[r];
        b_tile[slot + r] = acc_hi[r];
    }
    workgroupBarrier();
    for (var half = K_LANES / 2u; half > 0u; half >>= 1u) {
        if lane < half {
            let other = slot + half * 4u;
            for (var r = 0u; r < 4u; r++) {
                a_tile[slot + r] += a_tile[other + r];
                b_tile[slot + r] += b_tile[other + r];
            }
        }
        workgroupBarrier();
    }
    if lane != 0u || col >= gp.n {
        return;
    }
    let c_base = base(gp.c, bi, h, 0u);
    for (var r = 0u; r < min(gp.m, 4u); r++) {
        store(c_base, r, col, a_tile[slot + r]);
    }
    for (var r = 4u; r < gp.m; r++) {
        store(c_base, r, col, b_tile[slot + r - 4u]);
    }
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
