// BEGIN SCORE_BIAS
// The additive score bias (FLAG_BIAS) or the relative-position table (FLAG_RELATIVE), bound by
// every kernel that calls modify_scores when the call has one.
@group(0) @binding(15) var<storage, read> score_bias: array<f32>;

// The additive terms of modify_scores: the bias tensor's entries or the relative table's.
fn score_bias_terms(rows: vec4<u32>, keys: vec4<u32>, b: u32, h: u32) -> vec4<f32> {
    let i = min(rows, vec4<u32>(params.q_seq - 1u));
    let j = min(keys, vec4<u32>(params.kv_seq - 1u));
    var t = vec4<f32>(0.0);
    if has_flag(FLAG_BIAS) {
        let base = params.bias_offset + b * params.bias_stride_b + h * params.bias_stride_h;
        let index = vec4<u32>(base) + i * params.bias_stride_i + j * params.bias_stride_j;
        t = vec4<f32>(score_bias[index.x], score_bias[index.y], score_bias[index.z], score_bias[index.w]);
    } else {
        let shift = row_shift(b);
        let delta = vec4<i32>(j) - vec4<i32>(i) - shift;
        let base = h * params.rel_table_stride;
        for (var e = 0u; e < 4u; e++) {
            t[e] = score_bias[base + relative_bucket(delta[e])];
        }
    }
    return t;
}
// END SCORE_BIAS
