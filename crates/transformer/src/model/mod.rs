//! Whole models composed of [`crate::layers`]: the encoder-decoder Transformer and its decoder-only
//! language-model configuration. The CPU counterpart is [`crate::reference::transformer`].

pub mod maps;
pub mod pretrained;
pub mod transformer;

pub use maps::{attention_rollout, AttentionSite};
pub use transformer::{Batch, BatchShape, PackedShape, Transformer, TransformerConfig};
