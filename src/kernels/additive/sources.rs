//! Each fused kernel's source as its pipeline compiles it: the additive header, the score
//! parameters or the backward's workspace, the attention header, and per-invocation arrays sized
//! for the call; and the override constants.

use crate::kernels::attention::header::{with_common, with_sizes};
use crate::spec::AttentionShape;

use super::tiles::WG;
use super::MAX_ADDITIVE_DIM;

const COMMON: &str = include_str!("../../../shaders/additive/common.wgsl");
pub(super) const FORWARD: &str = include_str!("../../../shaders/additive/forward.wgsl");
pub(super) const DECODE: &str = include_str!("../../../shaders/additive/decode.wgsl");
pub(super) const BACKWARD_DA: &str = include_str!("../../../shaders/additive/backward_da.wgsl");
pub(super) const BACKWARD_DB: &str = concat!(
    include_str!("../../../shaders/additive/backward_db.wgsl"),
    include_str!("../../../shaders/attention/output_pair.wgsl")
);
pub(super) const PARAM_GRADS: &str = include_str!("../../../shaders/additive/param_grads.wgsl");
pub(super) const SCORES: &str = include_str!("../../../shaders/additive/scores.wgsl");
pub(super) const BACKWARD_UNFUSED: &str =
    include_str!("../../../shaders/additive/backward_unfused.wgsl");
pub(super) const BACKWARD_WORKSPACE: &str =
    include_str!("../../../shaders/additive/backward_workspace.wgsl");
pub(super) const BACKWARD_PACK: &str = include_str!("../../../shaders/additive/backward_pack.wgsl");
const BACKWARD_LANES: &str = include_str!("../../../shaders/additive/backward_lanes.wgsl");
const SCORE_PARAMS: &str = include_str!("../../../shaders/additive/score_params.wgsl");

/// A fused forward kernel after the additive header and the bindings of w and the bias (the
/// attention header still to prepend).
pub(super) fn with_shared(body: &str) -> String {
    format!("{COMMON}\n{SCORE_PARAMS}\n{body}")
}

/// A fused backward kernel (`BACKWARD_DA` or `BACKWARD_DB`) after the additive header, the
/// workspace (which holds copies of w and the bias) and the lanes header (the attention header
/// still to prepend).
fn backward_source(body: &str) -> String {
    format!("{COMMON}\n{BACKWARD_WORKSPACE}\n{BACKWARD_LANES}\n{body}")
}

/// A fused kernel `text` with both shared headers and its per-invocation arrays sized exactly for
/// `s`, and the kernel's own `sizes`.
pub(super) fn sized(
    text: &str,
    s: &AttentionShape,
    sizes: &[(&str, u32)],
    score_bias: bool,
) -> String {
    let mut all = vec![
        ("MAX_DA", s.head_dim_qk as u32),
        ("MAX_DV", s.head_dim_v as u32),
    ];
    all.extend_from_slice(sizes);
    with_common(&with_sizes(&all, text), score_bias)
}

/// A fused backward kernel with every header, sized for `lanes` invocations per row.
pub(super) fn sized_backward(
    body: &str,
    s: &AttentionShape,
    lanes: u32,
    score_bias: bool,
) -> String {
    let lanes = lanes as usize;
    let lane_da4 = s.head_dim_qk.div_ceil(4).div_ceil(lanes) as u32;
    let lane_dv = s.head_dim_v.div_ceil(lanes) as u32;
    let sizes = [("MAX_LANE_DA4", lane_da4), ("MAX_LANE_DV", lane_dv)];
    sized(&backward_source(body), s, &sizes, score_bias)
}

/// Every additive kernel's source for the translation tests ([`crate::kernels::shaders`]): the
/// fused ones at head dims 128 and one lane per row.
pub(crate) fn shader_sources() -> Vec<(&'static str, String)> {
    let s = AttentionShape {
        batch: 1,
        q_seq: 1,
        kv_seq: 1,
        heads: 1,
        kv_heads: 1,
        head_dim_qk: MAX_ADDITIVE_DIM,
        head_dim_v: MAX_ADDITIVE_DIM,
    };
    let own = [("MAX_OWN", MAX_ADDITIVE_DIM.div_ceil(WG as usize) as u32)];
    let unfused = [
        ("additive_param_grads", PARAM_GRADS.to_string()),
        ("additive_scores", SCORES.to_string()),
        ("additive_backward_unfused", BACKWARD_UNFUSED.to_string()),
        (
            "additive_backward_pack",
            format!("{BACKWARD_WORKSPACE}\n{BACKWARD_PACK}"),
        ),
    ]
    .map(|(name, body)| (name, with_common(&body, true)));
    let fused = [
        (
            "additive_forward",
            sized(&with_shared(FORWARD), &s, &[], true),
        ),
        (
            "additive_decode",
            sized(&with_shared(DECODE), &s, &own, true),
        ),
        (
            "additive_backward_da",
            sized_backward(BACKWARD_DA, &s, 1, true),
        ),
        (
            "additive_backward_db",
            sized_backward(BACKWARD_DB, &s, 1, true),
        ),
    ];
    unfused.into_iter().chain(fused).collect()
}

pub(super) fn constants(s: &AttentionShape, tile: u32) -> [(&'static str, u32); 4] {
    [
        ("WG", WG),
        ("TILE", tile),
        ("DA", s.head_dim_qk as u32),
        ("DV", s.head_dim_v as u32),
    ]
}

/// The fused backward's constants: [`constants`] and its invocations per row.
pub(super) fn backward_constants(
    s: &AttentionShape,
    tile: u32,
    lanes: u32,
) -> Vec<(&'static str, u32)> {
    let mut constants = constants(s, tile).to_vec();
    constants.push(("LANES", lanes));
    constants
}
