// Unfused attention baseline: masked row softmax over materialised scores S [B, H, Lq, Lk] (already
// scaled), in place, writing P and the row log-sum-exp. Masks and fully masked rows follow SPEC.md
// exactly as the fused kernel does. One workgroup per row; a tree reduction for max and sum.

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read_write> scores: array<f32>;
@group(0) @binding(3) var<storage, read_write> lse_buf: array<f32>;

var<workgroup> red: array<f32, WG>;

fn reduce_max(lid: u32, x: f32) -> f32 {
    red[lid] = x;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if lid < s {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(lid: u32, x: f32) -> f32 {
    red[lid] = x;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s /= 2u) {
        if lid < s {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wg);
    if row >= params.total_groups {
        return;
    }
    let i = row % params.q_seq;
    let b = row / (params.q_seq * params.heads);
    let base = row * params.kv_seq;
    var start = 0u;
    var end = 0u;
    if i < q_len(b) {
        start = key_start(i);
        end = max(key_end(i, kv_len(b)), start);
    }
    var mx = NEG_BIG;
    for (var j = start + lid; j < end; j += WG) {
        mx = max(mx, scores[base + j]);
    }
    mx = reduce_max(lid, mx);
    var sum = 0.0;
    for (var j = start + lid; j < end; j += WG) {
        sum += exp(scores[base + j] - mx);
    }
    sum = reduce_sum(lid, sum);
    var inv = 0.0;
    if end > start {
        inv = 1.0 / sum;
    }
    for (var j = lid; j < params.kv_seq; j += WG) {
        var p = 0.0;
        if j >= start && j < end {
            p = exp(scores[base + j] - mx) * inv;
        }
        scores[base + j] = p;
    }
    if lid == 0u {
        var lse = neg_inf();
        if end > start {
            lse = mx + log(sum);
        }
        lse_buf[row] = lse;
    }
}
