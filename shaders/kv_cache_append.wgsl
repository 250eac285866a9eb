// KV cache append into an f32 cache [B, max_len, H, D] (or a paged pool): the new keys (or values)
// of a step copied after each sequence's cached tokens (kv_cache_common.wgsl states where). One
// invocation per element.

@group(0) @binding(1) var<storage, read> new_rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.batch * params.seq * params.heads * params.dim {
        return;
    }
    let d = i % params.dim;
    let h = (i / params.dim) % params.heads;
    let l = (i / (params.dim * params.heads)) % params.seq;
    let b = i / (params.dim * params.heads * params.seq);
    if !is_new_row(b, l) {
        return;
    }
    cache[(cache_row(b, l) * params.heads + h) * params.dim + d] = new_rows[new_row_start(b, l, h) + d];
}
