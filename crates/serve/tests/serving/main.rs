//! The serving crate's integration tests, one binary (one link, one process, one pool of test
//! threads); a module per concern. `browser.rs` runs in a browser (wasm32) and stays apart.

#[path = "../../../../tests/common/mod.rs"]
mod common;

mod generation;
mod hf_checkpoints;
mod paged_cache;
mod precompile;
