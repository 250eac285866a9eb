// Fused attention forward on tensor cores (SPEC.md): the "coop" kernel family. Same problem, masks,
// modifiers, NaN rules and outputs as attention/gpu/forward.wgsl; the two products run as 16x16
// tile multiply-adds through the matrix interface the host appends (matrix/cooperative.wgsl: cooperative
// matrices; matrix/portable.wgsl: the same in ordinary arithmetic, for adapters without them).
//
// A workgroup is NSG tile groups of SG invocations (in the tensor-core build a group is a subgroup;
// invocations fill subgroups in local-index order, and the device's qualification would catch a
// device where they do not) and owns BM = 16 NSG query rows of one (batch, head); group g computes
// rows 16 g .. 16 g + 15. Q is staged once, scaled and rounded to MatElem, and its tiles held by
// each group for the whole key loop. Per tile of BN keys (staged once for the workgroup):
//   S = Q K^T (BN / 16 accumulator tiles per group) goes through workgroup memory to the online
//   softmax (masks and modifiers from the shared header, SG / 16 invocations per row), which writes
//   P rounded to MatElem over the staged K (read by then); the row sums add the rounded values, so O
//   is normalised by what was multiplied. O stays in accumulator tiles across the key loop: O += P V.
// A cooperative matrix cannot be scaled row by row, so a row's exponentials are taken against a
// reference maximum that moves only when a tile's maximum exceeds it by more than RESCALE_BOUND
// (FlashAttention-4's lazy rescaling): p <= e^RESCALE_BOUND, exact in f16's range and precision.
// When some row of the workgroup needs it, O goes through workgroup memory once to be rescaled.
// A product skips nothing, and 0 x NaN is NaN: a tile whose V holds a non-finite value takes P V in
// scalar arithmetic (on the same round trip) that skips masked keys, so such a value reaches only
// the rows that see its key. Split-KV and the causal tile range as in the tiled forward (its merge
// kernel combines splits).

// SG, NSG, WG, DK, DV, DKP and DVP: attention/coop/shape.wgsl.
override BM: u32 = 16u * NSG;
// Keys per staged tile (16, 32 or 64).
override BN: u32 = 64u;
// The lengths of the register arrays, as arrays in a function need constant lengths: MAX_BN, keys
// per tile (BN); Q_TILES and O_TILES, the tiles a group holds (Q's along DKP, O's along DVP);
// K_LOADS and V_LOADS, the four-element reads per invocation of a K and a V tile (BN DKP / (4 WG)
// and BN DVP / (4 WG), rounded up). The pipeline's key declares them, exactly for the overrides
// above (src/kernels/attention/variant.rs).
// Invocations per row in the softmax (SG / 16: 2 on a 32-wide subgroup) and the keys each takes.
override LPR: u32 = WG / BM;
override KPL: u32 = BN / LPR;
// Row strides of the staged tiles, one 16-byte step past the rows' length, so that the rows a
// tile load or store touches at once start in different memory banks (with the length itself,
// 128-byte strides put every row of a 16x16 tile in the same banks: 8- to 16-way conflicts).
override QS: u32 = DKP + 8u;
override VS: u32 = DVP + 8u;
override PS: u32 = BN + 8u;
override SS: u32 = BN + 4u;
// How far a tile's maximum may exceed a row's reference maximum before O is rescaled: p <= e^8.
const RESCALE_BOUND: f32 = 8.0;

// Q, K and V (bindings 2-4) and their row reads (q_row4, k_row4, v_row4): attention/input_rows.wgsl
// or its vec4 build, appended by the host.
@group(0) @binding(5) var<storage, read_write> o_buf: array<OutElem>;
@group(0) @binding(6) var<storage, read_write> lse_buf: array<f32>;

