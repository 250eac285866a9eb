// Attention sinks, backward: the sink's probability in row i is p_i = exp(sink_h - lse_i) and it has no
// value, so dL/dsink_h = -sum over (batch, row) of p_i * D_i, with D_i = dO_i . O_i from the backward's
// stats (lse, D). dQ, dK, dV need nothing more: P and D already include the sink. One workgroup per head
// sums its rows in a fixed order and reduces in a fixed tree: bitwise reproducible, no atomics.

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> sinks: array<f32>;
@group(0) @binding(4) var<storage, read_write> d_sinks: array<f32>;

var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Uniform per workgroup, so the barriers below stay in uniform control flow.
    let h = linear_group(wg);
    if h >= params.heads {
        return;
    }
    let sink = sinks[h];
    var sum = 0.0;
    for (var t = lid; t < params.batch * params.q_seq; t += WG) {
        let b = t / params.q_seq;
        let i = t % params.q_seq;
        let st = stats[(b * params.heads + h) * params.q_seq + i];
        // Rows that see no key (lse = -inf) hold no sink probability.
        if not_masked(st.x) {
            sum -= exp(sink - st.x) * st.y;
        }
    }
    partial[lid] = sum;
    for (var width = WG / 2u; width > 0u; width /= 2u) {
        workgroupBarrier();
        if lid < width {
            partial[lid] += partial[lid + width];
        }
    }
    if lid == 0u {
        d_sinks[h] = partial[0];
    }
}
