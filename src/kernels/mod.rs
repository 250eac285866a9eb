//! GPU kernels: each has a WGSL source in `shaders/`, a host wrapper here and a CPU reference in
//! `reference/` of the same name.

pub mod attention;
pub mod layer_norm;
pub mod matmul;
