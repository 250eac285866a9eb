// Shared by every attention kernel: the parameter block, strided BSHD addressing and the mask rules
// of SPEC.md. The host prepends this file to each attention shader (WGSL has no #include).

// A strided [batch, seq, heads, head_dim] view of an f32 buffer; head_dim is contiguous. Units: elements.
struct View {
    offset: u32,
    stride_b: u32,
    stride_s: u32,
    stride_h: u32,
}

struct Params {
    batch: u32,
    heads: u32,
    kv_heads: u32,
    q_seq: u32,
    kv_seq: u32,
    dk: u32,
    dv: u32,
    flags: u32,
    scale: f32,
    // Workgroups per (batch, head): query blocks (forward, dQ) or key blocks (dK/dV).
    blocks: u32,
    // Workgroups are dispatched as a 2-D grid (65535 per dimension) and linearised.
    grid_x: u32,
    total_groups: u32,
    // The slice of the kernel's long loop this dispatch runs (keys for forward and dQ, flattened
    // (query head of the group, query row) for dK/dV). The host splits long loops into several
    // dispatches where the driver caps loop iterations (llvmpipe: 65535 per invocation, KERNELS.md);
    // every dispatch after the first merges into the outputs (accumulate = 1).
    chunk_begin: u32,
    chunk_end: u32,
    accumulate: u32,
    // Split-KV workgroups per query block of the tiled forward; each covers a share of the block's
    // key tiles and writes a partial result that attention/forward_merge.wgsl combines.
    splits: u32,
    // Score modifiers (FLAG_SOFTCAP: the cap; see modify_scores).
    softcap: f32,
    // Sliding window (FLAG_WINDOW): keys at most window_left before and window_right after the
    // query's aligned position are visible (see key_start, key_end).
    window_left: u32,
    window_right: u32,
    // Additive score bias (FLAG_BIAS): element offset and strides (b, query head, query row, key) of
    // the [B or 1, H or 1, Lq, Lk] view in score_bias; broadcast dimensions have stride 0.
    bias_offset: u32,
    bias_stride_b: u32,
    bias_stride_h: u32,
    bias_stride_i: u32,
    bias_stride_j: u32,
    // The bias's batch and head counts (1 where broadcast); the gradient kernel's slice shape.
    bias_batch: u32,
    bias_heads: u32,
    // Relative-position buckets (FLAG_RELATIVE, T5): score_bias is the [H, buckets] table.
    // rel_buckets: buckets per direction; distances below rel_exact have a bucket each; a distance n
    // at or past it is in bucket rel_exact + (the number of rel_thresholds <= n). Unused thresholds
    // are 0xffffffff.
    rel_buckets: u32,
    rel_exact: u32,
    rel_threshold_vec4s: u32,
    rel_table_stride: u32,
    // Decode attention: keys per split-KV slice.
    split_keys: u32,
    // The host's record of PACKED_VIEWS (the kernels read the constant).
    packed_views: u32,
    // Decode attention's paged cache: block ids per sequence in the block table, and blocks in the
    // pool (uniforms, so that a pool or table of another size compiles nothing).
    table_stride: u32,
    pool_blocks: u32,
    pad0: u32,
    pad1: u32,
    rel_thresholds: array<vec4<u32>, 8>,
    // Per-head ALiBi slopes (FLAG_ALIBI_SLOPES), slope of head h at [h / 4][h % 4].
    alibi_slopes: array<vec4<f32>, 16>,
    views: array<View, 8>,
}

const VIEW_Q: u32 = 0u;
const VIEW_K: u32 = 1u;
const VIEW_V: u32 = 2u;
const VIEW_O: u32 = 3u;
const VIEW_DO: u32 = 4u;
const VIEW_DQ: u32 = 5u;
const VIEW_DK: u32 = 6u;
const VIEW_DV: u32 = 7u;

