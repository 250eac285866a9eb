// Decode attention (SPEC.md): a few new queries per sequence against a long key/value cache, the step
// of incremental generation. Q is [B, Lq, H, Dk] with q_len(b) <= Lq new queries (1 to 8 when
// decoding, a prompt chunk when prefilling); K and V are the cache [B, max_len, Hkv, D] holding
// kv_len(b) keys, the new ones last. Masks and score modifiers align on each sequence's lengths
// (FLAG_ALIGN_LENS): query i of sequence b sits at position kv_len(b) - q_len(b) + i.
//
// GQA-aware: a workgroup owns ROWS rows of one (sequence, KV head): the (query head of the group, query)
// pairs, flattened head-major, so the query heads that share a KV head read each K and V row once
// together. Split-KV: the key range is cut into `split_keys`-key slices, one workgroup each; a split
// writes its normalised partial O and lse (batch index split * B + b) and attention/forward_merge.wgsl
// adds them in split order (deterministic). With one split the outputs are O and lse themselves.
//
// Per tile of WG keys:
//   staging: (STAGED: the GPU kernel families) the tile's K and V rows into workgroup memory as
//            f32, consecutive invocations reading consecutive vec4s of a row (one 128-bit load
//            each where the rows start on four-word boundaries, VEC4; four words otherwise),
//            a step's loads issued together (read in place, a key's row waits out the memory
//            latency per vec4, a value per key);
//   scores:  invocation t owns key t of the tile: s[r] = q_r . k for every row r (Q pre-scaled in
//            workgroup memory), modified (modify_scores) and masked, into s_tile[r][t];
//   softmax: the tile's row maxima in two steps (LPR invocations per row take KPL keys each, then
//            invocation r < ROWS combines row r's LPR and keeps its running max m and rescale
//            alpha), then invocation t turns key t's scores into P in s_tile, every row at once;
//            no invocation walks a whole row;
//   P V:     invocation t owns OWN (row, vec4 column of O) items of key phase kg, and accumulates
//            P[r][j] V[j] over the tile's keys j = kg, kg + KG, ...; the KG phase sums are added in
//            kg order at the end (no atomics, deterministic). Meanwhile the LPR invocations of each
//            row sum its P over their KPL keys, which invocation r adds to its running sum l after
//            the next barrier.
// No per-invocation array is head-dim sized.
//
// Int8 caches (INT8): each row of one KV head is D / 4 words of four int8 and its scale as f32 bits
// (kv_cache_append_int8.wgsl writes them; the view's head_dim is D / 4 + 1 words), dequantised in
// registers: staged (GPU families), each staged vec4 is unpack(word) times its row's scale; read in
// place (CPU drivers), a score is the scale times q . unpack(k), a P V term P times the value row's
// scale (staged per tile) times unpack(v). D is a multiple of 4.
//
// f16 caches (F16): each row of one KV head is D / 2 words of two halves (kv_cache_append_f16.wgsl
// writes them; the view's head_dim is D / 2 words), widened in registers (unpack2x16float: no
// adapter feature needed) and staged like f32 rows. D is a multiple of 4.
//
// Tree steps (TREE, speculative decoding's drafts): the new rows of a sequence are a tree
// (SeqLens::with_trees: after the lengths, each row's depth, then its ancestors as a bit mask). Row
// i sits at position prefix + depth(i) (prefix = kv_len - q_len) and sees the cached keys and the
// new rows among its ancestors (itself included); new row n's key sits at prefix + depth(n). Masks
// and modifiers see those positions.
//
// Paged caches (PAGE > 0): attention/kv_pages.wgsl, which the host appends (cache_row, input_index).

override WG: u32 = 64u;
override ROWS: u32 = 4u;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
// (row, vec4 column) items of O, invocations per key phase, key phases, items per invocation.
override ITEMS: u32 = ROWS * DV4;
override LANES: u32 = min(ITEMS, WG);
override KG: u32 = WG / LANES;
override OWN: u32 = (ITEMS + WG - 1u) / WG;
// The tile's row maxima: LPR invocations per row (at most 8, ROWS * LPR <= WG), KPL keys each.
override LPR: u32 = max(1u, min(8u, WG / ROWS));
override KPL: u32 = (WG + LPR - 1u) / LPR;
// K and V tiles staged in workgroup memory (GPU kernel families: f32 and f16 values, int8 ones
// dequantised), or read in place (CPU drivers: workgroup memory is ordinary memory there;
// benchmarks/decode-2026-11-28).
override STAGED: bool = true;
// Staged key rows are KS vec4 apart: one vec4 of padding, so the invocations of the score step,
// each reading its own key's row, fall on different banks.
override KS: u32 = DK4 + 1u;
// Sizes of the staged tiles (a placeholder when read in place), and of the value scales an int8
// tile read in place stages.
override K_TILE: u32 = select(1u, WG * KS, STAGED);
override V_TILE: u32 = select(1u, WG * DV4, STAGED);
override V_SCALES: u32 = select(1u, WG, INT8 && !STAGED);

