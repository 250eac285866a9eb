// LayerNorm backward, input gradient, CPU-driver family (after layer_norm_backward_common.wgsl): one
// invocation per row.

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y * params.grid_x * WG + gid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.cols;
    let st = stats[row];
    var sums = vec2<f32>(0.0);
    for (var c = 0u; c < params.cols; c++) {
        sums += layer_norm_grad_terms(base, c, st);
    }
    for (var c = 0u; c < params.cols; c++) {
        layer_norm_dx(base, c, st, sums);
    }
}
