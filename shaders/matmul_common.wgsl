// Shared by the strided GEMM kernels (matmul_strided.wgsl: 64 x 64 tiles and the SKINNY path;
// matmul_wide.wgsl: 128 x 64 tiles), after activation_common.wgsl:
//   C[z, m, n] = alpha * sum_{g < groups} sum_k A[z, g, m, k] * B[z, g, k, n]
// Batch z = (b, h) with h < heads. Every operand is addressed by strides, so transposes, BSHD head
// views and the grouped-query head mapping (operand head = h / head_div) are indexing, not copies; the
// sum over g reduces the query heads that share a kv head in the backward pass.
// Epilogues (Linear layers), applied to each element z = alpha * sum (+ C when accumulating) in this
// order, each saving a pass and a round trip through memory:
//   bias       z += bias[col]
//   act grad   z *= act'(pre[i])              (the input gradient through the activation before)
//   act        pre[i] = z; z = act(z)         (the forward activation; pre is what its backward reads)
//   residual   z += residual[i]               (the residual connection around a sublayer)
// with i the element's index in C (pre and residual are laid out as C).
// ROW_SUMS (a pipeline variant of the tiled kernels) also writes row_sums[m] = sum over g and k of
// A[0, g, m, k] (batch entry 0, without alpha) from the A tiles the product stages anyway, adding k in
// order as column_sum.wgsl adds rows: the bias gradient of a Linear layer inside its dW product, one
// dispatch less. The first column of tiles writes it (adding to it when accumulating).

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
    // An ACT_* code: the activation epilogue (0: none).
    activation: u32,
    // 1: the activation epilogue multiplies by act'(pre) instead of applying act.
    activation_grad: u32,
    // 1: add residual[i].
    has_residual: u32,
    _pad: u32,
    a: Operand,
    b: Operand,
    c: Operand,
}

@group(0) @binding(0) var<uniform> gp: GemmParams;
// GemmA, GemmB (A, B) and GemmOut (C) are f32, or f16 where the adapter has SHADER_F16 (aliased by
// the host before this header, with `operand`); arithmetic, bias, pre and residual are f32.
@group(0) @binding(1) var<storage, read> a_buf: array<GemmA>;
@group(0) @binding(2) var<storage, read> b_buf: array<GemmB>;
@group(0) @binding(3) var<storage, read_write> c_buf: array<GemmOut>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read> residual: array<f32>;
@group(0) @binding(6) var<storage, read_write> pre: array<f32>;
@group(0) @binding(7) var<storage, read_write> row_sums: array<f32>;

override ROW_SUMS: bool = false;

// A's and B's elements as the products take them: `operand` is the identity, or in the
// mixed-precision builds the rounding to f16 that tensor cores apply (SPEC.md, mixed precision).
fn a_value(i: u32) -> f32 {
    return operand(f32(a_buf[i]));
}

fn b_value(i: u32) -> f32 {
    return operand(f32(b_buf[i]));
}

fn base(op: Operand, bi: u32, h: u32, g: u32) -> u32 {
    return op.offset + bi * op.stride_b + (h / op.head_div) * op.stride_h + g * op.stride_g;
}

// The output tile of workgroup `group` (tiles of tile_m x tile_n, tiles_n per row of tiles, then
// batch entries): its batch index, head, first row and first column.
struct Tile {
    bi: u32,
    h: u32,
    m0: u32,
    n0: u32,
}

fn tile_of(group: u32, tile_m: u32, tile_n: u32) -> Tile {
    let tiles = gp.tiles_m * gp.tiles_n;
    let z = group / tiles;
    let tile = group % tiles;
    return Tile(z / gp.heads, z % gp.heads, (tile / gp.tiles_n) * tile_m, (tile % gp.tiles_n) * tile_n);
}

// The row sums of four rows of A (rows past m are not written), by the invocation that owns them in
// the first column of tiles.
fn store_row_sums(row0: u32, row_step: u32, sums: vec4<f32>) {
    for (var r = 0u; r < 4u; r++) {
        store_row_sum(row0 + r * row_step, sums[r]);
    }
}

// One row's sum, added to an earlier dispatch's when accumulating; none past m.
fn store_row_sum(row: u32, sum: f32) {
    if row < gp.m {
        var value = sum;
        if gp.accumulate != 0u {
            value += row_sums[row];
        }
        row_sums[row] = value;
    }
}

// One element of C: alpha, bias, accumulate, then the activation and residual epilogues.
fn store(c_base: u32, row: u32, col: u32, acc: f32) {
    var value = gp.alpha * acc;
    if gp.has_bias != 0u {
        value += bias[col];
    }
    let index = c_base + row * gp.c.stride_row + col * gp.c.stride_col;
    if gp.accumulate != 0u {
        value += f32(c_buf[index]);
    }
    if gp.activation != ACT_NONE {
        if gp.activation_grad != 0u {
            value *= activation_derivative(gp.activation, pre[index]);
        } else {
            pre[index] = value;
            value = activation_value(gp.activation, value);
        }
    }
    if gp.has_residual != 0u {
        value += residual[index];
    }
    c_buf[index] = GemmOut(value);
}

