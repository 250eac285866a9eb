//! The header every attention shader is assembled with (`shaders/attention/common.wgsl`: the
//! parameter block, strided addressing, masks and score modifiers), its score-bias terms, and the
//! module constants that size kernels' per-invocation arrays.

use crate::tensor::DType;

pub(super) const COMMON: &str = include_str!("../../../shaders/attention/common.wgsl");
pub(super) const SCORE_BIAS: &str = include_str!("../../../shaders/attention/score_bias.wgsl");
pub(super) const SCORE_BIAS_NONE: &str =
    include_str!("../../../shaders/attention/score_bias_none.wgsl");
/// K and V read through a paged cache's block table where `PAGE` > 0 (binding 7: `input_index`,
/// `cache_row`), for the kernels that can read a paged cache; `KV_PAGES_NONE` for the others.
pub(super) const KV_PAGES: &str = include_str!("../../../shaders/attention/kv_pages.wgsl");
pub(super) const KV_PAGES_NONE: &str =
    include_str!("../../../shaders/attention/kv_pages_none.wgsl");

/// `body` with the common header, reading and writing f32; its score-bias terms read the binding
/// (`score_bias`) or are zero (`score_bias_none.wgsl`, for calls without a bias or relative table).
pub(crate) fn with_common(body: &str, score_bias: bool) -> String {
    with_common_typed(body, DType::F32, DType::F32, score_bias)
}

/// `body` with the common header, reading its inputs as `InElem` = `input` and writing its outputs as
/// `OutElem` = `output` (the typed kernels of the GPU family: f16 storage, f32 arithmetic), and its
/// score-bias terms as [`with_common`]'s.
pub(super) fn with_common_typed(
    body: &str,
    input: DType,
    output: DType,
    score_bias: bool,
) -> String {
    let enable = match input == DType::F16 || output == DType::F16 {
        true => "enable f16;\n",
        false => "",
    };
    let (i, o) = (input.name(), output.name());
    let common = COMMON;
    let terms = match score_bias {
        true => SCORE_BIAS,
        false => SCORE_BIAS_NONE,
    };
    format!("{enable}alias InElem = {i};\nalias OutElem = {o};\n{common}\n{terms}\n{body}")
}

/// `body` after module constants declaring `sizes` (`const NAME: u32 = value;`): how kernels size
/// their per-invocation arrays, which WGSL cannot take from override constants.
pub(crate) fn with_sizes(sizes: &[(&str, u32)], body: &str) -> String {
    let mut text = String::new();
    for (name, value) in sizes {
        text.push_str(&format!("const {name}: u32 = {value}u;\n"));
    }
    text.push_str(body);
    text
}
