// KV cache gather: the first `seq` positions of every sequence of an f32 cache (a paged pool, a
// strided [1, pool rows, H, D] view, or a contiguous [B, max_len, H, D] one) copied into a
// contiguous [B, seq, H, D] tensor, zeros past a sequence's kv_len (lens = [q_lens, kv_lens] of
// SeqLens). A prefill-shaped step over a paged cache gathers its keys and values this way and runs
// the fused forward kernels, which stage K/V in tiles shared by a block of rows, on them. One
// invocation per element.

@group(0) @binding(1) var<storage, read> cache: array<f32>;
@group(0) @binding(2) var<storage, read_write> gathered: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let e = grid_item(gid, params.dim);
    if !e.live {
        return;
    }
    var x = 0.0;
    if e.s < lens[params.batch + e.b] {
        x = cache[params.view_offset + position_row(e.b, e.s) * params.stride_s + e.h * params.stride_h + e.x];
    }
    gathered[e.at] = x;
}