const FLAG_CAUSAL: u32 = 1u;
const FLAG_Q_LENS: u32 = 2u;
const FLAG_KV_LENS: u32 = 4u;
const FLAG_SOFTCAP: u32 = 8u;
const FLAG_ALIBI: u32 = 16u;
const FLAG_WINDOW: u32 = 32u;
const FLAG_BIAS: u32 = 64u;
const FLAG_RELATIVE: u32 = 128u;
const FLAG_REL_BIDIRECTIONAL: u32 = 256u;
const FLAG_ALIBI_SLOPES: u32 = 512u;
const FLAG_ALIGN_LENS: u32 = 1024u;
// dK and dV bound once, through dk_buf (attention/output_pair.wgsl).
const FLAG_SHARED_OUTPUTS: u32 = 2048u;

// Masked scores are tracked with explicit validity, never through inf arithmetic (Metal may use fast
// math). This finite sentinel is only ever a running-max seed; it is never exponentiated on its own.
const NEG_BIG: f32 = -3.0e38;

@group(0) @binding(0) var<uniform> params: Params;

// The flags fixed when the pipeline was created, or NO_FIXED_FLAGS to read them from the uniform,
// so that one pipeline serves every mask and modifier. The GPU and tensor-core families' backward
// of a call without masks or modifiers, or causal alone, fixes them: the paths of the other masks
// fold away, which NVIDIA's compiler rewards far beyond RDNA's estimate (2x on an H200,
// BENCHMARKS.md).
const NO_FIXED_FLAGS: u32 = 0xffffffffu;
override FIXED_FLAGS: u32 = 0xffffffffu;

// Whether any of the flag bits f is set.
fn has_flag(f: u32) -> bool {
    if FIXED_FLAGS != NO_FIXED_FLAGS {
        return (FIXED_FLAGS & f) != 0u;
    }
    return (params.flags & f) != 0u;
}
// Per-batch valid lengths: q_len[b] at [b], kv_len[b] at [batch + b]; for packed batches the first
// rows, q_start[b] at [2 batch + b] and kv_start[b] at [3 batch + b]. A 1-element dummy when unused.
@group(0) @binding(1) var<storage, read> seq_lens: array<u32>;
// Whether the call has a score bias or a relative-position table: without one the host replaces the
// SCORE_BIAS block below by a score_bias_terms that returns zeros and binds no score_bias, one storage
// buffer fewer per kernel (the fused backward then fits WebGPU's default of 8).
override SCORE_BIAS: bool = true;

// -inf read from a private variable: a bitcast of the constant would be a const-expression, and WGSL
// makes one that evaluates to an infinity a shader-creation error (Tint refuses it; naga does not).
var<private> NEG_INF_BITS: u32 = 0xff800000u;

fn neg_inf() -> f32 {
    return bitcast<f32>(NEG_INF_BITS);
}

// The views of the key side (K, V and their gradients); the others are of the query side.
const KEY_SIDE_VIEWS: u32 = (1u << VIEW_K) | (1u << VIEW_V) | (1u << VIEW_DK) | (1u << VIEW_DV);

fn key_side(view: u32) -> bool {
    return ((KEY_SIDE_VIEWS >> view) & 1u) != 0u;
}

// Packed views, one bit per view (1 << VIEW_*): see view_index. A pipeline constant, so that the
// padded kernels compile exactly as without packing (no per-row test of the layout).
override PACKED_VIEWS: u32 = 0u;

fn view_packed(view: u32) -> bool {
    return ((PACKED_VIEWS >> view) & 1u) != 0u;
}

// A packed view (FlashAttention's varlen layout) holds the sequences one after another: sequence b's
// position s is row start(b) + s of a [rows, heads, dim] tensor, its starts in seq_lens.
fn view_index(view: u32, b: u32, s: u32, h: u32) -> u32 {
    let v = params.views[view];
    var first = b * v.stride_b;
    if view_packed(view) {
        first = seq_lens[(2u + u32(key_side(view))) * params.batch + b] * v.stride_s;
    }
    return v.offset + first + s * v.stride_s + h * v.stride_h;
}

