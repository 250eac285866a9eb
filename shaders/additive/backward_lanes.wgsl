// The fused additive backward's rows split over lanes (after additive/common.wgsl): LANES
// invocations share one row (a query row in additive/backward_da.wgsl, a key in _db), lane l holding
// its vec4s l, l + LANES, .. of the score dim and its value dims l, l + LANES, .. (the staged rows are
// padded to those multiples). What an invocation keeps per row is then (3 Da + Dv) / LANES floats
// (query side; key side 2 Da + 2 Dv) and the tanh of four staged rows over its share of Da: held
// whole by one invocation, that spilled
// on every AMD chip (251 spilled VGPRs on RDNA2 at Da = 64). The price is a sum over the row's lanes
// of each step's partial scores and dO . v terms, through workgroup memory, a barrier each.
// LANES = 1 is the one-invocation-per-row kernel: no sums, no barriers.

// Rows per workgroup.
override ROWS: u32 = WG / LANES;
// Score-dim vec4s and value dims per lane.
override LANE_DA4: u32 = DA4 / LANES;
override LANE_DV: u32 = DVS / LANES;

// Sizes of the per-lane arrays: MAX_LANE_DA4 and MAX_LANE_DV, the pipeline's exact LANE_DA4 and
// LANE_DV, declared by the host.

// One partial sum per invocation, in two halves that the kernels use in turn (half 0, then 1, in
// every step): a lane writing a sum cannot overwrite what a slower lane of its row still reads from
// the last use of that half (every lane has passed the barrier of the other half's use in between).
override LANE_SUMS: u32 = select(1u, 2u * WG, LANES > 1u);
var<workgroup> lane_sums: array<vec4<f32>, LANE_SUMS>;

// The partial sums x of the row's lanes added up, in lane order (the same bits in every lane of the
// row), through half `half` (0 or 1) of lane_sums. Called by every invocation of the workgroup in
// uniform control flow.
fn row_sum(x: vec4<f32>, half: u32, lid: u32) -> vec4<f32> {
    if LANES == 1u {
        return x;
    }
    lane_sums[half * WG + lid] = x;
    workgroupBarrier();
    let first = half * WG + lid / LANES * LANES;
    var sum = vec4<f32>(0.0);
    for (var l = 0u; l < LANES; l++) {
        sum += lane_sums[first + l];
    }
    return sum;
}
