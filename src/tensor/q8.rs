//! Int8 tensors with one f32 scale per row of the last dimension: the storage of an int8 key/value
//! cache. A row of `D` values (`D` a multiple of 4) is `D / 4` words of four int8 each,
//! `pack4x8snorm(x / s)` in WGSL's rounding, followed by the scale `s = max |x|` as f32 bits:
//! `x ≈ unpack4x8snorm(word) * s`, within `s / 254` of each value (plus f32 rounding). A row holding
//! a non-finite value is stored with a NaN scale, so it reads back as NaN rather than as numbers
//! that were never written. 4 + 4 / D bytes per value against 4 for f32: 3.76x smaller at D = 64.
//!
//! The quantisation is stated here for uploads and read-backs (the kernels state it in
//! `shaders/kv_cache_append_int8.wgsl`, the CPU reference in `reference::kv_cache`).

use super::GpuTensor;
use crate::device::{Context, ContextId};
use crate::error::{Error, Result};

/// An int8 tensor of shape `[.., D]` with one f32 scale per row of `D` values, in one storage
/// buffer of `D / 4 + 1` words per row (see the module documentation for the layout).
pub struct GpuTensorQ8 {
    words: GpuTensor,
    shape: Vec<usize>,
}

/// Words a row of `dim` values occupies: `dim / 4` of packed values and the scale.
pub(crate) fn row_words(dim: usize) -> usize {
    dim / 4 + 1
}

fn check_shape(shape: &[usize]) -> Result<usize> {
    match shape.last() {
        Some(&d) if d > 0 && d % 4 == 0 => Ok(d),
        _ => Err(Error::shape(
            "int8 tensor",
            format!("has shape {shape:?}; its last dimension (one scaled row) must be a positive multiple of 4"),
        )),
    }
}

/// The words of `rows` of `dim` values (`data.len()` a multiple of `dim`).
fn quantize(data: &[f32], dim: usize) -> Vec<u32> {
    let mut words = Vec::with_capacity(data.len() / dim * row_words(dim));
    for row in data.chunks_exact(dim) {
        let finite = row.iter().all(|x| x.is_finite());
        let scale = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let inv = 1.0 / scale;
        for four in row.chunks_exact(4) {
            let mut word = 0u32;
            for (i, &x) in four.iter().enumerate() {
                let q = match scale > 0.0 && finite {
                    // WGSL's pack4x8snorm: floor(0.5 + 127 * clamp(e, -1, 1)).
                    true => (0.5 + 127.0 * (x * inv).clamp(-1.0, 1.0)).floor() as i8,
                    false => 0,
                };
                word |= (q as u8 as u32) << (8 * i);
            }
            words.push(word);
        }
        words.push(if finite { scale } else { f32::NAN }.to_bits());
    }
    words
}

/// Values of rows stored as `words` (`dim` values per row).
fn dequantize(words: &[u32], dim: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(words.len() / row_words(dim) * dim);
    for row in words.chunks_exact(row_words(dim)) {
        let scale = f32::from_bits(row[dim / 4]);
        for &word in &row[..dim / 4] {
            for i in 0..4 {
                let q = (word >> (8 * i)) as u8 as i8;
                // WGSL's unpack4x8snorm: max(q / 127, -1).
                out.push((q as f32 / 127.0).max(-1.0) * scale);
            }
        }
    }
    out
}

impl GpuTensorQ8 {
    /// A tensor of zeros (zero values, zero scales) of `shape`, the last dimension a multiple of 4.
    pub fn zeros(ctx: &Context, shape: &[usize]) -> Result<Self> {
        let words = Self::words_shape(shape)?;
        Ok(Self {
            words: GpuTensor::zeros(ctx, &words)?,
            shape: shape.to_vec(),
        })
    }

