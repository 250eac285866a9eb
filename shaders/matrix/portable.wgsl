// The matrix interface, portable build: the functions of matrix/cooperative.wgsl in ordinary arithmetic, so
// the tensor-core kernels' tiling, masks and softmax run (and are tested) on any adapter. As with a
// cooperative matrix, a tile is one value for a group of SG invocations (the kernel's tile group,
// a subgroup in the tensor-core build): each invocation computes and stores the accumulator
// elements `mat_lane`, `mat_lane + SG`, ... (`mat_lane`: its index in the group). A loaded A or B
// tile is a view of `mat_mem`, read when it is multiplied: kernels multiply a tile before anything
// writes its memory (as they must before any barrier anyway), so this is the copy semantics of the
// tensor-core build; an accumulator tile is read when loaded. f32 arithmetic on
// MatElem values (f16, or f32 where the device has no f16): each product is exact in f32, as the
// tensor cores' f16 x f16 products are, and sums are f32 in both builds.

// A view of a 16 x 16 tile: element (r, c) at mat_mem[at + r * row + c * col].
struct TileView {
    at: u32,
    row: u32,
    col: u32,
}

alias TileA = TileView;
alias TileB = TileView;

// This invocation's accumulator elements (e = mat_lane + SG * slot, row e / 16, column e % 16), of
// MAT_SLOTS (declared by the pipeline's key: 256 / SG per tile).
struct TileC {
    e: array<f32, MAT_SLOTS>,
}

// This invocation's index in its tile group.
var<private> mat_lane: u32;

fn mat_init(lane: u32) {
    mat_lane = lane;
}

fn mat_zero() -> TileC {
    return TileC();
}

fn mat_load_a(at: u32, stride: u32) -> TileA {
    return TileView(at, stride, 1u);
}

fn mat_load_b(at: u32, stride: u32) -> TileB {
    return TileView(at, stride, 1u);
}

fn mat_load_a_transposed(at: u32, stride: u32) -> TileA {
    return TileView(at, 1u, stride);
}

fn mat_load_b_transposed(at: u32, stride: u32) -> TileB {
    return TileView(at, 1u, stride);
}

fn mat_load_c(at: u32, stride: u32) -> TileC {
    var c: TileC;
    var slot = 0u;
    for (var e = mat_lane; e < 256u; e += SG) {
        c.e[slot] = acc_mem[at + (e / 16u) * stride + e % 16u];
        slot++;
    }
    return c;
}

fn mat_mma(a: TileA, b: TileB, c: TileC) -> TileC {
    var out = c;
    var slot = 0u;
    for (var e = mat_lane; e < 256u; e += SG) {
        let r = e / 16u;
        let n = e % 16u;
        var sum = out.e[slot];
        for (var k = 0u; k < 16u; k++) {
            sum += f32(mat_mem[a.at + r * a.row + k * a.col]) * f32(mat_mem[b.at + k * b.row + n * b.col]);
        }
        out.e[slot] = sum;
        slot++;
    }
    return out;
}

fn mat_store(c: TileC, at: u32, stride: u32) {
    var slot = 0u;
    for (var e = mat_lane; e < 256u; e += SG) {
        acc_mem[at + (e / 16u) * stride + e % 16u] = c.e[slot];
        slot++;
    }
}
