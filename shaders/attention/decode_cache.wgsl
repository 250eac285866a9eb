// Decode attention's key and value caches (attention/decode.wgsl), read a word at a time: f32
// values or, with INT8, packed words and scales, as bits either way. This build reads views whose
// rows may start anywhere; the host takes attention/decode_cache_vec4.wgsl instead where both
// f32 or f16 caches start every row on a four-word boundary and the head dims are multiples of
// four.
// VEC4 = 0 here, 1 there: the pipeline key tells the builds apart.
override VEC4: u32 = 0u;

@group(0) @binding(3) var<storage, read> k_buf: array<u32>;
@group(0) @binding(4) var<storage, read> v_buf: array<u32>;

// Word `index` of the key or the value cache.
fn cache_word(view: u32, index: u32) -> u32 {
    if view == VIEW_K {
        return k_buf[index];
    }
    return v_buf[index];
}

// Words index .. index + 3 (VEC4 builds only: `index` a multiple of four).
fn cache_word4(view: u32, index: u32) -> vec4<u32> {
    return vec4<u32>(cache_word(view, index), cache_word(view, index + 1u), cache_word(view, index + 2u), cache_word(view, index + 3u));
}

// Words index and index + 1 (f16 builds: `index` even).
fn cache_pair(view: u32, index: u32) -> vec2<u32> {
    return vec2<u32>(cache_word(view, index), cache_word(view, index + 1u));
}
