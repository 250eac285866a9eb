// The backward's dO (binding 5, where the forward binds O).
@group(0) @binding(5) var<storage, read> do_buf: array<InElem>;

fn do_row4(index: u32, count: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    for (var c = 0u; c < min(count, 4u); c++) {
        x[c] = f32(do_buf[index + c]);
    }
    return x;
}
