// The CPU-driver backward kernels' inputs besides Q, K, V and dO (bindings 2-5, read four
// elements at a time: attention/input_rows*.wgsl and attention/do_rows*.wgsl): each query row's
// (lse, D).
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
