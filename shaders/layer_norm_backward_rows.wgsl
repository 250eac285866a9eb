// LayerNorm backward, input gradient, GPU family (after workgroup_sum.wgsl and
// layer_norm_backward_common.wgsl): one workgroup per row whose invocations stride over the columns;
// the row's two sums meet in workgroup_sum2, in a fixed order.

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.y * params.grid_x + wid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.cols;
    let st = stats[row];
    var sums = vec2<f32>(0.0);
    for (var c = lid; c < params.cols; c += WG) {
        sums += layer_norm_grad_terms(base, c, st);
    }
    sums = workgroup_sum2(sums, lid);
    for (var c = lid; c < params.cols; c += WG) {
        layer_norm_dx(base, c, st, sums);
    }
}
