// Attention backward, dK and dV, for GPUs (the tiled family; SPEC.md):
//   dV_j = sum_i p_ij dO_i,   dK_j = scale * sum_i dS_ij q_i,   dS_ij = p_ij (dO_i . v_j - D_i),
// summed over every query head that shares kv head h_kv, in a fixed order: deterministic, no atomics.
// The build with attention/gpu/dq_sums.wgsl also adds dQ from each tile's dS^T (with atomics).
//
// A workgroup owns BN keys of one (batch, kv head), staged once in workgroup memory (K pre-scaled), and
// steps over tiles of BM query rows (Q, dO and (lse, D) staged). Invocation (tk, tq) owns four keys
// (vec4 lanes) by SQ query rows of S^T and dP^T (rows tq + TQ * c), and the same four keys by OCK and
// OCV vec4 columns of dK and dV (columns tq + TQ * c). P^T and dS^T pass through workgroup memory
// between the two products. Under the causal mask, query tiles that see none of the block's keys are
// skipped.
//
// The loop over (query head g of the group, query row i), flattened as g * Lq + i, runs over
// [chunk_begin, chunk_end); later chunks add to dK and dV (drivers that cap loop iterations).

override WG: u32 = 128u;
override BN: u32 = 32u;
override BM: u32 = 32u;
override DK: u32 = 64u;
override DV: u32 = 64u;
override DK4: u32 = (DK + 3u) / 4u;
override DV4: u32 = (DV + 3u) / 4u;
override TK: u32 = BN / 4u;
override TQ: u32 = WG / TK;
override SQ: u32 = BM / TQ;
override OCK: u32 = (DK4 + TQ - 1u) / TQ;
override OCV: u32 = (DV4 + TQ - 1u) / TQ;
override PT_TILE: u32 = BM * TK;

// The per-invocation arrays' sizes, declared by the pipeline's key (private arrays need constant
// lengths; src/kernels/attention/variant.rs): MAX_SQ, MAX_OCK, MAX_OCV: SQ, OCK and OCV.

// InElem / OutElem: the element types of the inputs and outputs (f32, or f16 with SHADER_F16),
// aliased by the host before the common header; arithmetic is f32. Q, K, V and dO (bindings 2-5)
// and their row reads (q_row4, k_row4, v_row4, do_row4) come from attention/input_rows.wgsl or its
// vec4 build, appended by the host.
@group(0) @binding(6) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> dk_buf: array<OutElem>;
@group(0) @binding(8) var<storage, read_write> dv_buf: array<OutElem>;

// The micro-tiles' columns (attention/gpu/tiles.wgsl; K, V, Q and dO staged in
// attention/gpu/backward_tiles.wgsl).
const MAX_DOTS: u32 = MAX_SQ;

