// Quads: four staged rows (keys, or query rows) by eight head dims, the CPU-driver kernels' step
// over a staged tile, read the same by every invocation of the workgroup (each owns other rows).
// qk_quad and vo_quad (the tile of the score's operand: K or Q, DK4P vec4s a row; of the value's:
// V or dO, DV4P) come from attention/cpu/quads_subgroup.wgsl or attention/cpu/quads_workgroup.wgsl, appended
// by the host. DK4P and DV4P are even, so a row holds whole quads; the staged padding is zero.
struct Quad {
    // Row c's dims 0..3 (a_c) and 4..7 (b_c).
    a0: vec4<f32>,
    b0: vec4<f32>,
    a1: vec4<f32>,
    b1: vec4<f32>,
    a2: vec4<f32>,
    b2: vec4<f32>,
    a3: vec4<f32>,
    b3: vec4<f32>,
}

// acc plus one quad row's eight dims (lo: 0..3, hi: 4..7) against eight private columns x0 .. x7 of
// the invocation's four rows or keys, added four dims at a time in dim order: the kernels' score and
// dP step.
fn quad_row_dot(
    acc: vec4<f32>,
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    x4: vec4<f32>,
    x5: vec4<f32>,
    x6: vec4<f32>,
    x7: vec4<f32>,
    lo: vec4<f32>,
    hi: vec4<f32>,
) -> vec4<f32> {
    return (acc + (x0 * lo.x + x1 * lo.y + x2 * lo.z + x3 * lo.w))
        + (x4 * hi.x + x5 * hi.y + x6 * hi.z + x7 * hi.w);
}
