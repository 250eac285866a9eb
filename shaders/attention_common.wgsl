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
    // key tiles and writes a partial result that attention_forward_merge.wgsl combines.
    splits: u32,
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

// Masked scores are tracked with explicit validity, never through inf arithmetic (Metal may use fast
// math). This finite sentinel is only ever a running-max seed; it is never exponentiated on its own.
const NEG_BIG: f32 = -3.0e38;

@group(0) @binding(0) var<uniform> params: Params;
// Per-batch valid lengths: q_len[b] at [b], kv_len[b] at [batch + b]. A 1-element dummy when unused.
@group(0) @binding(1) var<storage, read> seq_lens: array<u32>;

fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u);
}

fn view_index(view: u32, b: u32, s: u32, h: u32) -> u32 {
    let v = params.views[view];
    return v.offset + b * v.stride_b + s * v.stride_s + h * v.stride_h;
}

fn linear_group(wg: vec3<u32>) -> u32 {
    return wg.y * params.grid_x + wg.x;
}

fn q_len(b: u32) -> u32 {
    if (params.flags & FLAG_Q_LENS) != 0u {
        return min(seq_lens[b], params.q_seq);
    }
    return params.q_seq;
}

fn kv_len(b: u32) -> u32 {
    if (params.flags & FLAG_KV_LENS) != 0u {
        return min(seq_lens[params.batch + b], params.kv_seq);
    }
    return params.kv_seq;
}

// Keys [0, key_end) are visible to query row i (which must be < q_len). Causal is bottom-right aligned
// on the tensor lengths: key j is visible iff j <= i + (Lk - Lq).
fn key_end(i: u32, kvlen: u32) -> u32 {
    if (params.flags & FLAG_CAUSAL) != 0u {
        let last = i32(i) + 1 + i32(params.kv_seq) - i32(params.q_seq);
        return u32(clamp(last, 0, i32(kvlen)));
    }
    return kvlen;
}

// First query row that sees key j under the causal mask (0 without it).
fn query_start(j: u32) -> u32 {
    if (params.flags & FLAG_CAUSAL) != 0u {
        return u32(max(i32(j) - (i32(params.kv_seq) - i32(params.q_seq)), 0));
    }
    return 0u;
}
