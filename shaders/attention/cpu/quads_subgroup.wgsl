// Reads of the CPU-driver kernels' staged tiles through subgroup broadcasts (Features::SUBGROUP with
// a fixed subgroup size of 8: lavapipe on AVX2; the host checks). Its twin,
// attention/cpu/quads_workgroup.wgsl, reads the same values from workgroup memory and gives the same
// bits.
//
// Why: a CPU driver runs the eight invocations of a subgroup as the lanes of one SIMD register, and
// llvmpipe (Mesa 22.3) loads from workgroup memory lane by lane, even where every lane reads the same
// address, as every invocation does here (they own different rows or keys and read the same staged
// ones). Lane l loads one vec4 of a quad instead (row l / 2, dims 4 (l % 2) .. + 3) and eight
// broadcasts from constant lanes, register shuffles, hand every invocation all 32 values: one load
// loop where there were eight.

// The quad layout's subgroup size: the pipeline key and label say which build a kernel runs.
override SUBGROUP: u32 = 8u;

struct QuadIds {
    @builtin(local_invocation_index) index: u32,
    @builtin(subgroup_invocation_id) lane: u32,
}

var<private> quad_lane: u32;

// Called first by the kernel.
fn quad_init(ids: QuadIds) {
    quad_lane = ids.lane;
}

// Rows row .. row + 3 by dims 8 d8 .. 8 d8 + 7 of tile_qk (row stride DK4P vec4s). Called in
// subgroup-uniform control flow (every lane active), with row + 3 inside the tile.
fn qk_quad(row: u32, d8: u32) -> Quad {
    return broadcast_quad(tile_qk[(row + quad_lane / 2u) * DK4P + 2u * d8 + quad_lane % 2u]);
}

// The same of tile_vo (row stride DV4P).
fn vo_quad(row: u32, d8: u32) -> Quad {
    return broadcast_quad(tile_vo[(row + quad_lane / 2u) * DV4P + 2u * d8 + quad_lane % 2u]);
}

fn broadcast_quad(x: vec4<f32>) -> Quad {
    return Quad(
        subgroupBroadcast(x, 0u),
        subgroupBroadcast(x, 1u),
        subgroupBroadcast(x, 2u),
        subgroupBroadcast(x, 3u),
        subgroupBroadcast(x, 4u),
        subgroupBroadcast(x, 5u),
        subgroupBroadcast(x, 6u),
        subgroupBroadcast(x, 7u),
    );
}

// A branch condition around quad reads: the subgroup takes the branch together (a broadcast needs
// every lane) when every lane's condition holds.
fn quad_all(x: bool) -> bool {
    return subgroupAll(x);
}
