// Workgroup sums of one vec2 per invocation, added in a fixed tree order: the same bits on every
// run, whatever the scheduling. WG must be a power of two. Every invocation calls it in uniform
// control flow; it returns after a barrier, so the next call may reuse the memory at once.

var<workgroup> workgroup_partials: array<vec2<f32>, WG>;

fn workgroup_sum2(value: vec2<f32>, lid: u32) -> vec2<f32> {
    workgroup_partials[lid] = value;
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half >>= 1u) {
        if lid < half {
            workgroup_partials[lid] += workgroup_partials[lid + half];
        }
        workgroupBarrier();
    }
    let total = workgroup_partials[0];
    workgroupBarrier();
    return total;
}