// K and V rows are int8 with a scale (DK and DV multiples of 4).
override INT8: bool = false;
// K and V rows are pairs of f16 (DK and DV multiples of 4).
override F16: bool = false;
// The new rows are draft trees (seq_lens holds their depths and ancestors).
override TREE: bool = false;

// Sizes of the per-invocation arrays: MAX_ROWS and MAX_OWN, the pipeline's exact ROWS and OWN,
// declared by the host.

@group(0) @binding(2) var<storage, read> q_buf: array<f32>;
// K and V at bindings 3 and 4, and cache_word / cache_pair / cache_word4 that read them:
// attention/decode_cache.wgsl (a word per access) or attention/decode_cache_vec4.wgsl (four: f32
// and staged f16 caches whose rows start on four-word boundaries).
@group(0) @binding(5) var<storage, read_write> o_buf: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse_buf: array<f32>;

var<workgroup> q_tile: array<vec4<f32>, ROWS * DK4>;
// Scores, then P, of the tile: s_tile[r * WG + key].
var<workgroup> s_tile: array<f32, ROWS * WG>;
// Per row: the tile's rescale factor and the running max; at the end, m and l.
var<workgroup> alpha_tile: array<f32, ROWS>;
var<workgroup> m_tile: array<f32, ROWS>;
var<workgroup> l_tile: array<f32, ROWS>;
// The tile's partial row maxima and sums of P, part_max[r * LPR + lane].
var<workgroup> part_max: array<f32, WG>;
var<workgroup> part_sum: array<f32, WG>;
// Key-phase partial sums of O, red[kg * LANES + lane].
var<workgroup> red: array<vec4<f32>, WG>;
// STAGED: the tile's keys and values, zero past the slice's end.
var<workgroup> k_tile: array<vec4<f32>, K_TILE>;
var<workgroup> v_tile: array<vec4<f32>, V_TILE>;
// INT8 read in place: the scale of each of the tile's value rows.
var<workgroup> v_scale: array<f32, V_SCALES>;

// The query row and head of flattened row fr of KV head g; q_seq past the last row.
fn row_query(fr: u32) -> u32 {
    return fr % params.q_seq;
}

fn row_head(fr: u32, g: u32) -> u32 {
    return g * (params.heads / params.kv_heads) + fr / params.q_seq;
}

// Tree steps: new row i's depth, and its ancestors (itself included) as bits over the new rows.
fn tree_depth(b: u32, i: u32) -> u32 {
    return seq_lens[2u * params.batch + b * params.q_seq + i];
}

fn tree_ancestors(b: u32, i: u32) -> u32 {
    return seq_lens[2u * params.batch + (params.batch + b) * params.q_seq + i];
}

// Elements d..d+3 of a row (view K or V, head dim `dim`) at element (word) `base`, zero past `dim`
// (f32 views need not be vec4 aligned); INT8: unscaled, the row's scale applied by the caller.
fn load4(view: u32, dim: u32, base: u32, d: u32) -> vec4<f32> {
    if INT8 {
        return unpack4x8snorm(cache_word(view, base + d / 4u));
    }
    if F16 {
        return half4(view, base + d / 2u);
    }
    if VEC4 == 1u {
        return bitcast<vec4<f32>>(cache_word4(view, base + d));
    }
    var x = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) {
        if d + e < dim {
            x[e] = bitcast<f32>(cache_word(view, base + d + e));
        }
    }
    return x;
}

