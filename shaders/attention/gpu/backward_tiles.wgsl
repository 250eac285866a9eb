// The GPU-family backward kernels' staged tiles: dQ and dK/dV stage the same four views, Q and dO
// rows of a query tile (BM rows), K and V rows of a key tile (BN rows), and read them through
// attention/gpu/tiles.wgsl. Odd row strides (vec4s): invocations reading different rows of one
// column hit different banks. The host places this file ahead of the kernel's own workgroup
// variables (src/kernels/attention/variant.rs says why).
override KS: u32 = DK4 | 1u;
override VS: u32 = DV4 | 1u;
override Q_TILE: u32 = BM * KS;
override DO_TILE: u32 = BM * VS;
override K_TILE: u32 = BN * KS;
override V_TILE: u32 = BN * VS;

var<workgroup> q_tile: array<vec4<f32>, Q_TILE>;
var<workgroup> do_tile: array<vec4<f32>, DO_TILE>;
var<workgroup> k_tile: array<vec4<f32>, K_TILE>;
var<workgroup> v_tile: array<vec4<f32>, V_TILE>;

// vec4s between staged rows of a view.
fn staged_stride(view: u32) -> u32 {
    return select(VS, KS, score_side(view));
}

// Element `index` of a view's tile.
fn staged_at(view: u32, index: u32) -> vec4<f32> {
    switch view {
        case VIEW_Q: {
            return q_tile[index];
        }
        case VIEW_K: {
            return k_tile[index];
        }
        case VIEW_V: {
            return v_tile[index];
        }
        default: {
            return do_tile[index];
        }
    }
}

fn store_staged(view: u32, row: u32, d4: u32, x: vec4<f32>) {
    let i = row * staged_stride(view) + d4;
    switch view {
        case VIEW_Q: {
            q_tile[i] = x;
        }
        case VIEW_K: {
            k_tile[i] = x;
        }
        case VIEW_V: {
            v_tile[i] = x;
        }
        default: {
            do_tile[i] = x;
        }
    }
}

// Q, K and V (qkv_row4, attention/gpu/tiles.wgsl) and dO (attention/do_rows.wgsl or its vec4
// build).
fn input_row4(view: u32, index: u32, count: u32) -> vec4<f32> {
    if view == VIEW_DO {
        return do_row4(index, count);
    }
    return qkv_row4(view, index, count);
}
