// AdamW step (SPEC.md), one invocation per RUN elements of a tensor of a group
// (optimizer_common.wgsl), with the gradient scaled by the clip factor norm[1] of the grad-norm
// kernels:
//   g = grad * scale;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p = p (1 - lr wd) - lr (m / c1) / (sqrt(v / c2) + eps),   c1 = 1 - b1^t, c2 = 1 - b2^t.
// Nothing changes once health[0] != 0: a step had a non-finite loss or gradient norm
// (grad_norm_finalize.wgsl).
// LOSS_SCALING (mixed precision): norm[1] also unscales the gradient; a step the norm kernel marked
// skipped (scaling[3] != 0) changes nothing, and the bias corrections count the steps taken,
// `step` less the skipped ones (scaling[2]), computed here since the host does not know them.

struct Params {
    first: u32,
    count: u32,
    // Runs of RUN elements of the group's tensors (each tensor's last may be shorter).
    runs: u32,
    grid_x: u32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    correction1: f32,
    correction2: f32,
    step: u32,
}

override WG: u32 = 64u;
override RUN: u32 = 4u;

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read_write> param: array<f32>;
@group(0) @binding(3) var<storage, read> grad: array<f32>;
@group(0) @binding(4) var<storage, read_write> m: array<f32>;
@group(0) @binding(5) var<storage, read_write> v: array<f32>;
@group(0) @binding(6) var<storage, read> norm: array<f32>;
@group(0) @binding(7) var<storage, read> health: array<u32>;
@group(0) @binding(8) var<storage, read> scaling: array<u32>;

override LOSS_SCALING: bool = false;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let run = gid.y * params.grid_x * WG + gid.x;
    if run >= params.runs || health[0] != 0u || (LOSS_SCALING && scaling[3] != 0u) {
        return;
    }
    var correction1 = params.correction1;
    var correction2 = params.correction2;
    if LOSS_SCALING {
        let taken = f32(params.step - scaling[2]);
        correction1 = 1.0 - pow(params.beta1, taken);
        correction2 = 1.0 - pow(params.beta2, taken);
    }
    // RUN consecutive elements of one tensor: one table search for all of them.
    let segment = find_segment(params.first, params.count, run, false);
    let begin = (run - segment.start) * RUN;
    let end = min(begin + RUN, segment.len);
    for (var j = begin; j < end; j++) {
        let p = segment.param + j;
        let mi = segment.moment + j;
        let g = grad[segment.grad + j] * norm[1];
        let m_new = params.beta1 * m[mi] + (1.0 - params.beta1) * g;
        let v_new = params.beta2 * v[mi] + (1.0 - params.beta2) * g * g;
        m[mi] = m_new;
        v[mi] = v_new;
        let update = (m_new / correction1) / (sqrt(v_new / correction2) + params.eps);
        param[p] = param[p] * (1.0 - params.lr * params.weight_decay) - params.lr * update;
    }
}
