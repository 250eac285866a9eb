//! CPU reference for rotary position embeddings (RoFormer), in f64. GPU counterpart:
//! [`crate::kernels::rope`].

pub use crate::spec::RopeLayout;

/// The rotation angle of pair `k` at position `p`: `p * base^(-2k / rotary_dim)`.
pub fn rope_angle(p: usize, k: usize, base: f64, rotary_dim: usize) -> f64 {
    p as f64 * base.powf(-2.0 * k as f64 / rotary_dim as f64)
}

/// Rotates the first `rotary_dim` dims of every row of a contiguous `[B, L, H, D]` tensor by the angles
/// of positions `offset + l` (`sign` -1 rotates back: the backward, applied to a gradient).
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &[f64],
    [b, l, h, d]: [usize; 4],
    base: f64,
    rotary_dim: usize,
    layout: RopeLayout,
    offset: usize,
    sign: f64,
) -> Vec<f64> {
    let mut y = x.to_vec();
    let pairs = rotary_dim / 2;
    for bi in 0..b {
        for li in 0..l {
            for hi in 0..h {
                let row = ((bi * l + li) * h + hi) * d;
                for k in 0..pairs {
                    let (i1, i2) = match layout {
                        RopeLayout::Interleaved => (row + 2 * k, row + 2 * k + 1),
                        RopeLayout::Half => (row + k, row + k + pairs),
                    };
                    let angle = sign * rope_angle(offset + li, k, base, rotary_dim);
                    let (s, c) = angle.sin_cos();
                    y[i1] = x[i1] * c - x[i2] * s;
                    y[i2] = x[i1] * s + x[i2] * c;
                }
            }
        }
    }
    y
}
