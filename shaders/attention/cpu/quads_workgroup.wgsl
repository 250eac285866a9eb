// Reads of the CPU-driver kernels' staged tiles from workgroup memory, every invocation its own: the
// build for devices without a fixed subgroup size of 8 (wgpu's GL back end, SwiftShader, GPUs). Its
// twin, attention/cpu/quads_subgroup.wgsl, says why the other exists; both give the same bits.

struct QuadIds {
    @builtin(local_invocation_index) index: u32,
}

fn quad_init(ids: QuadIds) {}

// Rows row .. row + 3 by dims 8 d8 .. 8 d8 + 7 of tile_qk (row stride DK4P vec4s).
fn qk_quad(row: u32, d8: u32) -> Quad {
    let t = row * DK4P + 2u * d8;
    return Quad(
        tile_qk[t],
        tile_qk[t + 1u],
        tile_qk[t + DK4P],
        tile_qk[t + DK4P + 1u],
        tile_qk[t + 2u * DK4P],
        tile_qk[t + 2u * DK4P + 1u],
        tile_qk[t + 3u * DK4P],
        tile_qk[t + 3u * DK4P + 1u],
    );
}

// The same of tile_vo (row stride DV4P).
fn vo_quad(row: u32, d8: u32) -> Quad {
    let t = row * DV4P + 2u * d8;
    return Quad(
        tile_vo[t],
        tile_vo[t + 1u],
        tile_vo[t + DV4P],
        tile_vo[t + DV4P + 1u],
        tile_vo[t + 2u * DV4P],
        tile_vo[t + 2u * DV4P + 1u],
        tile_vo[t + 3u * DV4P],
        tile_vo[t + 3u * DV4P + 1u],
    );
}

// A branch condition around quad reads: each invocation decides alone.
fn quad_all(x: bool) -> bool {
    return x;
}
