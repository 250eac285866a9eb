// The backward's dO (binding 5, where the forward binds O).
@group(0) @binding(5) var<storage, read> do_buf: array<vec4<InElem>>;

fn do_row4(index: u32, count: u32) -> vec4<f32> {
    return vec4<f32>(do_buf[index / 4u]);
}