// Whether a kernel may write position s of sequence b in a view: one of the view's positions, and in
// a packed view one of the sequence's own (the rows after them are the next sequence's).
fn row_stored(view: u32, b: u32, s: u32) -> bool {
    if view_packed(view) {
        return s < select(q_len(b), kv_len(b), key_side(view));
    }
    return s < select(params.q_seq, params.kv_seq, key_side(view));
}

fn linear_group(wg: vec3<u32>) -> u32 {
    return wg.y * params.grid_x + wg.x;
}

// What one workgroup of a split-KV forward (the GPU and tensor-core families) owns: a query block
// (numbered from the last: under the causal mask the last block has the longest rows, so the heaviest
// are scheduled first), a split of its key range, a batch and a head (and the head's K/V head).
struct ForwardBlock {
    q_block: u32,
    split: u32,
    b: u32,
    h: u32,
    h_kv: u32,
}

fn forward_block(group: u32) -> ForwardBlock {
    let rest = group / params.blocks;
    let bh = rest % (params.batch * params.heads);
    let h = bh % params.heads;
    return ForwardBlock(
        params.blocks - 1u - group % params.blocks,
        rest / (params.batch * params.heads),
        bh / params.heads,
        h,
        h / (params.heads / params.kv_heads),
    );
}

// What one workgroup of a dK/dV kernel (every family) owns: key block `block` of batch b and
// K/V head h_kv, for every query head that shares it.
struct KeyBlock {
    block: u32,
    b: u32,
    h_kv: u32,
}

fn key_block(group: u32) -> KeyBlock {
    let block = group % params.blocks;
    let bh = group / params.blocks;
    return KeyBlock(block, bh / params.kv_heads, bh % params.kv_heads);
}

// What one workgroup of a dQ kernel (every family) owns: query block `block` (numbered from the
// last: under the causal mask the last block has the longest rows, so the heaviest are scheduled
// first), batch b, head h and its K/V head.
struct QueryBlock {
    block: u32,
    b: u32,
    h: u32,
    h_kv: u32,
}

fn query_block(group: u32) -> QueryBlock {
    let block = params.blocks - 1u - group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    return QueryBlock(block, b, h, h / (params.heads / params.kv_heads));
}

// The keys [x, y) that any of query rows row0 .. row0 + rows - 1 of a sequence of qlen queries and
// kvlen keys sees, row i at key position i + shift (row_shift; aligned(0u) on the tensor lengths):
// from the first row's window start to the last valid row's end, both nondecreasing in the row;
// y = 0 where the block holds no valid row. The query-block kernels' key range.
fn query_block_keys(shift: i32, row0: u32, rows: u32, qlen: u32, kvlen: u32) -> vec2<u32> {
    let rows_hi = min(row0 + rows, qlen);
    var end = 0u;
    if rows_hi > row0 {
        end = keys_end_at(i32(rows_hi - 1u) + shift, kvlen);
    }
    return vec2<u32>(keys_start_at(i32(row0) + shift), end);
}

// The key tiles [begin, end) (of `tile` keys) that a split-KV forward workgroup visits for query
// rows row0 .. row0 + rows (row i at key position i + shift, see row_shift) of a sequence with qlen
// queries and kvlen keys: its split's share of the tiles from the first row's window start to the
// last valid row's end (kv_hi), which masks are monotone in the row.
struct KeyTiles {
    begin: u32,
    end: u32,
    kv_hi: u32,
}

