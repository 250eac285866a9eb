// The tensor-core dK/dV kernel without dQ (attention/coop/dq_sums.wgsl has the build with it): the
// dQ kernel computes dQ in a fixed order, so gradients are bitwise repeatable.
fn dq_keys_bad_of(lid: u32, staged_bad: bool) -> bool {
    return false;
}

fn add_dq_tile(lid: u32, b: u32, h: u32, m0: u32, hi: u32, keys_at: u32, keys_bad: bool) {}
