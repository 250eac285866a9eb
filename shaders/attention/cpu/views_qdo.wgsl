// The staged tiles' views of the CPU-driver dK/dV kernel (attention/cpu/quads.wgsl): Q, the
// score's operand, and dO. Read through attention/input_rows*.wgsl and attention/do_rows*.wgsl.
const QK_VIEW: u32 = VIEW_Q;
const VO_VIEW: u32 = VIEW_DO;

fn qk_row4(index: u32, count: u32) -> vec4<f32> {
    return q_row4(index, count);
}

fn vo_row4(index: u32, count: u32) -> vec4<f32> {
    return do_row4(index, count);
}