var<workgroup> stat_tile: array<vec2<f32>, BM>;
// P^T and dS^T of the tile: [query * TK + tk] = the four keys of key group tk.
var<workgroup> pt_tile: array<vec4<f32>, PT_TILE>;
var<workgroup> dst_tile: array<vec4<f32>, PT_TILE>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = linear_group(wg);
    if group >= params.total_groups {
        return;
    }
    let owned = key_block(group);
    let k_block = owned.block;
    let b = owned.b;
    let h_kv = owned.h_kv;
    let group_size = params.heads / params.kv_heads;
    let qlen = q_len(b);
    let kvlen = kv_len(b);
    let col0 = k_block * BN;
    let tk = lid / TQ;
    let tq = lid % TQ;
    let keys = vec4<u32>(col0 + tk * 4u) + vec4<u32>(0u, 1u, 2u, 3u);

    stage_rows(lid, VIEW_K, b, h_kv, col0, kvlen, params.scale);
    stage_rows(lid, VIEW_V, b, h_kv, col0, kvlen, 1.0);

    var dk: array<vec4<f32>, 4u * MAX_OCK>;
    var dv: array<vec4<f32>, 4u * MAX_OCV>;
    for (var c = 0u; c < 4u * OCK; c++) {
        dk[c] = vec4<f32>(0.0);
    }
    for (var c = 0u; c < 4u * OCV; c++) {
        dv[c] = vec4<f32>(0.0);
    }

    let rows = key_block_rows(col0, BN, qlen, kvlen);
    for (var g = 0u; g < group_size; g++) {
        // This dispatch's rows of query head g: [lo, hi), uniform across the workgroup.
        let t0 = g * params.q_seq;
        if params.chunk_end <= t0 {
            break;
        }
        if params.chunk_begin >= t0 + params.q_seq {
            continue;
        }
        let lo = max(rows.x, max(params.chunk_begin, t0) - t0);
        let hi = min(rows.y, min(params.chunk_end, t0 + params.q_seq) - t0);
        let h = h_kv * group_size + g;
        for (var m0 = lo; m0 < hi; m0 += BM) {
            workgroupBarrier();
            stage_rows(lid, VIEW_Q, b, h, m0, hi, 1.0);
            stage_rows(lid, VIEW_DO, b, h, m0, hi, 1.0);
            for (var t = lid; t < BM; t += WG) {
                var st = vec2<f32>(0.0);
                if m0 + t < hi {
                    st = stats[(b * params.heads + h) * params.q_seq + m0 + t];
                }
                stat_tile[t] = st;
            }
            workgroupBarrier();

            // S^T and dP^T for four keys by SQ query rows.
            var st = tile_dots(VIEW_K, tk, VIEW_Q, tq, TQ, SQ);
            var dpt = tile_dots(VIEW_V, tk, VIEW_DO, tq, TQ, SQ);
            for (var c = 0u; c < SQ; c++) {
                let ii = tq + TQ * c;
                let i = m0 + ii;
                // Key j is visible to row i iff key_start(i) <= j < key_end(i) (none for rows outside
                // [lo, hi)); such a row saw a key in the forward, so its lse is finite.
                var start = 0u;
                var end = 0u;
                if i < hi {
                    start = key_start(i);
                    end = key_end(i, kvlen);
                }
                let stat = stat_tile[ii];
                // lse is -inf for rows that see no key; never subtract it (fast-math drivers).
                let lse = select(0.0, stat.x, end > start);
                let x = modify_scores(st[c], vec4<u32>(i), keys, b, h);
                let seen = (keys >= vec4<u32>(start)) & (keys < vec4<u32>(end)) & score_visible(x);
                // Masked pairs hold masked_p: the products below skip their dO and Q rows (a NaN
                // in a row that does not see the key is not the key's).
                let p = select(vec4<f32>(masked_p()), exp(x - lse), seen);
                pt_tile[ii * TK + tk] = p;
                dst_tile[ii * TK + tk] =
                    select(vec4<f32>(0.0), p * (dpt[c] - stat.y) * score_grad(st[c]), seen);
            }
            workgroupBarrier();

            // dQ of the tile from this block's keys, where the host builds it
            // (attention/gpu/dq_sums.wgsl).
            add_dq_tile(lid, b, h, m0, hi);
            for (var ii = 0u; ii < BM; ii++) {
                let p = pt_tile[ii * TK + tk];
                let ds = dst_tile[ii * TK + tk];
                let keep = p_visible(p);
                if !all(keep) {
                    if any(keep) {
                        let zero = vec4<f32>(0.0);
                        for (var c = 0u; c < OCV; c++) {
                            let d4 = tq + TQ * c;
                            if TQ * OCV == DV4 || d4 < DV4 {
                                let ox = do_tile[ii * VS + d4];
                                dv[c] += select(zero, p.x * ox, keep.x);
                                dv[MAX_OCV + c] += select(zero, p.y * ox, keep.y);
                                dv[2u * MAX_OCV + c] += select(zero, p.z * ox, keep.z);
                                dv[3u * MAX_OCV + c] += select(zero, p.w * ox, keep.w);
                            }
                        }
                        for (var c = 0u; c < OCK; c++) {
                            let d4 = tq + TQ * c;
                            if TQ * OCK == DK4 || d4 < DK4 {
                                let qx = q_tile[ii * KS + d4];
                                dk[c] += select(zero, ds.x * qx, keep.x);
                                dk[MAX_OCK + c] += select(zero, ds.y * qx, keep.y);
                                dk[2u * MAX_OCK + c] += select(zero, ds.z * qx, keep.z);
                                dk[3u * MAX_OCK + c] += select(zero, ds.w * qx, keep.w);
                            }
                        }
                    }
                    continue;
                }
                for (var c = 0u; c < OCV; c++) {
                    let d4 = tq + TQ * c;
                    if TQ * OCV == DV4 || d4 < DV4 {
                        let ox = do_tile[ii * VS + d4];
                        dv[c] += p.x * ox;
                        dv[MAX_OCV + c] += p.y * ox;
                        dv[2u * MAX_OCV + c] += p.z * ox;
                        dv[3u * MAX_OCV + c] += p.w * ox;
                    }
                }
                for (var c = 0u; c < OCK; c++) {
                    let d4 = tq + TQ * c;
                    if TQ * OCK == DK4 || d4 < DK4 {
                        let qx = q_tile[ii * KS + d4];
                        dk[c] += ds.x * qx;
                        dk[MAX_OCK + c] += ds.y * qx;
                        dk[2u * MAX_OCK + c] += ds.z * qx;
                        dk[3u * MAX_OCK + c] += ds.w * qx;
                    }
                }
            }
        }
    }

    let accumulate = params.accumulate != 0u;
    for (var r = 0u; r < 4u; r++) {
        let j = keys[r];
        if row_stored(VIEW_DK, b, j) {
            let k_base = view_index(VIEW_DK, b, j, h_kv);
            for (var c = 0u; c < OCK; c++) {
                let d4 = tq + TQ * c;
                let g = dk[r * MAX_OCK + c] * params.scale;
                for (var e = 0u; e < 4u; e++) {
                    let d = d4 * 4u + e;
                    if d < DK {
                        var x = g[e];
                        if accumulate {
                            x += f32(dk_buf[k_base + d]);
                        }
                        dk_buf[k_base + d] = OutElem(x);
                    }
                }
            }
        }
        if !row_stored(VIEW_DV, b, j) {
            continue;
        }
        let v_base = view_index(VIEW_DV, b, j, h_kv);
        for (var c = 0u; c < OCV; c++) {
            let d4 = tq + TQ * c;
            let g = dv[r * MAX_OCV + c];
            for (var e = 0u; e < 4u; e++) {
                let d = d4 * 4u + e;
                if d < DV {
                    var x = g[e];
                    if accumulate {
                        x += f32(load_dv(v_base + d));
                    }
                    store_dv(v_base + d, OutElem(x));
                }
            }
        }
    }
}