// MatElem tiles (the multiply-adds' inputs), rows QS, VS or PS apart: Q [BM x DKP]; K [BN x DKP],
// whose space P [BM x BN] takes once S is computed; V [BN x DVP].
override K_AT: u32 = BM * QS;
override V_AT: u32 = K_AT + max(BN * QS, BM * PS);
override P_AT: u32 = K_AT;
override MAT_MEM: u32 = V_AT + BN * VS;
var<workgroup> mat_mem: array<MatElem, MAT_MEM>;
// f32: S [BM x BN], rows SS apart; also where O's tiles are rescaled and normalised, 16 columns at
// a time.
override ACC_MEM: u32 = BM * SS;
var<workgroup> acc_mem: array<f32, ACC_MEM>;
// Each row's reference maximum and sum, and its rescale factor for the current tile.
var<workgroup> row_m: array<f32, BM>;
var<workgroup> row_l: array<f32, BM>;
var<workgroup> row_alpha: array<f32, BM>;
// The softmax's partial row maxima and sums, one per invocation (a multiple of 16 invocations).
var<workgroup> part_max: array<f32, WG>;
var<workgroup> part_sum: array<f32, WG>;
// Per tile: whether V holds a non-finite value, whether a row needs O rescaled (element 0 of each),
// and both as the tile's flags (bit 0: rescale, bit 1: scalar P V) for a uniform load.
// Cooperative loads and stores need 16-byte aligned addresses, and a driver lays the workgroup
// variables out in an order of its choosing (NVIDIA's tensor-core products read garbage while these
// were 4 bytes each): every variable's size is a multiple of 16 bytes, so each starts 16-byte
// aligned wherever it is placed (BM and WG are multiples of 16 too).
var<workgroup> v_bad: array<atomic<u32>, 4>;
var<workgroup> rescale: array<atomic<u32>, 4>;
var<workgroup> tile_flags: array<u32, 4>;

const FIX_RESCALE: u32 = 1u;
const FIX_SCALAR_PV: u32 = 2u;

