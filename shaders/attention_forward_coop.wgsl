// Fused attention forward on tensor cores (SPEC.md): the "coop" kernel family. Same problem, masks,
// modifiers, NaN rules and outputs as attention_forward_tiled.wgsl; the two products run as 16x16
// tile multiply-adds through the matrix interface the host appends (matrix_coop.wgsl: cooperative
// matrices; matrix_portable.wgsl: the same in ordinary arithmetic, for adapters without them).
//
// A workgroup is NSG tile groups of SG invocations (in the tensor-core build a group is a subgroup;
// invocations fill subgroups in local-index order, and the device's qualification would catch a
// device where they do not) and owns BM = 16 NSG query rows of one (batch, head); group g computes
// rows 16 g .. 16 g + 15. Q is staged once, scaled and rounded to MatElem; then per tile of BN = 32
// keys, staged once for the whole workgroup (MatElem): S = Q K^T as BN / 16 tiles of DKP / 16
// multiply-adds per group, stored to workgroup memory for the online softmax (masks and modifiers
// from the shared header, SG / 16 invocations per row), P rounded to MatElem (the row sums add the
// rounded values, so O is normalised by what was multiplied); O (f32, workgroup memory) is rescaled
// by each row's alpha, then loaded as the accumulator of P V and stored back. A product skips
// nothing, and 0 x NaN is NaN: a tile whose V holds a non-finite value takes P V in scalar
// arithmetic that skips masked keys, so such a value reaches only the rows that see its key.
// Split-KV and the causal tile range as in the tiled forward (its merge kernel combines splits).

override SG: u32 = 32u;
override NSG: u32 = 4u;
override WG: u32 = SG * NSG;
override DK: u32 = 64u;
override DV: u32 = 64u;
// Head dims rounded up to whole tiles (the padding is staged as zeros).
override DKP: u32 = (DK + 15u) / 16u * 16u;
override DVP: u32 = (DV + 15u) / 16u * 16u;
override BM: u32 = 16u * NSG;
const BN: u32 = 32u;
// Invocations per row in the softmax (SG / 16: 2 on a 32-wide subgroup) and the keys each takes.
override LPR: u32 = WG / BM;
override KPL: u32 = BN / LPR;

// Q, K and V (bindings 2-4) and their row reads (q_row4, k_row4, v_row4): attention_input_rows.wgsl
// or its vec4 build, appended by the host.
@group(0) @binding(5) var<storage, read_write> o_buf: array<OutElem>;
@group(0) @binding(6) var<storage, read_write> lse_buf: array<f32>;

// MatElem tiles (the multiply-adds' inputs): Q [BM x DKP], K [BN x DKP], V [BN x DVP], P [BM x BN].
override K_AT: u32 = BM * DKP;
override V_AT: u32 = K_AT + BN * DKP;
override P_AT: u32 = V_AT + BN * DVP;
override MAT_MEM: u32 = P_AT + BM * BN;
var<workgroup> mat_mem: array<MatElem, MAT_MEM>;
// f32 tiles: S [BM x BN] and O [BM x DVP] (the accumulator of every tile's P V).
override O_AT: u32 = BM * BN;
override ACC_MEM: u32 = O_AT + BM * DVP;
var<workgroup> acc_mem: array<f32, ACC_MEM>;
// Each row's running max and sum, and its rescale factor for the current tile.
var<workgroup> row_m: array<f32, BM>;
var<workgroup> row_l: array<f32, BM>;
var<workgroup> row_alpha: array<f32, BM>;
// The softmax's partial row maxima, then sums, one per invocation (a multiple of 16 invocations).
var<workgroup> part: array<f32, WG>;
// Whether the staged V tile holds a non-finite value (element 0 of each).
// Cooperative loads and stores need 16-byte aligned addresses, and a driver lays the workgroup
// variables out in an order of its choosing (NVIDIA's tensor-core products read garbage while these
// two were 4 bytes each): every variable's size is a multiple of 16 bytes, so each starts 16-byte
// aligned wherever it is placed (BM is a multiple of 16 too).
var<workgroup> v_bad: array<atomic<u32>, 4>;
var<workgroup> v_bad_tile: array<u32, 4>;

