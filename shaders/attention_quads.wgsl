// Quads: four staged rows (keys, or query rows) by eight head dims, the CPU-driver kernels' step
// over a staged tile, read the same by every invocation of the workgroup (each owns other rows).
// qk_quad and vo_quad (the tile of the score's operand: K or Q, DK4P vec4s a row; of the value's:
// V or dO, DV4P) come from attention_quads_subgroup.wgsl or attention_quads_workgroup.wgsl, appended
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
