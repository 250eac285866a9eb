//! GPU kernels: each has a WGSL source in `shaders/`, a host wrapper here and a CPU reference in
//! `reference/` of the same name.

pub mod attention;
pub mod cross_entropy;
pub(crate) mod dispatch;
pub mod elementwise;
pub mod embedding;
pub mod kv_cache;
pub mod layer_norm;
pub mod linear;
pub mod matmul;
pub mod optimizer;
pub mod rope;
pub mod sampling;
