// Row-group maxima of the tiled forward with subgroup shuffles (Features::SUBGROUP and a fixed
// subgroup size that TC divides and that divides WG; the host checks). Invocations are laid out by
// (subgroup, lane), so the TC invocations of a row group are TC aligned consecutive lanes of one
// subgroup and log2(TC) butterfly steps combine them: no workgroup memory traffic. Its twin,
// attention/gpu/row_max_workgroup.wgsl, gives the same bits.

struct Lanes {
    @builtin(local_invocation_index) index: u32,
    @builtin(subgroup_id) subgroup: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) size: u32,
}

// Where the invocation sits in the row-group layout (tr = index / TC, tc = index % TC): full
// subgroups (WG is a multiple of their size) make this a permutation of the invocation indices.
fn layout_index(ids: Lanes) -> u32 {
    return ids.subgroup * ids.size + ids.lane;
}

// Called by every invocation in uniform control flow (the shuffles need the whole subgroup). Returns
// after a workgroup barrier, as its twin does: the forward stages V over K once every invocation has
// passed its score loop.
fn row_group_max(x: vec4<f32>, tr: u32, tc: u32) -> vec4<f32> {
    var m = x;
    for (var offset = 1u; offset < TC; offset <<= 1u) {
        m = max(m, subgroupShuffleXor(m, offset));
    }
    workgroupBarrier();
    return m;
}
