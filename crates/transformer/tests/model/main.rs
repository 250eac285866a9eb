//! The Transformer crate's integration tests, one binary (one link, one process, one pool of test
//! threads); a module per layer or concern.

#[path = "../../../../tests/common/mod.rs"]
mod common;

mod attention_maps;
mod params;
mod training;
mod transformer;
mod transformer_layer;
