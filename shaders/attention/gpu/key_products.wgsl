// The GPU-family forward's P V step and dQ's dS K step, shared: the invocation's four rows (the
// lanes of w: their p, or dS) times one staged key row, added to its accumulator `acc`. Row r's
// column c is acc[r * MAX_OC + c], dims 4 (tc + TC c) .. + 3 of the staged rows. Each kernel
// declares OC, TC and PRODUCT_VIEW, the view whose staged rows it multiplies
// (attention/gpu/tiles.wgsl). acc lives at module scope: a pointer parameter would become a copy of
// the whole array in and out of every call in GLSL.
var<private> acc: array<vec4<f32>, 4u * MAX_OC>;

// Adds w's rows times key jj's staged row to acc. Rows that mask the key (w is masked_p there, see
// p_visible) skip its row: a NaN there is not theirs.
fn add_key_products(w: vec4<f32>, jj: u32, tc: u32) {
    let keep = p_visible(w);
    if all(keep) {
        for (var c = 0u; c < OC; c++) {
            let d4 = tc + TC * c;
            if TC * OC == view_d4s(PRODUCT_VIEW) || d4 < view_d4s(PRODUCT_VIEW) {
                let x = staged(PRODUCT_VIEW, jj, d4);
                acc[c] += w.x * x;
                acc[MAX_OC + c] += w.y * x;
                acc[2u * MAX_OC + c] += w.z * x;
                acc[3u * MAX_OC + c] += w.w * x;
            }
        }
    } else if any(keep) {
        let zero = vec4<f32>(0.0);
        for (var c = 0u; c < OC; c++) {
            let d4 = tc + TC * c;
            if TC * OC == view_d4s(PRODUCT_VIEW) || d4 < view_d4s(PRODUCT_VIEW) {
                let x = staged(PRODUCT_VIEW, jj, d4);
                acc[c] += select(zero, w.x * x, keep.x);
                acc[MAX_OC + c] += select(zero, w.y * x, keep.y);
                acc[2u * MAX_OC + c] += select(zero, w.z * x, keep.z);
                acc[3u * MAX_OC + c] += select(zero, w.w * x, keep.w);
            }
        }
    }
}
