// KV cache append into an f16 cache (kv_cache_common.wgsl states where each row goes): each new
// row of one head, D values (D even), is stored as D / 2 words of two halves, rounded to nearest
// even. Values beyond f16's range become infinities and NaNs stay NaN, on the bits (WGSL leaves
// pack2x16float of such values indeterminate), so attention over them is what it would be over
// the f32 row. One invocation per pair of values.

@group(0) @binding(1) var<storage, read> new_rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<u32>;

// x as f16 bits: pack2x16float inside the finite range (65504 and beyond up to 65520 round to
// 65504), an infinity from 65520 on, a quiet NaN for a NaN.
fn half_bits(x: f32) -> u32 {
    let bits = bitcast<u32>(x);
    let sign = (bits >> 16u) & 0x8000u;
    if (bits & 0x7fffffffu) > 0x7f800000u {
        return 0x7e00u;
    }
    if abs(x) >= 65520.0 {
        return sign | 0x7c00u;
    }
    return pack2x16float(vec2<f32>(clamp(x, -65504.0, 65504.0), 0.0)) & 0xffffu;
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let pairs = params.dim / 2u;
    let e = grid_item(gid, pairs);
    if !e.live || !is_new_row(e.b, e.s) {
        return;
    }
    let at = new_row_start(e.b, e.s, e.h) + 2u * e.x;
    cache[(cache_row(e.b, e.s) * params.heads + e.h) * pairs + e.x] = half_bits(new_rows[at]) | (half_bits(new_rows[at + 1u]) << 16u);
}
