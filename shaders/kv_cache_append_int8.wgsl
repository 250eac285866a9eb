// KV cache append into an int8 cache (kv_cache_common.wgsl states where each row goes): each new
// row of one head, D values (D a multiple of 4), is stored as D / 4 words of four int8,
// pack4x8snorm(x / s), followed by its scale s = max |x| as f32 bits, so x ~ unpack4x8snorm(word) * s
// within s / 254. A row holding a non-finite value gets a NaN scale: it reads back as NaN, as
// attention over it would be, not as numbers. One invocation per (sequence, new row, head).

@group(0) @binding(1) var<storage, read> new_rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<u32>;

fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let e = grid_item(gid, 1u);
    let b = e.b;
    let l = e.s;
    let h = e.h;
    if !e.live || !is_new_row(b, l) {
        return;
    }
    let src = new_row_start(b, l, h);
    var scale = 0.0;
    var finite = true;
    for (var d = 0u; d < params.dim; d++) {
        let x = new_rows[src + d];
        finite = finite && is_finite(x);
        scale = max(scale, abs(x));
    }
    let words = params.dim / 4u;
    let dst = (cache_row(b, l) * params.heads + h) * (words + 1u);
    // A zero (or non-finite) row stores zero words; its scale says which.
    let quantise = scale > 0.0 && finite;
    let inv = select(0.0, 1.0 / scale, quantise);
    for (var w = 0u; w < words; w++) {
        var word = 0u;
        if quantise {
            let at = src + 4u * w;
            word = pack4x8snorm(vec4<f32>(new_rows[at], new_rows[at + 1u], new_rows[at + 2u], new_rows[at + 3u]) * inv);
        }
        cache[dst + w] = word;
    }
    cache[dst + words] = select(0x7fc00000u, bitcast<u32>(scale), finite);
}
