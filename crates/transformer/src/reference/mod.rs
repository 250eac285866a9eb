//! The CPU reference of a Transformer layer and of the whole model, in f64, composed of the engine's
//! reference ops ([`wgpu_attention::reference`]): the ground truth of the GPU layers, the model's
//! logits and loss and every parameter gradient.

pub mod transformer;
pub mod transformer_layer;
