//! The engine's integration tests, one binary: one link, one process whose shared contexts every
//! test uses, and one pool of test threads over all of them (a binary per file left a core idle
//! while its longest test ran, and linked wgpu 24 times). A module per op or concern; its own
//! documentation says what it checks. `tests/environment.rs` sets process-wide environment variables
//! and stays a binary of its own.

#[path = "../common/mod.rs"]
mod common;

mod additive;
mod api_boundary;
mod attention_backward;
mod attention_decode;
mod attention_f16;
mod attention_forward;
mod bench_support;
mod cross_entropy;
mod elementwise;
mod embedding;
mod errors;
mod kv_cache;
mod layer_norm;
mod linear;
mod nan;
mod optimizer;
mod packed;
mod precompile;
mod reference;
mod rope;
mod sampling;
mod shaders;
mod tuning;
