// Kernels that read no paged cache: an input row's index is view_index's (attention/kv_pages.wgsl
// is the paged build).
fn input_index(view: u32, b: u32, s: u32, h: u32) -> u32 {
    return view_index(view, b, s, h);
}
