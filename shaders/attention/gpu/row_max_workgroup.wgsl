// Row-group maxima of the tiled forward through workgroup memory (adapters without a fixed subgroup
// size, GL): each of the TC invocations of a row group posts its vec4 of four rows, then reads all TC.
// Its twin, attention/gpu/row_max_subgroup.wgsl, gives the same bits (a maximum does not depend on order).

struct Lanes {
    @builtin(local_invocation_index) index: u32,
}

// Where the invocation sits in the row-group layout (tr = index / TC, tc = index % TC).
fn layout_index(ids: Lanes) -> u32 {
    return ids.index;
}

// Called by every invocation in uniform control flow. Its barrier also tells the forward that every
// invocation has passed its score loop (V is staged over K next).
fn row_group_max(x: vec4<f32>, tr: u32, tc: u32) -> vec4<f32> {
    red[tc * TR + tr] = x;
    workgroupBarrier();
    var m = x;
    for (var c = 0u; c < TC; c++) {
        m = max(m, red[c * TR + tr]);
    }
    return m;
}
