//! Layers: each composes ops from [`wgpu_attention::kernels`] into a forward that records into a caller's
//! command encoder and a backward that writes every parameter gradient. Activations and gradients
//! are allocated once, when a layer is built for its input shape, and reused on every call.
//! CPU counterparts live in [`crate::reference`] under the same names.

pub mod attention;
pub mod decoder;
pub mod embedding;
pub mod encoder;
pub mod feed_forward;
pub mod linear;
pub mod params;
pub mod residual;
pub mod scores;
pub mod stack;
