//! CPU reference for the key/value cache append and the paged cache's layout. GPU counterpart:
//! [`crate::kernels::kv_cache`].

/// Copies row `l < q_lens[b]` of `new [B, L, H, D]` (contiguous) to position
/// `kv_lens[b] - q_lens[b] + l` of `cache [B, max_len, H, D]`.
pub fn kv_cache_append(
    cache: &mut [f64],
    max_len: usize,
    new: &[f64],
    [b, l, h, d]: [usize; 4],
    q_lens: &[u32],
    kv_lens: &[u32],
) {
    for bi in 0..b {
        let start = (kv_lens[bi] - q_lens[bi]) as usize;
        for li in 0..q_lens[bi] as usize {
            let from = &new[(bi * l + li) * h * d..][..h * d];
            cache[(bi * max_len + start + li) * h * d..][..h * d].copy_from_slice(from);
        }
    }
}

/// The first `len` positions of a paged sequence, `[len, row]` contiguous: position `p` is row
/// `blocks[p / page] * page + p % page` of `pool` (`row` values per row).
pub fn gather_paged(pool: &[f64], blocks: &[u32], page: usize, len: usize, row: usize) -> Vec<f64> {
    (0..len)
        .flat_map(|p| {
            let at = (blocks[p / page] as usize * page + p % page) * row;
            pool[at..at + row].iter().copied()
        })
        .collect()
}

/// Int8 rows of an int8 cache (SPEC's statement of `GpuTensorQ8`): a row of `dim` values (`dim` a
/// multiple of 4) becomes `dim / 4` words of four int8, `q = floor(0.5 + 127 clamp(x / s, -1, 1))`
/// (two's complement, first value in the low byte), then the scale `s = max |x|` as f32 bits; a row
/// with a non-finite value has scale NaN and zero values, a zero row scale 0.
pub fn quantize_int8_rows(x: &[f64], dim: usize) -> Vec<u32> {
    let mut words = Vec::new();
    for row in x.chunks_exact(dim) {
        let finite = row.iter().all(|v| v.is_finite());
        let scale = row.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for four in row.chunks_exact(4) {
            let mut word = 0u32;
            for (i, &v) in four.iter().enumerate() {
                let q = if finite && scale > 0.0 {
                    (0.5 + 127.0 * (v / scale).clamp(-1.0, 1.0)).floor() as i32
                } else {
                    0
                };
                word |= (q as i8 as u8 as u32) << (8 * i);
            }
            words.push(word);
        }
        let scale = if finite { scale as f32 } else { f32::NAN };
        words.push(scale.to_bits());
    }
    words
}

/// The values of int8 rows stored as [`quantize_int8_rows`] writes them: `max(q / 127, -1) * s`.
pub fn dequantize_int8_rows(words: &[u32], dim: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for row in words.chunks_exact(dim / 4 + 1) {
        let scale = f32::from_bits(row[dim / 4]) as f64;
        for &word in &row[..dim / 4] {
            for i in 0..4 {
                let q = (word >> (8 * i)) as u8 as i8;
                out.push((q as f64 / 127.0).max(-1.0) * scale);
            }
        }
    }
    out
}
