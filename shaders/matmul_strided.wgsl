// Batched strided matrix product, the building block of the unfused attention baseline:
//   C[z, m, n] = alpha * sum_{g < groups} sum_k A[z, g, m, k] * B[z, g, k, n]
// Batch z = (b, h) with h < heads. Every operand is addressed by strides, so transposes, BSHD head
// views and the grouped-query head mapping (operand head = h / head_div) are indexing, not copies; the
// sum over g reduces the query heads that share a kv head in the backward pass.
// A 16x16 workgroup computes a 64x64 tile of C, each invocation a 4x4 register tile. An optional
// bias epilogue adds bias[col] (Linear layers).

struct Operand {
    offset: u32,
    stride_b: u32,
    stride_h: u32,
    head_div: u32,
    stride_g: u32,
    stride_row: u32,
    stride_col: u32,
    _pad: u32,
}

struct GemmParams {
    m: u32,
    n: u32,
    k: u32,
    groups: u32,
    heads: u32,
    tiles_m: u32,
    tiles_n: u32,
    grid_x: u32,
    total_groups: u32,
    alpha: f32,
    // 1: add bias[col] to every row of C after scaling (the Linear layer's bias epilogue).
    has_bias: u32,
    // 1: add to C instead of overwriting it (a reduction split into several dispatches).
    accumulate: u32,
    a: Operand,
    b: Operand,
    c: Operand,
}

const TILE: u32 = 64u;
const TILE_K: u32 = 16u;

@group(0) @binding(0) var<uniform> gp: GemmParams;
@group(0) @binding(1) var<storage, read> a_buf: array<f32>;
@group(0) @binding(2) var<storage, read> b_buf: array<f32>;
@group(0) @binding(3) var<storage, read_write> c_buf: array<f32>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;

var<workgroup> a_tile: array<f32, 1024>; // [TILE_K][TILE]: a_tile[kk * TILE + row]
var<workgroup> b_tile: array<f32, 1024>; // [TILE_K][TILE]: b_tile[kk * TILE + col]

fn base(op: Operand, bi: u32, h: u32, g: u32) -> u32 {
    return op.offset + bi * op.stride_b + (h / op.head_div) * op.stride_h + g * op.stride_g;
}

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {
    let group = wg.y * gp.grid_x + wg.x;
    if group >= gp.total_groups {
        return;
    }
    let tiles = gp.tiles_m * gp.tiles_n;
    let z = group / tiles;
    let tile = group % tiles;
    let m0 = (tile / gp.tiles_n) * TILE;
    let n0 = (tile % gp.tiles_n) * TILE;
    let bi = z / gp.heads;
    let h = z % gp.heads;
    let tx = lid3.x;
    let ty = lid3.y;
    let lid = ty * 16u + tx;

    var acc: array<array<f32, 4>, 4>;
    for (var g = 0u; g < gp.groups; g++) {
        let a_base = base(gp.a, bi, h, g);
        let b_base = base(gp.b, bi, h, g);
        for (var k0 = 0u; k0 < gp.k; k0 += TILE_K) {
            workgroupBarrier();
            for (var t = lid; t < TILE * TILE_K; t += 256u) {
                // A tile: row = t % TILE, kk = t / TILE.
                let row = m0 + t % TILE;
                let kk = k0 + t / TILE;
                var x = 0.0;
                if row < gp.m && kk < gp.k {
                    x = a_buf[a_base + row * gp.a.stride_row + kk * gp.a.stride_col];
                }
                a_tile[t] = x;
                let col = n0 + t % TILE;
                var y = 0.0;
                if col < gp.n && kk < gp.k {
                    y = b_buf[b_base + kk * gp.b.stride_row + col * gp.b.stride_col];
                }
                b_tile[t] = y;
            }
            workgroupBarrier();
            for (var kk = 0u; kk < TILE_K; kk++) {
                var av: array<f32, 4>;
                var bv: array<f32, 4>;
                for (var r = 0u; r < 4u; r++) {
                    av[r] = a_tile[kk * TILE + ty + r * 16u];
                    bv[r] = b_tile[kk * TILE + tx + r * 16u];
                }
                for (var r = 0u; r < 4u; r++) {
                    for (var c = 0u; c < 4u; c++) {
                        acc[r][c] += av[r] * bv[c];
                    }
                }
            }
        }
    }

    let c_base = base(gp.c, bi, h, 0u);
    for (var r = 0u; r < 4u; r++) {
        let row = m0 + ty + r * 16u;
        for (var c = 0u; c < 4u; c++) {
            let col = n0 + tx + c * 16u;
            if row < gp.m && col < gp.n {
                var value = gp.alpha * acc[r][c];
                if gp.has_bias != 0u {
                    value += bias[col];
                }
                let index = c_base + row * gp.c.stride_row + col * gp.c.stride_col;
                if gp.accumulate != 0u {
                    value += c_buf[index];
                }
                c_buf[index] = value;
            }
        }
    }
}
