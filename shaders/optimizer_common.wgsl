// The parameter table of the optimizer kernels (src/kernels/optimizer.rs): one segment per tensor
// of a dispatch's group, in the optimizer's order. Offsets count elements from the start of the
// group's binding of that buffer, so the parameters (and gradients) of a whole model, packed in
// one arena each, are updated by one dispatch.

struct Segment {
    // The tensor's first run of the update kernel's RUN elements among the group's runs.
    start: u32,
    // Its first partial sum of squares; global, as the norm adds all partials in order.
    partial_start: u32,
    param: u32,
    grad: u32,
    // In both moment bindings.
    moment: u32,
    len: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(1) var<storage, read> table: array<Segment>;

// The last segment of table[first .. first + count) whose key (`start`, or `partial_start` when
// `partial`) is <= x: the tensor holding run (or partial) x. An empty tensor shares its successor's
// key, so the search passes over it.
fn find_segment(first: u32, count: u32, x: u32, partial: bool) -> Segment {
    var lo = first;
    var hi = first + count - 1u;
    while lo < hi {
        let mid = (lo + hi + 1u) / 2u;
        let key = select(table[mid].start, table[mid].partial_start, partial);
        if key <= x {
            lo = mid;
        } else {
            hi = mid - 1u;
        }
    }
    return table[lo];
}
