//! Whole models composed of [`crate::layers`]: the encoder-decoder Transformer and its decoder-only
//! language-model configuration. The CPU counterpart is [`crate::reference::transformer`].

pub mod transformer;

pub use transformer::{Batch, BatchShape, Transformer, TransformerConfig};
