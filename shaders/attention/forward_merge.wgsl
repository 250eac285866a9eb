// Split-KV merge of the tiled forward (attention/gpu/forward.wgsl): each split s of a row's keys left
// a normalised partial o_s and lse_s; the row's result is
//   lse = log(sum_s exp(lse_s)),   O = sum_s exp(lse_s - lse) * o_s,
// summed in split order (deterministic). A split that saw no key of the row has lse_s = -inf and
// weight 0; a row no split saw keeps O = 0, lse = -inf. One invocation per output element.

override WG: u32 = 64u;

// Partial O as [splits * B, Lq, H, Dv] (contiguous) and partial lse as [splits * B, H, Lq].
@group(0) @binding(2) var<storage, read> o_part: array<f32>;
@group(0) @binding(3) var<storage, read> lse_part: array<f32>;
// O in OutElem (f32, or f16 with SHADER_F16; aliased by the host).
@group(0) @binding(4) var<storage, read_write> o_buf: array<OutElem>;
@group(0) @binding(5) var<storage, read_write> lse_buf: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let index = linear_group(wg) * WG + lid;
    let per_batch = params.q_seq * params.heads * params.dv;
    if index >= params.batch * per_batch {
        return;
    }
    let d = index % params.dv;
    let h = (index / params.dv) % params.heads;
    let i = (index / (params.dv * params.heads)) % params.q_seq;
    let b = index / per_batch;
    let rows = params.batch * params.heads * params.q_seq;
    let row = (b * params.heads + h) * params.q_seq + i;

    // A NaN lse (a NaN reached the row in that split) counts as seen and makes the result NaN.
    var top = NEG_BIG;
    var seen = false;
    for (var s = 0u; s < params.splits; s++) {
        let lse_s = lse_part[s * rows + row];
        top = max(top, lse_s);
        seen = seen || not_masked(lse_s);
    }
    var total = 0.0;
    var o = 0.0;
    if seen {
        for (var s = 0u; s < params.splits; s++) {
            let lse_s = lse_part[s * rows + row];
            if not_masked(lse_s) {
                let w = exp(lse_s - top);
                total += w;
                o += w * o_part[s * params.batch * per_batch + index];
            }
        }
        o /= total;
    }
    if row_stored(VIEW_O, b, i) {
        o_buf[view_index(VIEW_O, b, i, h) + d] = OutElem(o);
    }
    if d == 0u {
        lse_buf[row] = select(neg_inf(), top + log(total), seen);
    }
}
