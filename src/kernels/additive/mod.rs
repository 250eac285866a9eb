//! Fused additive (Bahdanau) attention, forward and backward (`shaders/additive_*.wgsl`): scores
//! `e_ij = scale * sum_c w[h, c] tanh(a[i, h, c] + b[j, h, c] + bias[h, c])` from query and key
//! projections `a [B, Lq, H, Da]`, `b [B, Lk, H, Da]` (strided views, like Q and K), an online
//! softmax over the visible keys and `O = P V`. The `[Lq, Lk, Da]` tensor of tanh arguments is
//! never formed: the kernels recompute each tanh where they need it (O(L) memory). The backward
//! gives `da`, `db`,
//! `dv` and the score vector's and bias's gradients `dw`, `dbias` `[H, Da]`, deterministically: a
//! query-side kernel (da, D, per-row shares of dw), a key-side kernel (db, dV), and a fixed-order
//! sum. Masks: causal, per-batch lengths and windows, as in dot-product attention (the shared
//! header's rules). CPU reference: [`crate::reference::additive`].
//!
//! One job per file: `call` (the score parameters, gradients and the argument checks), `tiles`
//! (workgroup tiles, lanes per row and loop cost), `sources` (each kernel's assembled source and
//! constants), `forward` (the fused forward and decoding), `backward` (the fused backward),
//! `unfused` (the baselines that materialise the scores, and the probabilities; the route the
//! tuner may pick), `tune` (fused against unfused per key), `precompile`.
//! Shaders: `shaders/additive/`. Masks, options and bindings are dot-product attention's
//! ([`crate::kernels::attention`]).

mod backward;
mod call;
mod forward;
mod precompile;
mod sources;
mod tiles;
mod tune;
mod unfused;

pub use backward::{additive_backward, additive_backward_into, additive_backward_workspace};
pub use call::{AdditiveGrads, AdditiveScores};
pub use forward::{additive_decode_into, additive_forward, additive_forward_into};
pub use precompile::additive_precompile;
pub(crate) use sources::shader_sources;
pub use unfused::{additive_backward_unfused, additive_forward_unfused, additive_probabilities};

/// Largest score dim `Da` and value head dim the additive kernels hold per invocation.
pub const MAX_ADDITIVE_DIM: usize = 128;
/// Storage buffers each fused backward kernel binds: the query side lengths, a, b, v, O, dO, da and
/// the workspace (which holds w, the bias and lse too), the key side dO, db and dV in place of O,
/// dO and da. WebGPU's default limit.
pub const ADDITIVE_BACKWARD_STORAGE_BUFFERS: u32 = 8;
