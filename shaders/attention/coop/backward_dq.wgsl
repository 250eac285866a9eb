// Attention backward, dQ, on tensor cores (SPEC.md; the "coop" family): the GPU family's dQ
// (attention/gpu/backward_dq.wgsl) with its three products as 16x16 tile multiply-adds through the
// matrix interface the host appends (matrix/cooperative.wgsl or matrix/portable.wgsl):
//   S = Q K^T,  dP = dO V^T,  dQ += dS K  (dS = P (dP - D), times scale at the end).
// Parallel over query blocks like the forward, so no float atomics and bitwise reproducible.
//
// A workgroup is NSG tile groups of SG invocations (subgroups in the tensor-core build) and owns
// BM = 16 NSG query rows of one (batch, head); group g owns rows 16 g .. 16 g + 15. Q (pre-scaled)
// and dO are staged once (their tiles loaded at each use: held across the loop they spilled at head
// dim 128 on RDNA3, benchmarks/coop-backward-2026-11-28), dQ held in accumulator tiles. Per tile of BN keys (K and V staged): S and dP go through workgroup memory in
// f32 to the elementwise step, which writes dS rounded to MatElem for dS K.
// A product skips nothing, and 0 x NaN is NaN: a tile whose K holds a non-finite value adds dS K in
// scalar arithmetic that skips masked pairs (dS holds masked_p there), so such a value reaches
// only the rows that see its key (as the GPU family).
//
// The key loop runs over [chunk_begin, chunk_end); later chunks add to dQ.

override BN: u32 = 32u;
override BM: u32 = 16u * NSG;
// Row strides of dS and of S / dP (KS and VS, and SG, NSG, WG, DK, DV, DKP and DVP:
// attention/coop/backward_tiles.wgsl).
override PS: u32 = BN + 8u;
override SS: u32 = BN + 4u;

// The lengths of the register arrays, declared by the pipeline's key
// (src/kernels/attention/variant.rs): K_TILES = DKP / 16 and V_TILES = DVP / 16, the tiles of a
// group's Q and dQ, and of its dO.

// InElem / OutElem: the element types of the inputs and outputs (f32, or f16 with SHADER_F16),
// aliased by the host before the common header. Q, K, V and dO: bindings 2-5; (lse, D): 6.
@group(0) @binding(7) var<storage, read_write> dq_buf: array<OutElem>;

