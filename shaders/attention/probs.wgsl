// Attention probabilities on request (attention maps): P[b, h, r, j] = exp(score_ij - lse_i) for the
// query rows i = chunk_begin + r in [chunk_begin, chunk_end) of every (batch, head), recomputed from
// Q, K and the forward's lse with the same masks and score modifiers as the fused kernels (the shared
// header's modify_scores and mask rules); 0 where masked and for rows that see no key. With sinks,
// lse includes them, so a row sums to 1 minus its sink's share. One invocation per element; the
// head-dim loop is short. Never part of training: materialised only when asked for, by row chunks.

override WG: u32 = 64u;

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> lse_buf: array<f32>;
@group(0) @binding(5) var<storage, read_write> probs: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let rows = params.chunk_end - params.chunk_begin;
    let index = linear_group(wg) * WG + lid;
    if index >= params.batch * params.heads * rows * params.kv_seq {
        return;
    }
    let j = index % params.kv_seq;
    let r = (index / params.kv_seq) % rows;
    let bh = index / (params.kv_seq * rows);
    let b = bh / params.heads;
    let h = bh % params.heads;
    let h_kv = h / (params.heads / params.kv_heads);
    let i = params.chunk_begin + r;
    var p = 0.0;
    if i < q_len(b) && j >= key_start(i) && j < key_end(i, kv_len(b)) {
        let qi = view_index(VIEW_Q, b, i, h);
        let kj = view_index(VIEW_K, b, j, h_kv);
        var dot = 0.0;
        for (var d = 0u; d < params.dk; d++) {
            dot += q_buf[qi + d] * k_buf[kj + d];
        }
        let x = modify_scores(vec4<f32>(params.scale * dot), vec4<u32>(i), vec4<u32>(j), b, h).x;
        let lse = lse_buf[(b * params.heads + h) * params.q_seq + i];
        if not_masked(x) && not_masked(lse) {
            p = exp(x - lse);
        }
    }
    probs[index] = p;
}
