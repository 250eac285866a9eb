// The GPU family's dK/dV kernel without dQ (attention/gpu/dq_sums.wgsl has the build with it): the
// dQ kernel computes dQ in a fixed order, so gradients are bitwise repeatable.
fn add_dq_tile(lid: u32, b: u32, h: u32, m0: u32, hi: u32) {}
