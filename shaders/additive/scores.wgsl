// Additive attention scores materialised: every
//   e_ij = scale * sum_c w[h, c] tanh(a[b, i, h, c] + b[b, j, h, c] + bias[h, c])
// of query rows [chunk_begin, chunk_end) as [B, H, rows, Lk]. Two uses: the unfused baseline's scores
// (PROBS false: all of them; masks are left to attention/unfused/softmax.wgsl), and attention maps (PROBS:
// P = exp(e - lse) from the forward's lse where the shared header's masks let the pair through, else
// 0). One invocation per element.

override WG: u32 = 64u;
override PROBS: bool = false;

@group(0) @binding(2) var<storage, read> a_buf: array<f32>;
@group(0) @binding(3) var<storage, read> b_buf: array<f32>;
@group(0) @binding(4) var<storage, read> w_buf: array<f32>;
@group(0) @binding(5) var<storage, read> bias_buf: array<f32>;
@group(0) @binding(6) var<storage, read_write> scores: array<f32>;
// The forward's lse [B, H, Lq] (PROBS only; a dummy otherwise).
@group(0) @binding(7) var<storage, read> lse_buf: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let rows = params.chunk_end - params.chunk_begin;
    let index = linear_group(wg) * WG + lid;
    if index >= params.batch * params.heads * rows * params.kv_seq {
        return;
    }
    let j = index % params.kv_seq;
    let i = params.chunk_begin + (index / params.kv_seq) % rows;
    let bh = index / (params.kv_seq * rows);
    let b = bh / params.heads;
    let h = bh % params.heads;
    let ai = view_index(VIEW_Q, b, i, h);
    let bj = view_index(VIEW_K, b, j, h);
    var e = 0.0;
    for (var c = 0u; c < params.dk; c++) {
        let x = a_buf[ai + c] + b_buf[bj + c] + bias_buf[h * params.dk + c];
        e += w_buf[h * params.dk + c] * tanh(clamp(x, -15.0, 15.0));
    }
    e *= params.scale;
    if PROBS {
        var p = 0.0;
        let lse = lse_buf[(b * params.heads + h) * params.q_seq + i];
        if i < q_len(b) && j >= key_start(i) && j < key_end(i, kv_len(b)) && not_masked(lse) {
            p = exp(e - lse);
        }
        e = p;
    }
    scores[index] = e;
}