// Invocation lid's share of the K and V rows n0 .. n0 + BN - 1 (zeros past kv_hi and the head dims).
fn read_kv_tile(
    k: ptr<function, array<vec4<f32>, K_LOADS>>,
    v: ptr<function, array<vec4<f32>, V_LOADS>>,
    n0: u32,
    lid: u32,
    b: u32,
    h_kv: u32,
    kv_hi: u32,
) {
    for (var u = 0u; u < K_LOADS; u++) {
        let t = 4u * (lid + u * WG);
        let j = n0 + t / DKP;
        let d = t % DKP;
        var x = vec4<f32>(0.0);
        if t < BN * DKP && j < kv_hi && d < DK {
            let row = input_index(VIEW_K, b, j, h_kv);
            x = k_row4(row + d, DK - d) * row_scale(VIEW_K, row);
        }
        (*k)[u] = x;
    }
    for (var u = 0u; u < V_LOADS; u++) {
        let t = 4u * (lid + u * WG);
        let j = n0 + t / DVP;
        let d = t % DVP;
        var x = vec4<f32>(0.0);
        if t < BN * DVP && j < kv_hi && d < DV {
            let row = input_index(VIEW_V, b, j, h_kv);
            x = v_row4(row + d, DV - d) * row_scale(VIEW_V, row);
        }
        (*v)[u] = x;
    }
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
            mat_mem[(t / DKP) * QS + d + c] = MatElem(x[c]);
        }
    }
    for (var r = lid; r < BM; r += WG) {
        row_m[r] = NEG_BIG;
        row_l[r] = 0.0;
    }
    workgroupBarrier();
    // This group's rows of Q, and of O (f32 accumulators).
    var q_tiles: array<TileA, Q_TILES>;
    for (var d = 0u; d < Q_TILES; d++) {
        q_tiles[d] = mat_load_a(rows_at * QS + 16u * d, QS);
    }
    var o_tiles: array<TileC, O_TILES>;
    for (var c = 0u; c < O_TILES; c++) {
        o_tiles[c] = mat_zero();
    }

    let tiles = split_key_tiles(shift, row0, BM, BN, split, qlen, kvlen);
    let kv_hi = tiles.kv_hi;

    // The next tile's K and V, read into registers one tile ahead so that the reads are in flight
    // while the products and softmax of the tile before run (software pipelining); invocation lid
    // holds elements 4 (lid + u WG) .. + 3 of each tile, row-major [BN x DKP] and [BN x DVP].
    var k_next: array<vec4<f32>, K_LOADS>;
    var v_next: array<vec4<f32>, V_LOADS>;
    if tiles.begin < tiles.end {
        read_kv_tile(&k_next, &v_next, tiles.begin * BN, lid, b, h_kv, kv_hi);
    }

    for (var tile = tiles.begin; tile < tiles.end; tile++) {
        if lid == 0u {
            atomicStore(&v_bad[0], 0u);
            atomicStore(&rescale[0], 0u);
        }
        // The previous tile's products have read P and V.
        workgroupBarrier();
        for (var u = 0u; u < K_LOADS; u++) {
            let t = 4u * (lid + u * WG);
            if t < BN * DKP {
                for (var c = 0u; c < 4u; c++) {
                    mat_mem[K_AT + (t / DKP) * QS + t % DKP + c] = MatElem(k_next[u][c]);
                }
            }
        }
        var bad = false;
        for (var u = 0u; u < V_LOADS; u++) {
            let t = 4u * (lid + u * WG);
            if t < BN * DVP {
                for (var c = 0u; c < 4u; c++) {
                    let staged = MatElem(v_next[u][c]);
                    bad = bad || !finite(f32(staged));
                    mat_mem[V_AT + (t / DVP) * VS + t % DVP + c] = staged;
                }
            }
        }
        if bad {
            atomicOr(&v_bad[0], 1u);
        }
        workgroupBarrier();
        let n0 = tile * BN;
        if tile + 1u < tiles.end {
            read_kv_tile(&k_next, &v_next, n0 + BN, lid, b, h_kv, kv_hi);
        }

        // S = Q K^T for this group's rows, 16 keys at a time.
        for (var n = 0u; n < BN; n += 16u) {
            var s = mat_zero();
            for (var d = 0u; d < Q_TILES; d++) {
                s = mat_mma(q_tiles[d], mat_load_b_transposed(K_AT + n * QS + 16u * d, QS), s);
            }
            mat_store(s, rows_at * SS + n, SS);
        }
        workgroupBarrier();
        // The online softmax of the tile's rows of S: LPR invocations per row (the tile groups are at
        // least 16 wide: every invocation has a row), KPL keys each, their maxima and sums combined
        // through part_max and part_sum (index lid: row r LPR + slice).
        let r = lid / LPR;
        let slice = lid % LPR;
        let first = lid - slice;
        {
            let i = row0 + r;
            var start = 0u;
            var end = 0u;
            if i < qlen {
                start = keys_start_at(i32(i) + shift);
                end = min(keys_end_at(i32(i) + shift, kvlen), kv_hi);
            }
            var e: array<vec4<f32>, MAX_BN / 4u>;
            var tile_max = NEG_BIG;
            for (var q = 0u; q < KPL / 4u; q++) {
                let key = slice * KPL + 4u * q;
                let j = vec4<u32>(n0 + key) + vec4<u32>(0u, 1u, 2u, 3u);
                let at = r * SS + key;
                let raw = vec4<f32>(acc_mem[at], acc_mem[at + 1u], acc_mem[at + 2u], acc_mem[at + 3u]);
                let x = modify_scores(raw, vec4<u32>(i), j, b, h);
                let seen = (j >= vec4<u32>(start)) & (j < vec4<u32>(end)) & score_visible(x);
                e[q] = select(vec4<f32>(NEG_BIG), x, seen);
                tile_max = max(tile_max, max(max(e[q].x, e[q].y), max(e[q].z, e[q].w)));
            }
            part_max[lid] = tile_max;
            workgroupBarrier();
            for (var k = 0u; k < LPR; k++) {
                tile_max = max(tile_max, part_max[first + k]);
            }
            // A row that has seen a key holds O; one past the bound asks the workgroup to rescale.
            let m = row_m[r];
            if m != NEG_BIG && tile_max > m + RESCALE_BOUND {
                atomicOr(&rescale[0], 1u);
            }
            if lid == 0u {
                tile_flags[0] = select(0u, FIX_SCALAR_PV, atomicLoad(&v_bad[0]) != 0u);
            }
            workgroupBarrier();
            let rescaling = atomicLoad(&rescale[0]) != 0u;
            // The reference maximum moves on a rescale (every row whose maximum grew) and at a row's
            // first key (its O and sum are still 0); both maxima are finite: alpha is 1 while a row
            // has seen no key, 0 when its first arrives.
            var m_new = m;
            if rescaling || m == NEG_BIG {
                m_new = max(m, tile_max);
            }
            let alpha = exp(m - m_new);
            var sum = 0.0;
            for (var q = 0u; q < KPL / 4u; q++) {
                // Masked scores are NEG_BIG exactly; their p is masked_p (the scalar P V skips them).
                let p = visible_exp(e[q], vec4<f32>(m_new));
                for (var c = 0u; c < 4u; c++) {
                    let rounded = MatElem(p[c]);
                    mat_mem[P_AT + r * PS + slice * KPL + 4u * q + c] = rounded;
                    sum += f32(rounded);
                }
            }
            part_sum[lid] = sum;
            if lid == 0u && rescaling {
                tile_flags[0] |= FIX_RESCALE;
            }
            workgroupBarrier();
            if slice == 0u {
                var total = 0.0;
                for (var k = 0u; k < LPR; k++) {
                    total += part_sum[first + k];
                }
                row_m[r] = m_new;
                row_l[r] = row_l[r] * alpha + total;
                row_alpha[r] = alpha;
            }
        }
        // Uniform (and after a barrier: row_alpha and P are written): every invocation of the
        // workgroup takes the same branches below.
        let fix = workgroupUniformLoad(&tile_flags[0]);

        // O = alpha O (+ P V in scalar arithmetic when V is not all finite), one tile of 16 columns
        // at a time through the S space of the group's rows.
        if fix != 0u {
            for (var c = 0u; c < O_TILES; c++) {
                mat_store(o_tiles[c], rows_at * SS, SS);
                workgroupBarrier();
                for (var t = lid; t < BM * 16u; t += WG) {
                    let row = t / 16u;
                    let at = row * SS + t % 16u;
                    var o = acc_mem[at] * row_alpha[row];
                    if (fix & FIX_SCALAR_PV) != 0u {
                        let d = 16u * c + t % 16u;
                        for (var jj = 0u; jj < BN; jj++) {
                            let p = f32(mat_mem[P_AT + row * PS + jj]);
                            // A key this row masks is not read (a NaN in its value is not the row's).
                            if p_visible(vec4<f32>(p)).x {
                                o += p * f32(mat_mem[V_AT + jj * VS + d]);
                            }
                        }
                    }
                    acc_mem[at] = o;
                }
                workgroupBarrier();
                o_tiles[c] = mat_load_c(rows_at * SS, SS);
                // Every lane has its share before the next tile's store overwrites it.
                workgroupBarrier();
            }
        }
        // O += P V for this group's rows.
        if (fix & FIX_SCALAR_PV) == 0u {
            var p_tiles: array<TileA, MAX_BN / 16u>;
            for (var k = 0u; k < BN / 16u; k++) {
                p_tiles[k] = mat_load_a(P_AT + rows_at * PS + 16u * k, PS);
            }
            for (var c = 0u; c < O_TILES; c++) {
                for (var k = 0u; k < BN / 16u; k++) {
                    let v_tile = mat_load_b(V_AT + 16u * k * VS + 16u * c, VS);
                    o_tiles[c] = mat_mma(p_tiles[k], v_tile, o_tiles[c]);
                }
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
    // O / l, 16 columns at a time through the S space.
    for (var c = 0u; c < O_TILES; c++) {
        mat_store(o_tiles[c], rows_at * SS, SS);
        workgroupBarrier();
        for (var t = lid; t < BM * 16u; t += WG) {
            let r = t / 16u;
            let d = 16u * c + t % 16u;
            let i = row0 + r;
            if row_stored(VIEW_O, out_b, i) && d < DV {
                let l = row_l[r];
                let seen = i < qlen && row_seen(vec4<f32>(l)).x;
                let o = select(0.0, acc_mem[r * SS + t % 16u] / l, seen);
                o_buf[view_index(VIEW_O, out_b, i, h) + d] = OutElem(o);
            }
        }
        workgroupBarrier();
    }
}
