// Paged K and V (PAGE > 0): K and V are pools [1, blocks * PAGE, Hkv, D] shared by every sequence,
// and key j of sequence b is pool row block_table[b * table_stride + j / PAGE] * PAGE + j % PAGE
// (table_stride and the pool's blocks in params). Block ids are checked on the host; the clamp only
// keeps a stale table from reading past the pool. The kernels that can read a paged cache (decode,
// and the fused forward of a prefill-shaped decoding step) take this file; the others take
// attention/kv_pages_none.wgsl.

// Rows per cache block (0: contiguous K and V).
override PAGE: u32 = 0u;
// PAGE as a divisor (never 0, which a constant division would reject even where unused).
override PAGE_ROWS: u32 = max(PAGE, 1u);

// The block table [B, table_stride] (PAGE > 0; another read-only buffer otherwise).
@group(0) @binding(7) var<storage, read> block_table: array<u32>;

// The cache row of key j of sequence b: j, or in a paged cache its row of the pool.
fn cache_row(b: u32, j: u32) -> u32 {
    if PAGE == 0u {
        return j;
    }
    let block = min(block_table[b * params.table_stride + j / PAGE_ROWS], params.pool_blocks - 1u);
    return block * PAGE_ROWS + j % PAGE_ROWS;
}

// Element index of row s of sequence b, head h, of an input view: view_index, except that K and V
// rows of a paged cache are pool rows.
fn input_index(view: u32, b: u32, s: u32, h: u32) -> u32 {
    if PAGE > 0u && (view == VIEW_K || view == VIEW_V) {
        return view_index(view, 0u, cache_row(b, s), h);
    }
    return view_index(view, b, s, h);
}