fn finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier and tile call uniform.
    if group >= params.total_groups {
        return;
    }
    // This invocation's tile group and its first row in the block.
    let tile_group = lid / SG;
    let rows_at = 16u * tile_group;
    mat_init(lid % SG);
    let block = forward_block(group);
    let q_block = block.q_block;
    let split = block.split;
    let b = block.b;
    let h = block.h;
    let h_kv = block.h_kv;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    // Row i sits at key position i + shift (see row_shift).
    let shift = row_shift(b);
    let row0 = q_block * BM;

    // Four elements of a row per iteration (DKP and DVP are multiples of four).
    for (var t = 4u * lid; t < BM * DKP; t += 4u * WG) {
        let i = row0 + t / DKP;
        let d = t % DKP;
        var x = vec4<f32>(0.0);
        if i < qlen && d < DK {
            x = q_row4(view_index(VIEW_Q, b, i, h) + d, DK - d) * params.scale;
        }
        for (var c = 0u; c < 4u; c++) {
            mat_mem[t + c] = MatElem(x[c]);
        }
    }
    for (var t = lid; t < BM * DVP; t += WG) {
        acc_mem[O_AT + t] = 0.0;
    }
    for (var r = lid; r < BM; r += WG) {
        row_m[r] = NEG_BIG;
        row_l[r] = 0.0;
    }

    let tiles = split_key_tiles(shift, row0, BM, BN, split, qlen, kvlen);
    let kv_hi = tiles.kv_hi;

    for (var tile = tiles.begin; tile < tiles.end; tile++) {
        let n0 = tile * BN;
        if lid == 0u {
            atomicStore(&v_bad[0], 0u);
        }
        workgroupBarrier();
        for (var t = 4u * lid; t < BN * DKP; t += 4u * WG) {
            let j = n0 + t / DKP;
            let d = t % DKP;
            var x = vec4<f32>(0.0);
            if j < kv_hi && d < DK {
                x = k_row4(view_index(VIEW_K, b, j, h_kv) + d, DK - d);
            }
            for (var c = 0u; c < 4u; c++) {
                mat_mem[K_AT + t + c] = MatElem(x[c]);
            }
        }
        var bad = false;
        for (var t = 4u * lid; t < BN * DVP; t += 4u * WG) {
            let j = n0 + t / DVP;
            let d = t % DVP;
            var x = vec4<f32>(0.0);
            if j < kv_hi && d < DV {
                x = v_row4(view_index(VIEW_V, b, j, h_kv) + d, DV - d);
            }
            for (var c = 0u; c < 4u; c++) {
                let staged = MatElem(x[c]);
                bad = bad || !finite(f32(staged));
                mat_mem[V_AT + t + c] = staged;
            }
        }
        if bad {
            atomicOr(&v_bad[0], 1u);
        }
        workgroupBarrier();

        // S = Q K^T for this group's rows, 16 keys at a time.
        for (var n = 0u; n < BN; n += 16u) {
            var s = mat_zero();
            for (var d0 = 0u; d0 < DKP; d0 += 16u) {
                let q_tile = mat_load_a(rows_at * DKP + d0, DKP);
                s = mat_mma(q_tile, mat_load_b_transposed(K_AT + n * DKP + d0, DKP), s);
            }
            mat_store(s, rows_at * BN + n, BN);
        }
        if lid == 0u {
            v_bad_tile[0] = atomicLoad(&v_bad[0]);
        }
        workgroupBarrier();
        // The online softmax of the tile's rows of S: LPR invocations per row (the tile groups are at
        // least 16 wide: every invocation has a row), KPL keys each, their maxima and sums combined
        // through `part` (index lid: row r LPR + slice).
        {
            let r = lid / LPR;
            let slice = lid % LPR;
            let first = lid - slice;
            let i = row0 + r;
            var start = 0u;
            var end = 0u;
            if i < qlen {
                start = keys_start_at(i32(i) + shift);
                end = min(keys_end_at(i32(i) + shift, kvlen), kv_hi);
            }
            var e: array<vec4<f32>, BN / 4u>;
            var tile_max = NEG_BIG;
            for (var q = 0u; q < KPL / 4u; q++) {
                let key = slice * KPL + 4u * q;
                let j = vec4<u32>(n0 + key) + vec4<u32>(0u, 1u, 2u, 3u);
                let at = r * BN + key;
                let raw = vec4<f32>(acc_mem[at], acc_mem[at + 1u], acc_mem[at + 2u], acc_mem[at + 3u]);
                let x = modify_scores(raw, vec4<u32>(i), j, b, h);
                let seen = (j >= vec4<u32>(start)) & (j < vec4<u32>(end)) & score_visible(x);
                e[q] = select(vec4<f32>(NEG_BIG), x, seen);
                tile_max = max(tile_max, max(max(e[q].x, e[q].y), max(e[q].z, e[q].w)));
            }
            part[lid] = tile_max;
            workgroupBarrier();
            for (var k = 0u; k < LPR; k++) {
                tile_max = max(tile_max, part[first + k]);
            }
            let m = row_m[r];
            // Both maxima are finite: alpha is 1 while a row has seen no key, 0 when its first arrives.
            let m_new = max(m, tile_max);
            let alpha = exp(m - m_new);
            var sum = 0.0;
            for (var q = 0u; q < KPL / 4u; q++) {
                // Masked scores are NEG_BIG exactly; their p is masked_p (the scalar P V skips them).
                let p = visible_exp(e[q], vec4<f32>(m_new));
                for (var c = 0u; c < 4u; c++) {
                    let rounded = MatElem(p[c]);
                    mat_mem[P_AT + r * BN + slice * KPL + 4u * q + c] = rounded;
                    sum += f32(rounded);
                }
            }
            // Every slice has read the maxima (and its row's m) before they are overwritten.
            workgroupBarrier();
            part[lid] = sum;
            workgroupBarrier();
            if slice == 0u {
                var total = 0.0;
                for (var k = 0u; k < LPR; k++) {
                    total += part[first + k];
                }
                row_m[r] = m_new;
                row_l[r] = row_l[r] * alpha + total;
                row_alpha[r] = alpha;
            }
        }
        // Uniform: every invocation of the workgroup takes the same branches below.
        let scalar_pv = workgroupUniformLoad(&v_bad_tile[0]) != 0u;

        // O = alpha O (+ P V in scalar arithmetic when V is not all finite).
        for (var t = lid; t < BM * DVP; t += WG) {
            let r = t / DVP;
            var o = acc_mem[O_AT + t] * row_alpha[r];
            if scalar_pv {
                let d = t % DVP;
                for (var jj = 0u; jj < BN; jj++) {
                    let p = f32(mat_mem[P_AT + r * BN + jj]);
                    // A key this row masks is not read (a NaN in its value is not the row's).
                    if p_visible(vec4<f32>(p)).x {
                        o += p * f32(mat_mem[V_AT + jj * DVP + d]);
                    }
                }
            }
            acc_mem[O_AT + t] = o;
        }
        workgroupBarrier();
        // O += P V for this group's rows, O's tiles as the accumulators.
        if !scalar_pv {
            for (var c0 = 0u; c0 < DVP; c0 += 16u) {
                let o_at = O_AT + rows_at * DVP + c0;
                var o = mat_load_c(o_at, DVP);
                for (var k0 = 0u; k0 < BN; k0 += 16u) {
                    let p = mat_load_a(P_AT + rows_at * BN + k0, BN);
                    o = mat_mma(p, mat_load_b(V_AT + k0 * DVP + c0, DVP), o);
                }
                mat_store(o, o_at, DVP);
            }
        }
    }
    workgroupBarrier();

    let out_b = split * params.batch + b;
    for (var r = lid; r < BM; r += WG) {
        let i = row0 + r;
        if i < params.q_seq {
            // l > 0 iff the row saw a key. Otherwise, and for padded rows: lse = -inf (SPEC.md).
            let seen = i < qlen && row_seen(vec4<f32>(row_l[r])).x;
            let lse_index = (out_b * params.heads + h) * params.q_seq + i;
            lse_buf[lse_index] = select(neg_inf(), row_m[r] + log(row_l[r]), seen);
        }
    }
    for (var t = lid; t < BM * DVP; t += WG) {
        let r = t / DVP;
        let d = t % DVP;
        let i = row0 + r;
        if row_stored(VIEW_O, out_b, i) && d < DV {
            let l = row_l[r];
            let seen = i < qlen && row_seen(vec4<f32>(l)).x;
            let o = select(0.0, acc_mem[O_AT + t] / l, seen);
            o_buf[view_index(VIEW_O, out_b, i, h) + d] = OutElem(o);
        }
    }
}
