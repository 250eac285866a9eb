// The fused kernels' Q, K, V (and dO) bindings read four elements per access
// (attention/input_rows.wgsl says when the host takes this build): every index the kernels pass
// is a multiple of four and every count at least four.
override VEC4: u32 = 1u;

@group(0) @binding(2) var<storage, read> q_buf: array<vec4<InElem>>;
@group(0) @binding(3) var<storage, read> k_buf: array<vec4<InElem>>;
@group(0) @binding(4) var<storage, read> v_buf: array<vec4<InElem>>;

fn q_row4(index: u32, count: u32) -> vec4<f32> {
    return vec4<f32>(q_buf[index / 4u]);
}

fn k_row4(index: u32, count: u32) -> vec4<f32> {
    return vec4<f32>(k_buf[index / 4u]);
}

fn v_row4(index: u32, count: u32) -> vec4<f32> {
    return vec4<f32>(v_buf[index / 4u]);
}

// The factor of a row's values, which the staging multiplies them by: 1 (an int8 cache's rows
// have scales: attention/input_rows_kv_words.wgsl).
fn row_scale(view: u32, row: u32) -> f32 {
    return 1.0;
}
