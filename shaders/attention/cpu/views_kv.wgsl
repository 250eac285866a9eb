// The staged tiles' views of the CPU-driver forward and dQ kernels (attention/cpu/quads.wgsl): K,
// the score's operand, and V. Read through attention/input_rows*.wgsl.
const QK_VIEW: u32 = VIEW_K;
const VO_VIEW: u32 = VIEW_V;

fn qk_row4(index: u32, count: u32) -> vec4<f32> {
    return k_row4(index, count);
}

fn vo_row4(index: u32, count: u32) -> vec4<f32> {
    return v_row4(index, count);
}
