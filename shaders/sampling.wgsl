// Token sampling on the GPU, one workgroup per row of logits [B, V]: greedy (temperature 0: the
// arg max, lowest id among ties) or a draw from softmax(logits / temperature) restricted by top-k
// and top-p. Only the chosen ids leave the GPU.
//
// Unnormalised probabilities p_j = exp((x_j - max) / T) are recomputed on each pass over the row
// (nothing V-sized is stored). Top-k keeps the ids with p_j at least the k-th largest (ties kept);
// top-p then keeps, of those, the ids with p_j at least the largest threshold whose kept mass is
// still >= top_p of the total (the shortest head of the sorted distribution reaching top_p, ties
// kept). Both thresholds are found by bisection on the bit patterns of positive f32 values (their
// order is the values' order): 32 count or sum reductions each, in a fixed order. The draw:
// u = hash(seed, draw, row) in [0, 1), point = u * (kept mass); the id where the running sum of
// kept p_j in id order passes the point (a workgroup prefix over contiguous id chunks).
//
// PER_ROW: each row's settings (greedy, top-k, top-p, temperature, seed) come from `rows[row]`
// instead of the parameter block (requests of a serving batch with their own settings).

// One row's settings: the whole batch's in the parameter block, or each row's (PER_ROW).
struct RowSampling {
    greedy: u32,
    top_k: u32,
    top_p: f32,
    inv_temperature: f32,
    seed_lo: u32,
    seed_hi: u32,
    pad0: u32,
    pad1: u32,
}

struct Params {
    batch: u32,
    vocab: u32,
    draw_lo: u32,
    draw_hi: u32,
    grid_x: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
    row: RowSampling,
}

override WG: u32 = 256u;
override PER_ROW: bool = false;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
// [B] settings, 8 words each as RowSampling (PER_ROW; another read-only buffer otherwise: words, so
// any buffer is big enough to stand in).
@group(0) @binding(3) var<storage, read> rows: array<u32>;

var<workgroup> red_f: array<f32, WG>;
var<workgroup> red_u: array<u32, WG>;
var<workgroup> chosen: u32;

// PCG hash (Jarzynski and Olano 2020).
fn pcg(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

fn uniform01(row: u32, seed_lo: u32, seed_hi: u32) -> f32 {
    let h = pcg(seed_lo ^ pcg(seed_hi ^ pcg(params.draw_lo ^ pcg(params.draw_hi ^ pcg(row)))));
    return f32(h >> 8u) / 16777216.0;
}

fn sum_f(lid: u32, x: f32) -> f32 {
    workgroupBarrier();
    red_f[lid] = x;
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if lid < stride {
            red_f[lid] += red_f[lid + stride];
        }
    }
    workgroupBarrier();
    return red_f[0];
}

