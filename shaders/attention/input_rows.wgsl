// The fused kernels' Q, K and V bindings (and dO's, the backward's), and reads of four
// consecutive elements of one of their rows (dims 4 d4 .. 4 d4 + 3). This build reads them one element at a time, for views whose
// rows may start anywhere or whose head dims are not multiples of four. The host takes
// attention/input_rows_vec4.wgsl instead where every row of those views starts on a
// four-element boundary and both head dims are multiples of four: one 128-bit access per four f32
// (64-bit per four f16). VEC4 = 0 here, 1 there: the pipeline key tells the builds apart.
override VEC4: u32 = 0u;

@group(0) @binding(2) var<storage, read> q_buf: array<InElem>;
@group(0) @binding(3) var<storage, read> k_buf: array<InElem>;
@group(0) @binding(4) var<storage, read> v_buf: array<InElem>;

// Elements index .. index + 3 of Q, the first `count` of them (zeros after).
fn q_row4(index: u32, count: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < min(count, 4u); c++) {
        x[c] = f32(q_buf[index + c]);
    }
    return x;
}

fn k_row4(index: u32, count: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < min(count, 4u); c++) {
        x[c] = f32(k_buf[index + c]);
    }
    return x;
}

fn v_row4(index: u32, count: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < min(count, 4u); c++) {
        x[c] = f32(v_buf[index + c]);
    }
    return x;
}

// The factor of a row's values, which the staging multiplies them by: 1 (an int8 cache's rows
// have scales: attention/input_rows_kv_words.wgsl).
fn row_scale(view: u32, row: u32) -> f32 {
    return 1.0;
}
