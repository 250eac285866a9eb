// KV cache append into an f32 cache [B, max_len, H, D] (or a paged pool): the new keys (or values)
// of a step copied after each sequence's cached tokens (kv_cache_common.wgsl states where). One
// invocation per element.

@group(0) @binding(1) var<storage, read> new_rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let e = grid_item(gid, params.dim);
    if !e.live || !is_new_row(e.b, e.s) {
        return;
    }
    cache[(cache_row(e.b, e.s) * params.heads + e.h) * params.dim + e.x] = new_rows[new_row_start(e.b, e.s, e.h) + e.x];
}
