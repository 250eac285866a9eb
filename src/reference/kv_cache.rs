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
