// Fused additive attention for decoding (after attention/common.wgsl and additive/common.wgsl): a
// few new query rows against long caches, where the forward's one-row-per-invocation layout would
// leave all but a few of its 64 rows idle. One workgroup per (batch, head, query row); its
// invocations split the row's visible keys, one key each per tile of WG keys:
//   1. every invocation scores its key, e_j = scale w . tanh(a_i + bias + b_j), into e_tile;
//   2. every invocation reads the tile's maximum from e_tile (the same order everywhere, so the
//      running max m and sum l are equal in all of them), writes its p_j = exp(e_j - m) to p_tile;
//   3. l and the accumulator rescale once per tile, and each invocation adds sum_j p_j v_j to the
//      value dims it owns (d = lid, lid + WG, ...).
// No head-dim-sized private array: an invocation holds Dv / WG accumulator elements. Masks align on
// each sequence's lengths (FLAG_ALIGN_LENS, key_start_in / key_end_in). The key loop runs over
// [chunk_begin, chunk_end); a dispatch with accumulate = 1 resumes from the O and lse an earlier one
// wrote (O normalised with lse is the state m = lse, l = 1, acc = O), as in additive/forward.wgsl.

@group(0) @binding(7) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(8) var<storage, read_write> lse_buf: array<f32>;

// MAX_OWN: value dims each invocation owns, at most, ceil(Dv / WG), declared by the host.

var<workgroup> a_tile: array<vec4<f32>, DA4>;
var<workgroup> e_tile: array<f32, WG>;
var<workgroup> p_tile: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier below in uniform control flow.
    if group >= params.total_groups {
        return;
    }
    let i = group % params.blocks;
    let bh = group / params.blocks;
    let b = bh / params.heads;
    let h = bh % params.heads;
    let live = i < q_len(b);
    let row = (b * params.heads + h) * params.q_seq + i;

    stage_w(h, lid);
    for (var c4 = lid; c4 < DA4; c4 += WG) {
        var x = vec4<f32>(0.0);
        if live {
            x = a_plus_bias4(b, i, h, c4);
        }
        a_tile[c4] = x;
    }

    // Workgroup-uniform: the row's visible keys within this dispatch's chunk.
    var start = 0u;
    var end = 0u;
    if live {
        start = max(key_start_in(b, i), params.chunk_begin);
        end = min(key_end_in(b, i, kv_len(b)), params.chunk_end);
    }

    var m = NEG_BIG;
    var l = 0.0;
    var acc: array<f32, MAX_OWN>;
    for (var k = 0u; k < MAX_OWN; k++) {
        acc[k] = 0.0;
    }
    if params.accumulate != 0u && live {
        let lse = lse_buf[row];
        if not_masked(lse) {
            m = lse;
            l = 1.0;
            for (var k = 0u; k < MAX_OWN; k++) {
                let d = lid + k * WG;
                if d < DV {
                    acc[k] = o_buf[view_index(VIEW_O, b, i, h) + d];
                }
            }
        }
    }

    for (var n0 = start; n0 < end; n0 += WG) {
        workgroupBarrier();
        let j = n0 + lid;
        var e = NEG_BIG;
        if j < end {
            e = 0.0;
            for (var c4 = 0u; c4 < DA4; c4++) {
                e += dot(w_tile[c4], capped_tanh(a_tile[c4] + b_key4(b, j, h, c4)));
            }
        }
        e_tile[lid] = e;
        workgroupBarrier();
        let keys = min(WG, end - n0);
        var tile_max = NEG_BIG;
        for (var t = 0u; t < keys; t++) {
            tile_max = max(tile_max, e_tile[t]);
        }
        let m_new = max(m, tile_max);
        let alpha = exp(m - m_new);
        m = m_new;
        var p = 0.0;
        if j < end {
            p = exp(e - m);
        }
        p_tile[lid] = p;
        workgroupBarrier();
        var tile_sum = 0.0;
        for (var t = 0u; t < keys; t++) {
            tile_sum += p_tile[t];
        }
        l = l * alpha + tile_sum;
        for (var k = 0u; k < MAX_OWN; k++) {
            let d = lid + k * WG;
            if d < DV {
                var sum = acc[k] * alpha;
                for (var t = 0u; t < keys; t++) {
                    sum += p_tile[t] * v_keys[view_index(VIEW_V, b, n0 + t, h) + d];
                }
                acc[k] = sum;
            }
        }
    }

    // Padded rows (and rows that see no key) get O = 0, lse = -inf.
    let seen = row_seen(vec4<f32>(l)).x;
    for (var k = 0u; k < MAX_OWN; k++) {
        let d = lid + k * WG;
        if d < DV {
            o_buf[view_index(VIEW_O, b, i, h) + d] = select(0.0, acc[k] / l, seen);
        }
    }
    if lid == 0u {
        lse_buf[row] = select(neg_inf(), m + log(l), seen);
    }
}
