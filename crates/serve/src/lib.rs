//! # wgpu-attention-serve
//!
//! Inference: incremental generation with a trained [`Transformer`](wgpu_attention_transformer::model::Transformer) (decoder-only or
//! encoder-decoder). A [`Generator`] holds a key/value cache per decoder layer and its own activation
//! buffers, allocated once, over the model's parameters (shared, not copied: it sees what training
//! writes). Prompts are fed in chunks (prefill), then one token per sequence per step; each step
//! appends the new keys and values to the cache and attends over it with decode attention, so a token
//! costs one pass over the cache instead of a forward over the whole sequence. Only the last
//! position's logits are computed, tokens are sampled on the GPU, and only their ids are read back.
//! The encoder runs once per source, and every decoder layer projects its cross-attention keys and
//! values once. A [`PagedKvCache`] holds many sequences' keys and values in shared pools of
//! fixed-size blocks (join, leave, fork with copy-on-write).

#![warn(missing_docs)]

mod generator;
pub mod kv_cache;
pub mod paged_cache;
pub mod server;

pub use generator::{
    CacheConfig, CacheLayout, Draft, GenerateOptions, Generated, Generator, GeneratorShape,
};
pub use kv_cache::{KvCache, StepLens};
pub use paged_cache::{PagedKvCache, PagedKvCacheConfig};
pub use server::{Finish, Request, Server, Token};
pub use wgpu_attention::kernels::kv_cache::KvFormat;

/// The generation guide's code (`docs/generation.md`), compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/generation.md")]
pub struct GenerationGuideDoctests;

/// The pretrained-model guide's code (`docs/pretrained.md`), compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/pretrained.md")]
pub struct PretrainedGuideDoctests;
