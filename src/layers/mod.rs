//! Layers: each composes ops from [`crate::kernels`] into a forward that returns what its backward
//! needs, and a backward that returns every parameter gradient. CPU counterparts live in
//! [`crate::reference`] under the same names.

pub mod transformer_layer;
