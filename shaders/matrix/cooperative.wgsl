// The matrix interface, tensor-core build: 16x16 tiles held jointly by a subgroup as wgpu 30's
// cooperative matrices (`enable wgpu_cooperative_matrix;`, which the host puts first in the module).
// A and B tiles are MatElem (f16), accumulators f32. A and B loads read the kernel's `mat_mem`
// workgroup array, accumulator loads and stores its `acc_mem`; `at` is an element offset, `stride`
// the row stride in elements (both 16-byte steps: multiples of 8 for f16, 4 for f32). Every call
// must be made by the whole subgroup in uniform control flow. matrix/portable.wgsl has the same
// functions in ordinary arithmetic: nothing else differs between the two builds.

alias TileA = coop_mat16x16<MatElem, A>;
alias TileB = coop_mat16x16<MatElem, B>;
alias TileC = coop_mat16x16<f32, C>;

// Nothing to remember: the hardware knows each lane's share of a tile.
fn mat_init(lane: u32) {}

fn mat_zero() -> TileC {
    return TileC();
}

// Rows `at + r * stride` of 16 elements: the tile as stored.
fn mat_load_a(at: u32, stride: u32) -> TileA {
    return coopLoadT<TileA>(&mat_mem[at], stride);
}

fn mat_load_b(at: u32, stride: u32) -> TileB {
    return coopLoadT<TileB>(&mat_mem[at], stride);
}

// The transpose of the A tile stored at `at` (A[r][k] = mat_mem[at + k * stride + r]): dS from dS^T
// rows.
fn mat_load_a_transposed(at: u32, stride: u32) -> TileA {
    return coopLoad<TileA>(&mat_mem[at], stride);
}

// The transpose of the tile stored at `at` (B[k][n] = mat_mem[at + n * stride + k]): K^T from K rows.
fn mat_load_b_transposed(at: u32, stride: u32) -> TileB {
    return coopLoad<TileB>(&mat_mem[at], stride);
}

// An accumulator tile from `acc_mem`, rows `at + r * stride` as stored.
fn mat_load_c(at: u32, stride: u32) -> TileC {
    return coopLoadT<TileC>(&acc_mem[at], stride);
}

fn mat_mma(a: TileA, b: TileB, c: TileC) -> TileC {
    return coopMultiplyAdd(a, b, c);
}

fn mat_store(c: TileC, at: u32, stride: u32) {
    coopStoreT(c, &acc_mem[at], stride);
}
