// Shared by the key/value cache appends (kv_cache_append.wgsl into f32 caches,
// kv_cache_append_int8.wgsl into int8 ones) and the gathers out of a cache (kv_cache_gather.wgsl,
// kv_cache_gather_int8.wgsl): the parameters, the lengths and block table, and where each row goes
// or comes from. The new keys (or values) of a step are a strided [B, L, H, D] view (the K or V
// columns of a projection); row l < q_len[b] of sequence b goes to position kv_len[b] - q_len[b] + l
// (lens = [q_lens, kv_lens] of SeqLens, kv_lens counting the new tokens); rows past q_len[b] are
// padding and are not copied. Packed new rows (a packed prefill, SeqLens::packed): sequence b's new
// rows are rows q_start[b] .. of a [rows, H, D] tensor, the starts after the lengths in lens.
//
// Paged caches (PAGE > 0): the cache is a pool [1, blocks * PAGE, H, D] and position p of sequence b
// is pool row block_table[b * table_stride + p / PAGE] * PAGE + p % PAGE (ids checked on the host,
// clamped here only against a stale table).

struct Params {
    batch: u32,
    seq: u32,
    heads: u32,
    dim: u32,
    max_len: u32,
    grid_x: u32,
    view_offset: u32,
    stride_b: u32,
    stride_s: u32,
    stride_h: u32,
    // 1: the new rows are packed (see above).
    packed: u32,
    // Paged caches: block ids per sequence in the table, blocks in the pool (uniforms, so that a
    // pool or table of another size compiles nothing).
    table_stride: u32,
    pool_blocks: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
}

override WG: u32 = 64u;
override PAGE: u32 = 0u;
// PAGE as a divisor (never 0, which a constant division would reject even where unused).
override PAGE_ROWS: u32 = max(PAGE, 1u);

@group(0) @binding(0) var<uniform> params: Params;
// Binding 1, the rows read, is each kernel's own: a step's new rows (the appends, f32) or a cache
// (the gathers: f32 values, or int8 words).
@group(0) @binding(3) var<storage, read> lens: array<u32>;
// [B, table_stride] block ids (PAGE > 0; another read-only buffer otherwise).
@group(0) @binding(4) var<storage, read> block_table: array<u32>;

// What one invocation of a cache kernel owns in the row-major [batch, seq, heads, inner] grid it
// covers (inner: a head's values, four-value words, or 1 for a whole row): its flat index `at` and
// coordinates (`s`: a new row for the appends, a position for the gathers).
struct GridItem {
    at: u32,
    b: u32,
    s: u32,
    h: u32,
    x: u32,
    // Inside the grid (the dispatch rounds up to whole workgroups).
    live: bool,
}

fn grid_item(gid: vec3<u32>, inner: u32) -> GridItem {
    let i = gid.y * params.grid_x * WG + gid.x;
    let x = i % inner;
    let h = (i / inner) % params.heads;
    let s = (i / (inner * params.heads)) % params.seq;
    let b = i / (inner * params.heads * params.seq);
    return GridItem(i, b, s, h, x, i < params.batch * params.seq * params.heads * inner);
}

// Whether new row l of sequence b is one of its q_len[b] new tokens (the others are padding).
fn is_new_row(b: u32, l: u32) -> bool {
    return l < lens[b];
}

// The cache row (of the [B * max_len] rows, or the pool's) of position p of sequence b.
fn position_row(b: u32, p: u32) -> u32 {
    if PAGE > 0u {
        return min(block_table[b * params.table_stride + p / PAGE_ROWS], params.pool_blocks - 1u) * PAGE_ROWS + p % PAGE_ROWS;
    }
    return b * params.max_len + p;
}

// The cache row that new row l of sequence b fills.
fn cache_row(b: u32, l: u32) -> u32 {
    return position_row(b, lens[params.batch + b] - lens[b] + l);
}

// Element index of value 0 of new row l of sequence b, head h.
fn new_row_start(b: u32, l: u32, h: u32) -> u32 {
    var first = b * params.stride_b;
    if params.packed != 0u {
        first = lens[2u * params.batch + b] * params.stride_s;
    }
    return params.view_offset + first + l * params.stride_s + h * params.stride_h;
}
