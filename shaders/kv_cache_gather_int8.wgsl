// KV cache gather out of an int8 cache (kv_cache_append_int8.wgsl's rows: D / 4 words of four int8,
// then the scale's f32 bits), paged or contiguous: the first `seq` positions of every sequence
// dequantised, x = unpack4x8snorm(word) * scale, into a contiguous f32 [B, seq, H, D] tensor, zeros
// past a sequence's kv_len. A prefill-shaped step over an int8 cache runs the fused forward on what
// this gathers. One invocation per four values.

@group(0) @binding(1) var<storage, read> cache: array<u32>;
@group(0) @binding(2) var<storage, read_write> gathered: array<vec4<f32>>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d4 = params.dim / 4u;
    let e = grid_item(gid, d4);
    if !e.live {
        return;
    }
    var x = vec4<f32>(0.0);
    if e.s < lens[params.batch + e.b] {
        // A row of one head: d4 value words and the scale word.
        let row = (position_row(e.b, e.s) * params.heads + e.h) * (d4 + 1u);
        x = unpack4x8snorm(cache[row + e.x]) * bitcast<f32>(cache[row + d4]);
    }
    gathered[e.at] = x;
}