fn split_key_tiles(shift: i32, row0: u32, rows: u32, tile: u32, split: u32, qlen: u32, kvlen: u32) -> KeyTiles {
    let keys = query_block_keys(shift, row0, rows, qlen, kvlen);
    let kv_hi = keys.y;
    let n_tiles = (kv_hi + tile - 1u) / tile;
    let first_tile = min(keys.x / tile, n_tiles);
    let per_split = (n_tiles - first_tile + params.splits - 1u) / params.splits;
    let begin = first_tile + min(split * per_split, n_tiles - first_tile);
    return KeyTiles(begin, min(begin + per_split, n_tiles), kv_hi);
}

fn q_len(b: u32) -> u32 {
    if has_flag(FLAG_Q_LENS) {
        return min(seq_lens[b], params.q_seq);
    }
    return params.q_seq;
}

fn kv_len(b: u32) -> u32 {
    if has_flag(FLAG_KV_LENS) {
        return min(seq_lens[params.batch + b], params.kv_seq);
    }
    return params.kv_seq;
}

// Query row i sits at key position i + (Lk - Lq): masks are bottom-right aligned on the tensor lengths,
// or, for decoding from a cache (FLAG_ALIGN_LENS), on each sequence's lengths: the q_len(b) new
// queries are the last positions of its kv_len(b) cached keys.
fn row_shift(b: u32) -> i32 {
    if has_flag(FLAG_ALIGN_LENS) {
        return i32(kv_len(b)) - i32(q_len(b));
    }
    return i32(params.kv_seq) - i32(params.q_seq);
}

fn aligned(i: u32) -> i32 {
    return i32(i) + i32(params.kv_seq) - i32(params.q_seq);
}

// Keys [keys_start_at(p), keys_end_at(p, kvlen)) are visible to a query at aligned position p; the
// range is empty when start >= end. Causal: j <= p. Window: p - left <= j <= p + right.
fn keys_end_at(p: i32, kvlen: u32) -> u32 {
    var last = i32(kvlen) - 1;
    if has_flag(FLAG_CAUSAL) {
        last = min(last, p);
    }
    if has_flag(FLAG_WINDOW) {
        last = min(last, p + i32(params.window_right));
    }
    return u32(clamp(last + 1, 0, i32(kvlen)));
}

fn keys_start_at(p: i32) -> u32 {
    if has_flag(FLAG_WINDOW) {
        return u32(max(p - i32(params.window_left), 0));
    }
    return 0u;
}

// The range of query row i (which must be < q_len) aligned on the tensor lengths. Both bounds are
// nondecreasing in i, so a block's rows see keys within [key_start(first row), key_end(last valid
// row)).
fn key_end(i: u32, kvlen: u32) -> u32 {
    return keys_end_at(aligned(i), kvlen);
}

fn key_start(i: u32) -> u32 {
    return keys_start_at(aligned(i));
}

// key_start / key_end of row i of batch entry b aligned as row_shift says: on each sequence's
// lengths when decoding from a cache (FLAG_ALIGN_LENS: the decode and additive kernels, and the
// forward kernels when they serve a prefill), else as key_start / key_end.
fn key_end_in(b: u32, i: u32, kvlen: u32) -> u32 {
    return keys_end_at(i32(i) + row_shift(b), kvlen);
}

fn key_start_in(b: u32, i: u32) -> u32 {
    return keys_start_at(i32(i) + row_shift(b));
}

// Query rows [query_start(j), query_end(j)) see key j (before per-batch lengths): the inverse of the
// ranges above, nondecreasing in j.
fn query_start(j: u32) -> u32 {
    let shift = i32(params.kv_seq) - i32(params.q_seq);
    var first = 0;
    if has_flag(FLAG_CAUSAL) {
        first = max(first, i32(j) - shift);
    }
    if has_flag(FLAG_WINDOW) {
        first = max(first, i32(j) - shift - i32(params.window_right));
    }
    return u32(first);
}

// Whether key j lies in each of four rows' ranges [start, end).
fn visible(j: u32, start: vec4<u32>, end: vec4<u32>) -> vec4<bool> {
    return (vec4<u32>(j) >= start) & (vec4<u32>(j) < end);
}

