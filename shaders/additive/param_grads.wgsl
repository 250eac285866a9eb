// Additive attention: the score vector's and the bias's gradients, [H, Da] each, from the query
// side's per-row shares: dw[h, c] = sum over (b, i) of dw_rows[h, b, i, c], dbias[h, c] = sum over
// (b, i) of da[b, i, h, c] (the bias enters every score as a does). One invocation per (h, c), rows
// in order (deterministic); rows [chunk_begin, chunk_end) of the B * Lq per dispatch, later dispatches
// (accumulate = 1) adding to what earlier ones wrote.

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read> dw_rows: array<f32>;
@group(0) @binding(3) var<storage, read> da_buf: array<f32>;
@group(0) @binding(4) var<storage, read_write> dw_buf: array<f32>;
@group(0) @binding(5) var<storage, read_write> dbias_buf: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let index = linear_group(wg) * WG + lid;
    let da = params.dk;
    if index >= params.heads * da {
        return;
    }
    let h = index / da;
    let c = index % da;
    var dw = 0.0;
    var dbias = 0.0;
    if params.accumulate != 0u {
        dw = dw_buf[index];
        dbias = dbias_buf[index];
    }
    for (var r = params.chunk_begin; r < params.chunk_end; r++) {
        let b = r / params.q_seq;
        let i = r % params.q_seq;
        dw += dw_rows[((h * params.batch + b) * params.q_seq + i) * da + c];
        dbias += da_buf[view_index(VIEW_DQ, b, i, h) + c];
    }
    dw_buf[index] = dw;
    dbias_buf[index] = dbias;
}
