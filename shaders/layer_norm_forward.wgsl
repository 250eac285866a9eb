// LayerNorm forward, CPU-driver family (after layer_norm_forward_common.wgsl): one invocation per
// row, three passes over it. Loop iterations stay 3 * cols per invocation (the host caps cols under
// llvmpipe's loop cap).

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y * params.grid_x * WG + gid.x;
    if row >= params.rows {
        return;
    }
    let base = row * params.cols;
    var sum = 0.0;
    if CENTERED {
        for (var c = 0u; c < params.cols; c++) {
            sum += x[base + c];
        }
    }
    let mean = sum / f32(params.cols);
    var sq = 0.0;
    for (var c = 0u; c < params.cols; c++) {
        let d = x[base + c] - mean;
        sq += d * d;
    }
    let rstd = layer_norm_rstd(sq);
    for (var c = 0u; c < params.cols; c++) {
        layer_norm_output(base, c, mean, rstd);
    }
    stats[row] = vec2<f32>(mean, rstd);
}
