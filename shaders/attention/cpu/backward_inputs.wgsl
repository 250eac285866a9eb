// The CPU-driver backward kernels' inputs: Q, K, V, dO and each query row's (lse, D), and
// input_elem, their element reader for attention/cpu/quads.wgsl's staging and row loads.
@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
@group(0) @binding(3) var<storage, read> k_buf: array<f32>;
@group(0) @binding(4) var<storage, read> v_buf: array<f32>;
@group(0) @binding(5) var<storage, read> do_buf: array<f32>;
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;

fn input_elem(view: u32, index: u32) -> f32 {
    switch view {
        case VIEW_Q: {
            return q_buf[index];
        }
        case VIEW_K: {
            return k_buf[index];
        }
        case VIEW_V: {
            return v_buf[index];
        }
        default: {
            return do_buf[index];
        }
    }
}
