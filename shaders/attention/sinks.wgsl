// Attention sinks (gpt-oss style), forward: a learnable logit per query head joins every row's softmax
// denominator without a value, so a row can put weight on "nothing". Applied after the forward of
// either kernel family (any split or chunking) as one more partial result with lse = sink_h and O = 0:
//   lse' = log(exp(lse) + exp(sink_h)),   O' = O * exp(lse - lse').
// Rows that see no key keep O = 0, lse = -inf (SPEC.md). One invocation per (batch, head, query row).

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(3) var<storage, read_write> lse_buf: array<f32>;
@group(0) @binding(4) var<storage, read> sinks: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wg) * WG + lid;
    if row >= params.batch * params.heads * params.q_seq {
        return;
    }
    let lse = lse_buf[row];
    // -inf (no visible key) compares below the finite sentinel; nothing is subtracted from it.
    if !not_masked(lse) {
        return;
    }
    let i = row % params.q_seq;
    let bh = row / params.q_seq;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let sink = sinks[h];
    let top = max(lse, sink);
    let total = top + log(exp(lse - top) + exp(sink - top));
    let w = exp(lse - total);
    let base = view_index(VIEW_O, b, i, h);
    for (var d = 0u; d < params.dv; d++) {
        o_buf[base + d] *= w;
    }
    lse_buf[row] = total;
}
