// KV cache gather out of an f16 cache (kv_cache_append_f16.wgsl's rows: D / 2 words of two
// halves), paged or contiguous: the first `seq` positions of every sequence widened to f32 into a
// contiguous [B, seq, H, D] tensor, zeros past a sequence's kv_len. A prefill-shaped step over an
// f16 cache runs the fused forward on what this gathers. One invocation per pair of values.

@group(0) @binding(1) var<storage, read> cache: array<u32>;
@group(0) @binding(2) var<storage, read_write> gathered: array<vec2<f32>>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let pairs = params.dim / 2u;
    let e = grid_item(gid, pairs);
    if !e.live {
        return;
    }
    var x = vec2<f32>(0.0);
    if e.s < lens[params.batch + e.b] {
        x = unpack2x16float(cache[(position_row(e.b, e.s) * params.heads + e.h) * pairs + e.x]);
    }
    gathered[e.at] = x;
}
