//! CPU reference for rotary position embeddings (RoFormer), in f64. GPU counterpart:
//! [`crate::kernels::rope`].

pub use crate::spec::{RopeLayout, RopeScaling};

/// The rotation angle of pair `k` at position `p`: `p * base^(-2k / rotary_dim)`.
pub fn rope_angle(p: usize, k: usize, base: f64, rotary_dim: usize) -> f64 {
    rope_angle_scaled(p, k, base, rotary_dim, None)
}

/// [`rope_angle`] with the pair's frequency stretched by `scaling` (see [`RopeScaling`]).
pub fn rope_angle_scaled(
    p: usize,
    k: usize,
    base: f64,
    rotary_dim: usize,
    scaling: Option<RopeScaling>,
) -> f64 {
    let inv = base.powf(-2.0 * k as f64 / rotary_dim as f64);
    let inv = match scaling {
        None => inv,
        Some(RopeScaling::Linear { factor }) => inv / factor as f64,
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_positions,
        }) => {
            let (factor, low, high) = (
                factor as f64,
                low_freq_factor as f64,
                high_freq_factor as f64,
            );
            let original = original_max_positions as f64;
            let wavelength = 2.0 * std::f64::consts::PI / inv;
            if wavelength < original / high {
                inv
            } else if wavelength > original / low {
                inv / factor
            } else {
                let s = (original / wavelength - low) / (high - low);
                (1.0 - s) * inv / factor + s * inv
            }
        }
    };
    p as f64 * inv
}

/// What rotates and how fast: the first `rotary_dim` dims of each row, paired by `layout`, pair `k`
/// at the inverse frequency `base^(-2k / rotary_dim)` stretched by `scaling`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rotation {
    /// The frequency base (10000 in RoFormer).
    pub base: f64,
    /// How many leading dims rotate (even).
    pub rotary_dim: usize,
    /// How the rotated dims are paired.
    pub layout: RopeLayout,
    /// How the frequencies are stretched, if at all.
    pub scaling: Option<RopeScaling>,
}

/// Rotates the first `rotary_dim` dims of every row of a contiguous `[B, L, H, D]` tensor by the angles
/// of positions `offset + l` (`sign` -1 rotates back: the backward, applied to a gradient).
pub fn rope(
    x: &[f64],
    shape: [usize; 4],
    base: f64,
    rotary_dim: usize,
    layout: RopeLayout,
    offset: usize,
    sign: f64,
) -> Vec<f64> {
    let rotation = Rotation {
        base,
        rotary_dim,
        layout,
        scaling: None,
    };
    rope_scaled(x, shape, rotation, offset, sign)
}

/// [`rope`] with any [`Rotation`], its frequencies stretched by its `scaling`.
pub fn rope_scaled(
    x: &[f64],
    [b, l, h, d]: [usize; 4],
    rotation: Rotation,
    offset: usize,
    sign: f64,
) -> Vec<f64> {
    let Rotation {
        base,
        rotary_dim,
        layout,
        scaling,
    } = rotation;
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
                    let angle = sign * rope_angle_scaled(offset + li, k, base, rotary_dim, scaling);
                    let (s, c) = angle.sin_cos();
                    y[i1] = x[i1] * c - x[i2] * s;
                    y[i2] = x[i1] * s + x[i2] * c;
                }
            }
        }
    }
    y
}