// Four f16 values widened: words at and at + 1 of a cache (at even).
fn half4(view: u32, at: u32) -> vec4<f32> {
    let w = cache_pair(view, at);
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

// Vec4 item t of a tile of keys n0 .. n0 + WG - 1 of an f32 cache (view K or V, head dim `dim`, d4
// vec4 per row): row t / d4, elements 4 (t % d4) .. + 3, zero past `end` and past `dim`.
// Branch-free (the indices clamped to a valid key and element; the four loads written out), so the
// loads of a staging step issue together instead of each waiting out the memory latency.
fn tile_item(view: u32, dim: u32, d4: u32, rows: vec2<u32>, b: u32, n0: u32, end: u32, t: u32) -> vec4<f32> {
    let key = n0 + t / d4;
    let c = t % d4;
    let base = rows.x + cache_row(b, min(key, end - 1u)) * rows.y;
    let lanes = vec4<u32>(0u, 1u, 2u, 3u);
    var x: vec4<f32>;
    if INT8 {
        // d4 words of values, then the row's scale.
        x = unpack4x8snorm(cache_word(view, base + c)) * bitcast<f32>(cache_word(view, base + d4));
    } else if F16 {
        x = half4(view, base + 2u * c);
    } else if VEC4 == 1u {
        x = bitcast<vec4<f32>>(cache_word4(view, base + 4u * c));
    } else {
        // The row's last element stands in for those past it (dim need not be a multiple of 4).
        let e = select(min(lanes, vec4<u32>(dim - 1u - 4u * c)), lanes, dim % 4u == 0u);
        let at = base + 4u * c + e;
        x = bitcast<vec4<f32>>(vec4<u32>(cache_word(view, at.x), cache_word(view, at.y), cache_word(view, at.z), cache_word(view, at.w)));
    }
    return select(vec4<f32>(0.0), x, (4u * c + lanes < vec4<u32>(dim)) & vec4<bool>(key < end));
}

// Stages keys n0 .. n0 + WG - 1 of KV head g (zeros from `end` on) into k_tile and v_tile: items
// i * WG + lid and (i + 1) * WG + lid of K and of V in step i, their loads issued before their
// stores (written out: a loop the runtime checks bound is not unrolled; the K and V items of a step
// share their rows' addressing, which RADV otherwise runs out of scalar registers for). With
// D = 4 WG, items i * WG + lid are key n0 + i: one coalesced row read.
fn stage_tile(b: u32, g: u32, n0: u32, end: u32, lid: u32) {
    // Each view's row 0 of (b, g) (of the pool, paged) and its row stride: key j's row starts at
    // first + cache_row(b, j) * stride.
    let cache_b = select(b, 0u, PAGE > 0u);
    let k_rows = vec2<u32>(view_index(VIEW_K, cache_b, 0u, g), params.views[VIEW_K].stride_s);
    let v_rows = vec2<u32>(view_index(VIEW_V, cache_b, 0u, g), params.views[VIEW_V].stride_s);
    let k_last = WG * DK4 - 1u;
    let v_last = WG * DV4 - 1u;
    for (var i = 0u; i < max(DK4, DV4); i += 2u) {
        let t = i * WG + lid;
        let k0 = tile_item(VIEW_K, DK, DK4, k_rows, b, n0, end, min(t, k_last));
        let k1 = tile_item(VIEW_K, DK, DK4, k_rows, b, n0, end, min(t + WG, k_last));
        let v0 = tile_item(VIEW_V, DV, DV4, v_rows, b, n0, end, min(t, v_last));
        let v1 = tile_item(VIEW_V, DV, DV4, v_rows, b, n0, end, min(t + WG, v_last));
        if i < DK4 {
            stage_k(t, k0);
        }
        if i + 1u < DK4 {
            stage_k(t + WG, k1);
        }
        if i < DV4 {
            v_tile[t] = v0;
        }
        if i + 1u < DV4 {
            v_tile[t + WG] = v1;
        }
    }
}

// K item t of the tile into its padded row.
fn stage_k(t: u32, x: vec4<f32>) {
    k_tile[(t / DK4) * KS + t % DK4] = x;
}

// Invocation r < ROWS: row r's running sum l after a tile whose rescale was alpha, with the sums
// its LPR invocations posted (KPL keys each, in key order).
fn add_tile_sum(lid: u32, l: ptr<function, f32>, alpha: f32) {
    if lid < ROWS {
        var sum = 0.0;
        for (var k = 0u; k < LPR; k++) {
            sum += part_sum[lid * LPR + k];
        }
        *l = *l * alpha + sum;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier below in uniform control flow.
    if group >= params.total_groups {
        return;
    }
    let block = group % params.blocks;
    let rest = group / params.blocks;
    let bg = rest % (params.batch * params.kv_heads);
    let split = rest / (params.batch * params.kv_heads);
    let b = bg / params.kv_heads;
    let g = bg % params.kv_heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let shift = row_shift(b);
    let total_rows = (params.heads / params.kv_heads) * params.q_seq;
    let row0 = block * ROWS;

    for (var t = lid; t < ROWS * DK4 * 4u; t += WG) {
        let r = t / (DK4 * 4u);
        let d = t % (DK4 * 4u);
        let fr = row0 + r;
        var x = 0.0;
        if fr < total_rows && row_query(fr) < qlen && d < DK {
            x = q_buf[view_index(VIEW_Q, b, row_query(fr), row_head(fr, g)) + d] * params.scale;
        }
        q_tile[r * DK4 + d / 4u][d % 4u] = x;
    }

    // The keys any query of the sequence sees (the first query's window start to the last valid
    // query's end; masks are monotone in the query), then this split's slice of them.
    var lo = 0u;
    var hi = 0u;
    if qlen > 0u {
        lo = keys_start_at(shift);
        hi = keys_end_at(i32(qlen) - 1 + shift, kvlen);
    }
    let begin = max(lo, split * params.split_keys);
    let end = min(hi, (split + 1u) * params.split_keys);

    let lane = lid % LANES;
    let kg = lid / LANES;
    // Invocation r < ROWS: row r's running max and sum, and the last tile's rescale (its sum
    // arrives after the next barrier).
    var m = NEG_BIG;
    var l = 0.0;
    var alpha = 1.0;
    var acc: array<vec4<f32>, MAX_OWN>;
    for (var o = 0u; o < OWN; o++) {
        acc[o] = vec4<f32>(0.0);
    }

    for (var n0 = begin; n0 < end; n0 += WG) {
        let j = n0 + lid;
        var s: array<f32, MAX_ROWS>;
        for (var r = 0u; r < ROWS; r++) {
            s[r] = 0.0;
        }
        // The previous tile's P V has read k_tile, v_tile and s_tile, and its row sums are posted.
        workgroupBarrier();
        if n0 > begin {
            add_tile_sum(lid, &l, alpha);
        }
        if STAGED {
            stage_tile(b, g, n0, end, lid);
            workgroupBarrier();
        }
        if j < end {
            // Staged: the key's row from k_tile; in place: from the cache.
            let kj = input_index(VIEW_K, b, j, g);
            for (var d4 = 0u; d4 < DK4; d4++) {
                var k4: vec4<f32>;
                if STAGED {
                    k4 = k_tile[lid * KS + d4];
                } else {
                    k4 = load4(VIEW_K, DK, kj, 4u * d4);
                }
                for (var r = 0u; r < ROWS; r++) {
                    s[r] += dot(q_tile[r * DK4 + d4], k4);
                }
            }
            if INT8 && !STAGED {
                let k_scale = bitcast<f32>(cache_word(VIEW_K, kj + DK4));
                for (var r = 0u; r < ROWS; r++) {
                    s[r] *= k_scale;
                }
            }
        }
        if INT8 && !STAGED {
            var scale = 0.0;
            if j < end {
                scale = bitcast<f32>(cache_word(VIEW_V, input_index(VIEW_V, b, j, g) + DV4));
            }
            v_scale[lid] = scale;
        }
        for (var r = 0u; r < ROWS; r++) {
            let fr = row0 + r;
            let i = row_query(fr);
            var x = NEG_BIG;
            if j < end && fr < total_rows && i < qlen {
                // The query's and the key's positions (before the shift): their indices, or in a
                // tree step their depths, new keys visible to their descendants only.
                var q_pos = i;
                var k_pos = j;
                var in_tree = true;
                if TREE {
                    q_pos = tree_depth(b, i);
                    let prefix = kvlen - qlen;
                    if j >= prefix {
                        k_pos = prefix + tree_depth(b, j - prefix);
                        in_tree = ((tree_ancestors(b, i) >> (j - prefix)) & 1u) != 0u;
                    }
                }
                let p = i32(q_pos) + shift;
                if in_tree && k_pos >= keys_start_at(p) && k_pos < keys_end_at(p, kvlen) {
                    let y = modify_scores(vec4<f32>(s[r]), vec4<u32>(q_pos), vec4<u32>(k_pos), b, row_head(fr, g)).x;
                    // Masked scores are NEG_BIG exactly, so score_visible tells them apart.
                    x = select(NEG_BIG, y, score_visible(vec4<f32>(y)).x);
                }
            }
            s_tile[r * WG + lid] = x;
            s[r] = x;
        }
        workgroupBarrier();

        if lid < ROWS * LPR {
            let r = lid / LPR;
            let first = (lid % LPR) * KPL;
            var x = NEG_BIG;
            for (var jj = first; jj < min(first + KPL, WG); jj++) {
                x = max(x, s_tile[r * WG + jj]);
            }
            part_max[lid] = x;
        }
        workgroupBarrier();
        if lid < ROWS {
            var tile_max = NEG_BIG;
            for (var k = 0u; k < LPR; k++) {
                tile_max = max(tile_max, part_max[lid * LPR + k]);
            }
            // Both maxima are finite: alpha is 1 while a row has seen no key, 0 when its first arrives.
            let m_new = max(m, tile_max);
            alpha = exp(m - m_new);
            alpha_tile[lid] = alpha;
            m = m_new;
            m_tile[lid] = m_new;
        }
        workgroupBarrier();
        // Key lid's P in every row (masked_p for masked keys: the product below skips them).
        for (var r = 0u; r < ROWS; r++) {
            s_tile[r * WG + lid] = visible_exp(vec4<f32>(s[r]), vec4<f32>(m_tile[r])).x;
        }
        workgroupBarrier();

        // STAGED: every key of the tile, a fixed count (keys past `end` are masked: P is skipped).
        for (var o = 0u; o < OWN; o++) {
            let item = lane + o * LANES;
            if item < ITEMS && kg < KG {
                let r = item / DV4;
                let c = item % DV4;
                var a = acc[o] * alpha_tile[r];
                if STAGED {
                    // Four keys a step, their loads issued together; keys in ascending order.
                    for (var step = 0u; step < (WG + KG - 1u) / KG; step += 4u) {
                        let jj = (step + vec4<u32>(0u, 1u, 2u, 3u)) * KG + kg;
                        let at = min(jj, vec4<u32>(WG - 1u));
                        let p = vec4<f32>(s_tile[r * WG + at.x], s_tile[r * WG + at.y], s_tile[r * WG + at.z], s_tile[r * WG + at.w]);
                        let v0 = v_tile[at.x * DV4 + c];
                        let v1 = v_tile[at.y * DV4 + c];
                        let v2 = v_tile[at.z * DV4 + c];
                        let v3 = v_tile[at.w * DV4 + c];
                        // A key this row masks is skipped (a NaN in its value is not the row's).
                        let keep = (jj < vec4<u32>(WG)) & p_visible(p);
                        if keep.x {
                            a += p.x * v0;
                        }
                        if keep.y {
                            a += p.y * v1;
                        }
                        if keep.z {
                            a += p.z * v2;
                        }
                        if keep.w {
                            a += p.w * v3;
                        }
                    }
                } else {
                    for (var jj = kg; jj < min(WG, end - n0); jj += KG) {
                        let p = s_tile[r * WG + jj];
                        // A key this row masks is not read (a NaN in its value is not the row's).
                        if p_visible(vec4<f32>(p)).x {
                            var w = p;
                            if INT8 {
                                w *= v_scale[jj];
                            }
                            a += w * load4(VIEW_V, DV, input_index(VIEW_V, b, n0 + jj, g), 4u * c);
                        }
                    }
                }
                acc[o] = a;
            }
        }
        if lid < ROWS * LPR {
            let r = lid / LPR;
            let first = (lid % LPR) * KPL;
            var sum = 0.0;
            for (var jj = first; jj < min(first + KPL, WG); jj++) {
                // masked_p (-0) adds nothing.
                sum += s_tile[r * WG + jj];
            }
            part_sum[lid] = sum;
        }
    }

    workgroupBarrier();
    if lid < ROWS {
        if end > begin {
            add_tile_sum(lid, &l, alpha);
        }
        m_tile[lid] = m;
        l_tile[lid] = l;
    }
    if KG > 1u {
        red[lid] = acc[0];
    }
    workgroupBarrier();
    if kg != 0u {
        return;
    }
    // Split s writes batch index s * B + b of its outputs: the partial results when split.
    let b_out = split * params.batch + b;
    for (var o = 0u; o < OWN; o++) {
        let item = lane + o * LANES;
        let r = item / DV4;
        let fr = row0 + r;
        if item >= ITEMS || fr >= total_rows {
            continue;
        }
        var a = acc[o];
        if KG > 1u {
            a = red[lane];
            for (var k = 1u; k < KG; k++) {
                a += red[k * LANES + lane];
            }
        }
        let i = row_query(fr);
        let h = row_head(fr, g);
        let l = l_tile[r];
        let seen = row_seen(vec4<f32>(l)).x;
        let out = select(vec4<f32>(0.0), a / l, seen);
        let c = item % DV4;
        // A packed O holds the sequence's own rows only (the next sequence's follow).
        if row_stored(VIEW_O, b_out, i) {
            let base = view_index(VIEW_O, b_out, i, h);
            for (var e = 0u; e < 4u; e++) {
                if 4u * c + e < DV {
                    o_buf[base + 4u * c + e] = out[e];
                }
            }
        }
        if c == 0u {
            let lse = select(neg_inf(), m_tile[r] + log(l), seen);
            lse_buf[(b_out * params.heads + h) * params.q_seq + i] = lse;
        }
    }
}
