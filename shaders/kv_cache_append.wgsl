// KV cache append: the new keys (or values) of a decoding step, a strided [B, L, H, D] view (the K or V
// columns of a projection), copied into the cache [B, max_len, H, D] after each sequence's cached
// tokens. Row l < q_len[b] of sequence b goes to position kv_len[b] - q_len[b] + l (lens = [q_lens,
// kv_lens] of SeqLens, kv_lens counting the new tokens); rows past q_len[b] are padding and are not
// copied. One invocation per element.
//
// Paged caches (PAGE > 0): the cache is a pool [1, blocks * PAGE, H, D] and position p of sequence b
// is pool row block_table[b * TABLE_STRIDE + p / PAGE] * PAGE + p % PAGE (ids checked on the host,
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
    pad0: u32,
    pad1: u32,
}

override WG: u32 = 64u;
override PAGE: u32 = 0u;
override TABLE_STRIDE: u32 = 1u;
override POOL_BLOCKS: u32 = 1u;
// PAGE as a divisor (never 0, which a constant division would reject even where unused).
override PAGE_ROWS: u32 = max(PAGE, 1u);

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> new_rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<f32>;
@group(0) @binding(3) var<storage, read> lens: array<u32>;
// [B, TABLE_STRIDE] block ids (PAGE > 0; another read-only buffer otherwise).
@group(0) @binding(4) var<storage, read> block_table: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y * params.grid_x * WG + gid.x;
    if i >= params.batch * params.seq * params.heads * params.dim {
        return;
    }
    let d = i % params.dim;
    let h = (i / params.dim) % params.heads;
    let l = (i / (params.dim * params.heads)) % params.seq;
    let b = i / (params.dim * params.heads * params.seq);
    let new_len = lens[b];
    if l >= new_len {
        return;
    }
    let p = lens[params.batch + b] - new_len + l;
    let src = params.view_offset + b * params.stride_b + l * params.stride_s + h * params.stride_h + d;
    var row = b * params.max_len + p;
    if PAGE > 0u {
        row = min(block_table[b * TABLE_STRIDE + p / PAGE_ROWS], POOL_BLOCKS - 1u) * PAGE_ROWS + p % PAGE_ROWS;
    }
    cache[(row * params.heads + h) * params.dim + d] = new_rows[src];
}
