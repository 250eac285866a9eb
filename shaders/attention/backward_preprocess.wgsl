// Attention backward, step 1 (SPEC.md): D_i = sum_c dO_ic * O_ic for every query row, packed with the
// forward's lse as stats[row] = (lse_i, D_i) so the two later kernels read both with one load.
// One invocation per (batch, head, query row).

override WG: u32 = 64u;

// O and dO in InElem (f32, or f16 with SHADER_F16; aliased by the host).
@group(0) @binding(2) var<storage, read> o_buf: array<InElem>;
@group(0) @binding(3) var<storage, read> do_buf: array<InElem>;
@group(0) @binding(4) var<storage, read> lse_buf: array<f32>;
@group(0) @binding(5) var<storage, read_write> stats: array<vec2<f32>>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wg) * WG + lid;
    if row >= params.batch * params.heads * params.q_seq {
        return;
    }
    let i = row % params.q_seq;
    let bh = row / params.q_seq;
    let b = bh / params.heads;
    let h = bh % params.heads;
    var delta = 0.0;
    if i < q_len(b) {
        let o_base = view_index(VIEW_O, b, i, h);
        let do_base = view_index(VIEW_DO, b, i, h);
        for (var d = 0u; d < params.dv; d++) {
            delta += f32(do_buf[do_base + d]) * f32(o_buf[o_base + d]);
        }
    }
    stats[row] = vec2<f32>(lse_buf[row], delta);
}