fn query_end(j: u32) -> u32 {
    if has_flag(FLAG_WINDOW) {
        let shift = i32(params.kv_seq) - i32(params.q_seq);
        return u32(clamp(i32(j) - shift + i32(params.window_left) + 1, 0, i32(params.q_seq)));
    }
    return params.q_seq;
}

// The query rows [x, y) that see any of keys col0 .. col0 + keys - 1 of a sequence of qlen queries
// and kvlen keys: from the first key's start to the last valid key's end (both nondecreasing in
// the key); none where the block holds no valid key. The dK/dV kernels' row range.
fn key_block_rows(col0: u32, keys: u32, qlen: u32, kvlen: u32) -> vec2<u32> {
    var rows = vec2<u32>(query_start(col0), qlen);
    if col0 >= kvlen {
        rows.x = qlen;
    } else {
        rows.y = min(qlen, query_end(min(col0 + keys, kvlen) - 1u));
    }
    return rows;
}

// Score modifiers, the one statement of them every fused kernel calls (SPEC.md order, as
// FlashAttention 2): from the scaled score s = scale * q.k of (query row, key) pairs (rows[e],
// keys[e]) of batch b and query head h,
//   softcap:  s <- cap * tanh(s / cap)
//   ALiBi:    s <- s - slope(h) * |i + (Lk - Lq) - j|   (positions aligned as the causal mask)
//   bias:     s <- s + bias[b, h, i, j]                 (a -inf bias masks the pair)
//   relative: s <- s + table[h, bucket(j - (i + Lk - Lq))]
// Masks are applied after, by the callers; a pair whose modified score is -inf is masked too
// (score_visible). Rows and keys past the tensor lengths read clamped addresses (callers mask them).
fn modify_scores(s: vec4<f32>, rows: vec4<u32>, keys: vec4<u32>, b: u32, h: u32) -> vec4<f32> {
    var x = s;
    if has_flag(FLAG_SOFTCAP) {
        x = params.softcap * capped_tanh(x / params.softcap);
    }
    if has_flag(FLAG_ALIBI) {
        let shift = row_shift(b);
        let distance = abs(vec4<i32>(rows) + shift - vec4<i32>(keys));
        x -= alibi_slope(h) * vec4<f32>(distance);
    }
    if has_flag(FLAG_BIAS | FLAG_RELATIVE) {
        x += score_bias_terms(rows, keys, b, h);
    }
    return x;
}

// score_bias_terms: score_bias.wgsl, or score_bias_none.wgsl where the call has neither (the
// pipeline's key says which).

// Whether each modified score counts: false where a -inf bias masked it (or where it is the
// NEG_BIG sentinel of a masked pair). A NaN score counts: NaN reaches the rows that see it
// (SPEC.md, "NaN and infinity"), never reads as a masked pair. A comparison, not inf arithmetic,
// decides.
fn score_visible(x: vec4<f32>) -> vec4<bool> {
    return (x > vec4<f32>(NEG_BIG)) | is_nan(x);
}

// score_visible of one value: a score, a running max or a row's lse (-inf for rows that saw no
// key; NaN for rows a NaN reached).
fn not_masked(x: f32) -> bool {
    return score_visible(vec4<f32>(x)).x;
}

// Whether a row saw a key, from its softmax denominator l: l > 0, or NaN where a NaN reached it.
fn row_seen(l: vec4<f32>) -> vec4<bool> {
    return (l > vec4<f32>(0.0)) | is_nan(l);
}

// Whether x is neither infinite nor NaN, on the bits (as is_nan).
fn finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

// NaN test on the bits: drivers may assume float comparisons see no NaN (no SPIR-V float
// controls are requested) and fold x != x to false; integer tests they keep.
fn is_nan(x: vec4<f32>) -> vec4<bool> {
    return (bitcast<vec4<u32>>(x) & vec4<u32>(0x7fffffffu)) > vec4<u32>(0x7f800000u);
}

