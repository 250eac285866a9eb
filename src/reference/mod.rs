//! CPU references: the plainest f64 loops that match SPEC.md, the ground truth every GPU kernel is
//! tested against. Each is itself checked by central finite differences in the tests.

pub mod additive;
pub mod attention;
pub mod compare;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod kv_cache;
pub mod layer_norm;
pub mod linear;
pub mod optimizer;
pub mod rope;
pub mod sampling;
