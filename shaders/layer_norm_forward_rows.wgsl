// LayerNorm forward, GPU family (after workgroup_sum.wgsl and layer_norm_forward_common.wgsl): one
// workgroup per row whose invocations stride over the columns, so that loads are coalesced and a
// 1024-row batch fills a GPU (a row per invocation left most of it idle); the row's sums meet in
// workgroup_sum2, in a fixed order.

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.y * params.grid_x + wid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.cols;
    var mean = 0.0;
    if CENTERED {
        var sum = 0.0;
        for (var c = lid; c < params.cols; c += WG) {
            sum += x[base + c];
        }
        mean = workgroup_sum2(vec2<f32>(sum, 0.0), lid).x / f32(params.cols);
    }
    var sq = 0.0;
    for (var c = lid; c < params.cols; c += WG) {
        let d = x[base + c] - mean;
        sq += d * d;
    }
    let rstd = layer_norm_rstd(workgroup_sum2(vec2<f32>(sq, 0.0), lid).x);
    for (var c = lid; c < params.cols; c += WG) {
        layer_norm_output(base, c, mean, rstd);
    }
    if lid == 0u {
        stats[row] = vec2<f32>(mean, rstd);
    }
}