// The probability of a masked pair: -0.0, which exp never returns (a visible pair whose p
// underflows is +0.0). Products with a masked pair's p are skipped, so a NaN or infinity in a
// key, value, query or output gradient the pair does not see cannot reach the row as 0 * NaN.
fn masked_p() -> f32 {
    return bitcast<f32>(0x80000000u);
}

// A row's softmax numerator exp(s - m) for four scores, masked_p where a score is masked (NEG_BIG,
// told apart by score_visible): the online softmax's p in every forward kernel.
fn visible_exp(s: vec4<f32>, m: vec4<f32>) -> vec4<f32> {
    return select(vec4<f32>(masked_p()), exp(s - m), score_visible(s));
}

// Which of four probabilities belong to visible pairs (not masked_p).
fn p_visible(p: vec4<f32>) -> vec4<bool> {
    return bitcast<vec4<u32>>(p) != vec4<u32>(0x80000000u);
}

// p * x for the visible pairs, 0 for the masked ones (see masked_p).
fn masked_product(p: vec4<f32>, x: f32, keep: vec4<bool>) -> vec4<f32> {
    return select(vec4<f32>(0.0), p * x, keep);
}

// T5's bucket of the relative position delta = key - aligned query position (Raffel et al. 2020):
// bidirectional tables put keys after the query (delta > 0) in the upper half; exact buckets for
// distances below rel_exact, then log-spaced ones up to the maximum distance (thresholds computed
// on the host, reference::attention::relative_position_bucket, so kernels and reference agree).
fn relative_bucket(delta: i32) -> u32 {
    var offset = 0u;
    var n = 0u;
    if has_flag(FLAG_REL_BIDIRECTIONAL) {
        offset = select(0u, params.rel_buckets, delta > 0);
        n = u32(abs(delta));
    } else {
        n = u32(max(-delta, 0));
    }
    if n < params.rel_exact {
        return offset + n;
    }
    var bucket = offset + params.rel_exact;
    for (var t = 0u; t < params.rel_threshold_vec4s; t++) {
        let above = select(vec4<u32>(0u), vec4<u32>(1u), params.rel_thresholds[t] <= vec4<u32>(n));
        bucket += above.x + above.y + above.z + above.w;
    }
    return bucket;
}

// d modify_scores / d s (ALiBi adds a constant): 1 - tanh^2(s / cap) under softcap, else 1.
fn score_grad(s: vec4<f32>) -> vec4<f32> {
    if has_flag(FLAG_SOFTCAP) {
        let t = capped_tanh(s / params.softcap);
        return 1.0 - t * t;
    }
    return vec4<f32>(1.0);
}

// tanh whose argument stays where every implementation is exact to f32 (tanh(15) rounds to 1);
// some compute tanh through exp(2x), which overflows to inf / inf for large |x|. NaN passes through
// (clamp's result for NaN is undefined), so a NaN score stays NaN under softcap.
fn capped_tanh(x: vec4<f32>) -> vec4<f32> {
    return select(tanh(clamp(x, vec4<f32>(-15.0), vec4<f32>(15.0))), x, is_nan(x));
}

// ALiBi slope of query head h: the caller's (FLAG_ALIBI_SLOPES), or Press et al. 2022's: for n = H a
// power of two, 2^(-8 (h + 1) / n); otherwise the n = 2^floor(log2 H) slopes of that sequence, then
// every other slope of the 2n one.
fn alibi_slope(h: u32) -> f32 {
    if has_flag(FLAG_ALIBI_SLOPES) {
        return params.alibi_slopes[h / 4u][h % 4u];
    }
    let n = 1u << firstLeadingBit(params.heads);
    if h < n {
        return exp2(-8.0 * f32(h + 1u) / f32(n));
    }
    return exp2(-4.0 * f32(2u * (h - n) + 1u) / f32(n));
}