    /// `data` (row-major, `shape`) quantised on the host and uploaded.
    pub fn from_f32(ctx: &Context, data: &[f32], shape: &[usize]) -> Result<Self> {
        let words_shape = Self::words_shape(shape)?;
        if data.len() != shape.iter().product::<usize>() {
            return Err(Error::shape(
                "data",
                format!(
                    "has {} values; shape {shape:?} needs {}",
                    data.len(),
                    shape.iter().product::<usize>()
                ),
            ));
        }
        let words = quantize(data, shape[shape.len() - 1]);
        Ok(Self {
            words: GpuTensor::from_slice(ctx, bytemuck::cast_slice(&words), &words_shape)?,
            shape: shape.to_vec(),
        })
    }

    fn words_shape(shape: &[usize]) -> Result<Vec<usize>> {
        let dim = check_shape(shape)?;
        let mut words = shape.to_vec();
        *words.last_mut().expect("checked non-empty") = row_words(dim);
        Ok(words)
    }

    /// The logical shape (values, not words).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Values per scaled row (the last dimension).
    pub fn row_len(&self) -> usize {
        self.shape[self.shape.len() - 1]
    }

    /// Bytes of storage, scales included.
    pub fn size_bytes(&self) -> u64 {
        self.words.size_bytes()
    }

    /// The storage buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        self.words.buffer()
    }

    /// The context whose device holds the buffer (`None` for a user's buffer).
    pub fn context(&self) -> Option<ContextId> {
        self.words.context()
    }

    /// The raw words, `[.., D / 4 + 1]`, as the kernels bind them (their f32 values are bit
    /// patterns, not numbers).
    pub(crate) fn words(&self) -> &GpuTensor {
        &self.words
    }

    /// The same storage seen with another logical shape of the same row length and count.
    pub fn reshape(&self, shape: &[usize]) -> Result<GpuTensorQ8> {
        let words_shape = Self::words_shape(shape)?;
        if shape.last() != self.shape.last() {
            return Err(Error::shape(
                "shape",
                format!(
                    "{shape:?} changes the scaled row length of {:?}",
                    self.shape
                ),
            ));
        }
        Ok(Self {
            words: self.words.reshape(&words_shape)?,
            shape: shape.to_vec(),
        })
    }

    /// The stored words read back (blocking): `D / 4` packed words then the scale's bits, per row.
    pub fn to_words(&self, ctx: &Context) -> Result<Vec<u32>> {
        crate::device::block_on("GpuTensorQ8::to_words", self.to_words_async(ctx))
    }

    /// Async form of [`GpuTensorQ8::to_words`] (what a browser must use).
    pub async fn to_words_async(&self, ctx: &Context) -> Result<Vec<u32>> {
        let words = self.words.to_vec_async(ctx).await?;
        Ok(words.into_iter().map(f32::to_bits).collect())
    }

    /// The values the tensor holds (blocking): each int8 times its row's scale.
    pub fn to_vec(&self, ctx: &Context) -> Result<Vec<f32>> {
        crate::device::block_on("GpuTensorQ8::to_vec", self.to_vec_async(ctx))
    }

    /// Async form of [`GpuTensorQ8::to_vec`].
    pub async fn to_vec_async(&self, ctx: &Context) -> Result<Vec<f32>> {
        Ok(dequantize(&self.to_words_async(ctx).await?, self.row_len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_within_half_a_step() {
        let data: Vec<f32> = (0..16).map(|i| (i as f32 - 7.3) * 0.37).collect();
        let back = dequantize(&quantize(&data, 8), 8);
        for (row, back) in data.chunks(8).zip(back.chunks(8)) {
            let scale = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (x, y) in row.iter().zip(back) {
                assert!((x - y).abs() <= scale / 254.0 * 1.0001, "{x} {y}");
            }
            // The largest value is exact: it quantises to +-127.
            let i = row.iter().position(|x| x.abs() == scale).unwrap();
            assert_eq!(row[i], back[i]);
        }
    }

    #[test]
    fn non_finite_rows_read_back_as_nan_and_zero_rows_as_zero() {
        let data = [1.0, f32::INFINITY, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0];
        let back = dequantize(&quantize(&data, 4), 4);
        assert!(back[..4].iter().all(|x| x.is_nan()));
        assert_eq!(&back[4..], &[0.0; 4]);
    }
}