// MatElem tiles, rows KS, VS or PS apart: Q and dO [BM x DKP / DVP], K and V [BN x DKP / DVP],
// dS [BM x BN]. Every offset is a multiple of 16 bytes (cooperative loads need it).
override DO_AT: u32 = BM * KS;
override K_AT: u32 = DO_AT + BM * VS;
override V_AT: u32 = K_AT + BN * KS;
override DS_AT: u32 = V_AT + BN * VS;
override MAT_MEM: u32 = DS_AT + BM * PS;
var<workgroup> mat_mem: array<MatElem, MAT_MEM>;
// f32: S and dP [BM x BN], rows SS apart; also where dQ passes on its way out (and through the
// scalar product), 16 columns at a time.
override DP_AT: u32 = BM * SS;
override ACC_MEM: u32 = 2u * BM * SS;
var<workgroup> acc_mem: array<f32, ACC_MEM>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    // Uniform per workgroup, so returning here keeps every barrier and tile call uniform.
    if group >= params.total_groups {
        return;
    }
    let rows_at = 16u * (lid / SG);
    mat_init(lid % SG);
    let owned = query_block(group);
    let q_block = owned.block;
    let b = owned.b;
    let h = owned.h;
    let h_kv = owned.h_kv;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let row0 = q_block * BM;

    // Q and dO are the first factors of S and dP: a non-finite value there reaches only its own
    // row, so they need no check.
    stage_tile(lid, VIEW_Q, b, h, row0, BM, qlen, DK, DKP, 0u, KS, params.scale);
    stage_tile(lid, VIEW_DO, b, h, row0, BM, qlen, DV, DVP, DO_AT, VS, 1.0);
    stage_row_values(lid, b, h, row0, qlen, kvlen);
    workgroupBarrier();
    var dq_tiles: array<TileC, K_TILES>;
    for (var d = 0u; d < K_TILES; d++) {
        dq_tiles[d] = mat_zero();
    }

    // Keys visible to any row of the block, within this dispatch's chunk. Keys past the chunk are
    // read as zeros; they count in a later chunk.
    let keys = query_block_keys(aligned(0u), row0, BM, qlen, kvlen);
    let n_begin = max(params.chunk_begin, keys.x);
    let n_end = min(keys.y, params.chunk_end);
    // The next tile's K and V, read one tile ahead (attention/coop/backward_tiles.wgsl).
    var k_next: array<vec4<MatElem>, LOADS>;
    var v_next: array<vec4<MatElem>, LOADS>;
    if n_begin < n_end {
        k_next = read_tile(lid, VIEW_K, b, h_kv, n_begin, BN, n_end, DK, DKP);
        v_next = read_tile(lid, VIEW_V, b, h_kv, n_begin, BN, n_end, DV, DVP);
    }
    for (var n0 = n_begin; n0 < n_end; n0 += BN) {
        if lid == 0u {
            atomicStore(&operand_bad[0], 0u);
        }
        // The previous tile's products have read K and dS.
        workgroupBarrier();
        if store_tile(lid, k_next, BN, DKP, K_AT, KS) {
            atomicOr(&operand_bad[0], 1u);
        }
        store_tile(lid, v_next, BN, DVP, V_AT, VS);
        workgroupBarrier();
        if n0 + BN < n_end {
            k_next = read_tile(lid, VIEW_K, b, h_kv, n0 + BN, BN, n_end, DK, DKP);
            v_next = read_tile(lid, VIEW_V, b, h_kv, n0 + BN, BN, n_end, DV, DVP);
        }

        // S and dP for the group's rows, 16 keys at a time.
        for (var n = 0u; n < BN; n += 16u) {
            var s = mat_zero();
            for (var d = 0u; d < K_TILES; d++) {
                s = mat_mma(mat_load_a(rows_at * KS + 16u * d, KS), mat_load_b_transposed(K_AT + n * KS + 16u * d, KS), s);
            }
            mat_store(s, rows_at * SS + n, SS);
            var dp = mat_zero();
            for (var d = 0u; d < V_TILES; d++) {
                dp = mat_mma(mat_load_a(DO_AT + rows_at * VS + 16u * d, VS), mat_load_b_transposed(V_AT + n * VS + 16u * d, VS), dp);
            }
            mat_store(dp, DP_AT + rows_at * SS + n, SS);
        }
        if lid == 0u {
            tile_flags[0] = atomicLoad(&operand_bad[0]);
        }
        workgroupBarrier();

        // dS, four keys of one row at a time; masked pairs hold masked_p (the scalar product skips
        // them).
        for (var t = lid; t < BM * BN / 4u; t += WG) {
            let ii = t / (BN / 4u);
            let jj = 4u * (t % (BN / 4u));
            let j = vec4<u32>(n0 + jj) + vec4<u32>(0u, 1u, 2u, 3u);
            let at = ii * SS + jj;
            let s = vec4<f32>(acc_mem[at], acc_mem[at + 1u], acc_mem[at + 2u], acc_mem[at + 3u]);
            let dp = vec4<f32>(
                acc_mem[DP_AT + at],
                acc_mem[DP_AT + at + 1u],
                acc_mem[DP_AT + at + 2u],
                acc_mem[DP_AT + at + 3u],
            );
            let x = modify_scores(s, vec4<u32>(row0 + ii), j, b, h);
            let seen = (j >= vec4<u32>(row_start[ii])) & (j < vec4<u32>(row_end[ii]))
                & score_visible(x) & (j < vec4<u32>(n_end));
            let p = select(vec4<f32>(0.0), exp(x - row_lse[ii]), seen);
            let ds = select(vec4<f32>(masked_p()), p * (dp - row_delta[ii]) * score_grad(s), seen);
            for (var e = 0u; e < 4u; e++) {
                mat_mem[DS_AT + ii * PS + jj + e] = MatElem(ds[e]);
            }
        }
        // A barrier too (dS is written), and uniform: every invocation takes the same branch.
        let fix = workgroupUniformLoad(&tile_flags[0]);

        if fix == 0u {
            // dQ += dS K for the group's rows.
            for (var n = 0u; n < BN; n += 16u) {
                let ds = mat_load_a(DS_AT + rows_at * PS + n, PS);
                for (var c = 0u; c < K_TILES; c++) {
                    dq_tiles[c] = mat_mma(ds, mat_load_b(K_AT + n * KS + 16u * c, KS), dq_tiles[c]);
                }
            }
        } else {
            // The same sums in scalar arithmetic, one accumulator tile at a time through the S
            // space (read by now), skipping each row's masked keys.
            for (var c = 0u; c < K_TILES; c++) {
                mat_store(dq_tiles[c], rows_at * SS, SS);
                workgroupBarrier();
                for (var t = lid; t < BM * 16u; t += WG) {
                    let ii = t / 16u;
                    let at = ii * SS + t % 16u;
                    var x = acc_mem[at];
                    for (var jj = 0u; jj < BN; jj++) {
                        let w = f32(mat_mem[DS_AT + ii * PS + jj]);
                        if p_visible(vec4<f32>(w)).x {
                            x += w * f32(mat_mem[K_AT + jj * KS + 16u * c + t % 16u]);
                        }
                    }
                    acc_mem[at] = x;
                }
                workgroupBarrier();
                dq_tiles[c] = mat_load_c(rows_at * SS, SS);
                // Every lane has its share before the next tile's store overwrites it.
                workgroupBarrier();
            }
        }
    }

    // dQ (times scale) out, 16 columns at a time through the S space; a later chunk adds to an
    // earlier one's.
    let accumulate = params.accumulate != 0u;
    for (var c = 0u; c < K_TILES; c++) {
        workgroupBarrier();
        mat_store(dq_tiles[c], rows_at * SS, SS);
        workgroupBarrier();
        for (var t = lid; t < BM * 16u; t += WG) {
            let i = row0 + t / 16u;
            let d = 16u * c + t % 16u;
            if row_stored(VIEW_DQ, b, i) && d < DK {
                let index = view_index(VIEW_DQ, b, i, h) + d;
                var x = acc_mem[(t / 16u) * SS + t % 16u] * params.scale;
                if accumulate {
                    x += f32(dq_buf[index]);
                }
                dq_buf[index] = OutElem(x);
            }
        }
    }
}
