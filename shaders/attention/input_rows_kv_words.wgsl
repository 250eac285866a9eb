// The fused forward's reads of a decoding step's Q (InElem, an element at a time) and of a KV cache
// stored in words, as the decode kernel reads it (attention/decode.wgsl): int8 rows (KV_INT8: D / 4
// words of four signed bytes, then the row's f32 scale; a value is unpack4x8snorm(word) * scale) or
// f16 pairs (D / 2 words; no shader-f16 needed). The kernels address K and V in elements of the
// stored type, bytes or halves (the host scales the views' offsets and strides to them), so an
// int8 row's scale is the four bytes after its D values. D is a multiple of four. VEC4 = 0: Q is
// read an element at a time (once per row block; K and V are what a prefill step reads most).
override VEC4: u32 = 0u;
override KV_INT8: bool = false;

@group(0) @binding(2) var<storage, read> q_buf: array<InElem>;
@group(0) @binding(3) var<storage, read> k_buf: array<u32>;
@group(0) @binding(4) var<storage, read> v_buf: array<u32>;

// Elements index .. index + 3 of Q, the first `count` of them (zeros after).
fn q_row4(index: u32, count: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < min(count, 4u); c++) {
        x[c] = f32(q_buf[index + c]);
    }
    return x;
}

// Elements index .. index + 3 of a cached row (index a multiple of four), the int8 ones unscaled.
fn words_row4(word: u32, next: u32) -> vec4<f32> {
    if KV_INT8 {
        return unpack4x8snorm(word);
    }
    return vec4<f32>(unpack2x16float(word), unpack2x16float(next));
}

fn k_row4(index: u32, count: u32) -> vec4<f32> {
    if KV_INT8 {
        return words_row4(k_buf[index / 4u], 0u);
    }
    return words_row4(k_buf[index / 2u], k_buf[index / 2u + 1u]);
}

fn v_row4(index: u32, count: u32) -> vec4<f32> {
    if KV_INT8 {
        return words_row4(v_buf[index / 4u], 0u);
    }
    return words_row4(v_buf[index / 2u], v_buf[index / 2u + 1u]);
}

// The factor of a row's values (`row`: the index of its first), which the staging multiplies them
// by: an int8 K or V row's scale, 1 otherwise.
fn row_scale(view: u32, row: u32) -> f32 {
    if !KV_INT8 {
        return 1.0;
    }
    switch view {
        case VIEW_K: {
            return bitcast<f32>(k_buf[(row + DK) / 4u]);
        }
        case VIEW_V: {
            return bitcast<f32>(v_buf[(row + DV) / 4u]);
        }
        default: {
            return 1.0;
        }
    }
}
