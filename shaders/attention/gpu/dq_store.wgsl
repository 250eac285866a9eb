// dQ from the f32 sums the GPU family's dK/dV kernel added (attention/gpu/dq_sums.wgsl), written
// into the dq view: dq[b, i, h, :] = sums[b, h, i, :], every stored row (padded rows' sums are 0).
// Each sum is zeroed once read, so the context's sums buffer is all zeros between backward calls
// (wgpu creates it zeroed) and the next call adds to zeros without a clear. One invocation per
// element.

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read_write> dq_sums: array<f32>;
// dQ in OutElem (f32, or f16 with SHADER_F16; aliased by the host).
@group(0) @binding(3) var<storage, read_write> dq_buf: array<OutElem>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let index = linear_group(wg) * WG + lid;
    let per_batch = params.q_seq * params.heads * params.dk;
    if index >= params.batch * per_batch {
        return;
    }
    let d = index % params.dk;
    let h = (index / params.dk) % params.heads;
    let i = (index / (params.dk * params.heads)) % params.q_seq;
    let b = index / per_batch;
    let at = ((b * params.heads + h) * params.q_seq + i) * params.dk + d;
    let sum = dq_sums[at];
    dq_sums[at] = 0.0;
    if row_stored(VIEW_DQ, b, i) {
        dq_buf[view_index(VIEW_DQ, b, i, h) + d] = OutElem(sum);
    }
}