fn sum_u(lid: u32, x: u32) -> u32 {
    workgroupBarrier();
    red_u[lid] = x;
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if lid < stride {
            red_u[lid] += red_u[lid + stride];
        }
    }
    workgroupBarrier();
    return red_u[0];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wg.y * params.grid_x + wg.x;
    if row >= params.batch {
        return;
    }
    let base = row * params.vocab;
    let v = params.vocab;
    var cfg = params.row;
    if PER_ROW {
        let w = row * 8u;
        cfg = RowSampling(rows[w], rows[w + 1u], bitcast<f32>(rows[w + 2u]), bitcast<f32>(rows[w + 3u]), rows[w + 4u], rows[w + 5u], 0u, 0u);
    }

    // Max and arg max (lowest id among ties).
    var best = -3.0e38;
    var best_id = 0xffffffffu;
    for (var j = lid; j < v; j += WG) {
        let x = logits[base + j];
        if x > best || best_id == 0xffffffffu {
            best = x;
            best_id = j;
        }
    }
    workgroupBarrier();
    red_f[lid] = best;
    red_u[lid] = best_id;
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if lid < stride {
            let other = red_f[lid + stride];
            let other_id = red_u[lid + stride];
            if other_id != 0xffffffffu && (red_u[lid] == 0xffffffffu || other > red_f[lid] || (other == red_f[lid] && other_id < red_u[lid])) {
                red_f[lid] = other;
                red_u[lid] = other_id;
            }
        }
    }
    workgroupBarrier();
    let top = red_f[0];
    let arg_max = red_u[0];
    if cfg.greedy != 0u {
        if lid == 0u {
            ids[row] = arg_max;
        }
        return;
    }

    // Top-k threshold: the largest bit pattern T with count(bits(p_j) >= T) >= k (bits(0) when k
    // covers the whole row).
    var threshold = 0u;
    if cfg.top_k < v {
        var lo = 0u;
        var hi = bitcast<u32>(1.0) + 1u;
        // Invariant: count(>= lo) >= k, count(>= hi) < k.
        for (var it = 0u; it < 32u; it++) {
            let mid = lo + (hi - lo) / 2u;
            var count = 0u;
            for (var j = lid; j < v; j += WG) {
                let p = exp((logits[base + j] - top) * cfg.inv_temperature);
                count += select(0u, 1u, bitcast<u32>(p) >= mid);
            }
            if sum_u(lid, count) >= cfg.top_k {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        threshold = lo;
    }
    if cfg.top_p < 1.0 {
        var kept = 0.0;
        for (var j = lid; j < v; j += WG) {
            let p = exp((logits[base + j] - top) * cfg.inv_temperature);
            kept += select(0.0, p, bitcast<u32>(p) >= threshold);
        }
        let goal = cfg.top_p * sum_f(lid, kept);
        // Invariant: mass(>= lo) >= goal, mass(>= hi) < goal.
        var lo = threshold;
        var hi = bitcast<u32>(1.0) + 1u;
        for (var it = 0u; it < 32u; it++) {
            let mid = lo + (hi - lo) / 2u;
            var mass = 0.0;
            for (var j = lid; j < v; j += WG) {
                let p = exp((logits[base + j] - top) * cfg.inv_temperature);
                mass += select(0.0, p, bitcast<u32>(p) >= mid);
            }
            if sum_f(lid, mass) >= goal {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        threshold = lo;
    }

    // The draw over contiguous id chunks, one per invocation, in id order.
    let chunk = (v + WG - 1u) / WG;
    let first = min(lid * chunk, v);
    let end = min(first + chunk, v);
    var own = 0.0;
    var last_kept = 0xffffffffu;
    for (var j = first; j < end; j++) {
        let p = exp((logits[base + j] - top) * cfg.inv_temperature);
        if p > 0.0 && bitcast<u32>(p) >= threshold {
            own += p;
            last_kept = j;
        }
    }
    workgroupBarrier();
    red_f[lid] = own;
    workgroupBarrier();
    if lid == 0u {
        // The fallback when rounding leaves the point at the very end: the arg max is always kept.
        chosen = arg_max;
        var prefix = 0.0;
        for (var t = 0u; t < WG; t++) {
            let s = red_f[t];
            red_f[t] = prefix;
            prefix += s;
        }
        red_u[0] = bitcast<u32>(prefix);
    }
    workgroupBarrier();
    let total = bitcast<f32>(red_u[0]);
    let point = uniform01(row, cfg.seed_lo, cfg.seed_hi) * total;
    let prefix = red_f[lid];
    if own > 0.0 && point >= prefix && point < prefix + own {
        var running = prefix;
        var pick = last_kept;
        for (var j = first; j < end; j++) {
            let p = exp((logits[base + j] - top) * cfg.inv_temperature);
            if p > 0.0 && bitcast<u32>(p) >= threshold {
                running += p;
                if running > point {
                    pick = j;
                    break;
                }
            }
        }
        chosen = pick;
    }
    workgroupBarrier();
    if lid == 0u {
        ids[row] = chosen;
    }
}
