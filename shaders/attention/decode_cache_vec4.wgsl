// Decode attention's f32 and f16 key and value caches read four words per access (one 128-bit
// load; attention/decode_cache.wgsl says when the host takes this build). An f16 item is two
// words of one vec4 (cache_pair: a half chosen by select, not by a run-time component index,
// which CPU drivers turn into per-lane gathers).
override VEC4: u32 = 1u;

@group(0) @binding(3) var<storage, read> k_buf: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> v_buf: array<vec4<u32>>;

fn cache_word(view: u32, index: u32) -> u32 {
    return cache_word4(view, index & ~3u)[index & 3u];
}

fn cache_word4(view: u32, index: u32) -> vec4<u32> {
    if view == VIEW_K {
        return k_buf[index / 4u];
    }
    return v_buf[index / 4u];
}

fn cache_pair(view: u32, index: u32) -> vec2<u32> {
    let w = cache_word4(view, index & ~3u);
    return select(w.xy, w.zw, (index & 2u) != 0u);
}
