//! # wgpu-attention-transformer
//!
//! A Transformer on [`wgpu_attention`]'s kernels: [`layers`] (each a forward recorded into the
//! caller's encoder and a backward that writes every parameter gradient), whole [`model`]s
//! (encoder-decoder and decoder-only, Hugging Face checkpoints in [`model::pretrained`]),
//! [`training`] (one step in one submission, AdamW, checkpoints), and the f64 CPU
//! [`reference`](mod@reference) of a layer and of the whole model that the GPU versions are tested against.
//! Incremental generation and serving are in `wgpu-attention-serve`.

#![warn(missing_docs)]

pub mod layer_case;
pub mod layers;
pub mod model;
pub mod reference;
pub mod training;

pub use model::{Batch, BatchShape, PackedShape, Transformer, TransformerConfig};
pub use training::Trainer;

/// The training guide's code (`docs/training.md`), compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/training.md")]
pub struct TrainingGuideDoctests;
