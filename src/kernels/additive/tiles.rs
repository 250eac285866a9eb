//! Launch geometry of the fused kernels: the staged tile that fits the workgroup memory, the
//! backward's invocations per row, and the loop cost per invocation that llvmpipe's chunking needs.

use crate::device::{Context, KernelFamily};
use crate::spec::AttentionShape;

/// Rows (queries or keys) per workgroup, one per invocation.
pub(super) const WG: u32 = 64;

/// Rows of the other side per staged tile: 32, or fewer where the kernels' workgroup memory (its
/// largest user, the key-side backward: pair rows, value rows, `w`, four per-row scalars) would not
/// fit the device's limit (Da = Dv = 128 needs 33 KiB at 32 rows; Metal on Apple GPUs offers 32
/// KiB).
/// `lanes`: invocations per row (the backward's; 1 elsewhere).
pub(super) fn staged_tile(ctx: &Context, s: &AttentionShape, lanes: u32) -> u32 {
    let limit = ctx.limits().max_compute_workgroup_storage_size as usize;
    tile_for_limit(limit, s.head_dim_qk, s.head_dim_v, lanes)
}

/// Invocations per row in the fused backward (`shaders/additive/backward_lanes.wgsl`): enough that
/// each holds at most two vec4s of the score dim and eight value dims (then 64 floats of a row's
/// state and tanh, which fits the 128 registers of a wave64 invocation on RDNA3), on GPUs. On CPU
/// drivers, one: their invocations are SIMD lanes with no register file to fit, and a barrier per
/// step only costs (the lanes ran the backward 2.2x slower on lavapipe: BENCHMARKS.md).
pub(super) fn backward_lanes(ctx: &Context, s: &AttentionShape) -> u32 {
    if ctx.kernel_family() == KernelFamily::CpuDriver {
        return 1;
    }
    lanes_for(s.head_dim_qk, s.head_dim_v)
}

/// The fused backward's pipeline names (query side, key side): the CPU-driver family's one-lane
/// builds say so.
pub(super) fn backward_names(ctx: &Context) -> [&'static str; 2] {
    match ctx.kernel_family() {
        KernelFamily::CpuDriver => ["additive_backward_da_cpu", "additive_backward_db_cpu"],
        _ => ["additive_backward_da", "additive_backward_db"],
    }
}

fn lanes_for(da: usize, dv: usize) -> u32 {
    let lanes = da
        .div_ceil(4)
        .div_ceil(2)
        .max(dv.div_ceil(8))
        .next_power_of_two();
    lanes.min(WG as usize) as u32
}

/// The forward's staged tile and whether its rows of `a + bias` fit in workgroup memory beside it
/// (`OWN_IN_WORKGROUP`: 64 registers fewer per invocation at Da = 64, which RDNA3 needs to run the
/// kernel without spilling): the largest tile of 32 or 16 rows that leaves room for them (on GPUs
/// also 8: at Da 128 a 48 KiB GPU fits the rows only beside 8, and with them in registers the
/// kernel spills 17 VGPRs on RDNA3, benchmarks/additive-radv-2026-11-29), else the shared tile
/// with the rows in registers.
pub(super) fn forward_tile(ctx: &Context, s: &AttentionShape) -> (u32, bool) {
    let limit = ctx.limits().max_compute_workgroup_storage_size as usize;
    let gpu = ctx.kernel_family() != KernelFamily::CpuDriver;
    forward_tile_for_limit(limit, s.head_dim_qk, s.head_dim_v, gpu)
}

fn forward_tile_for_limit(limit: usize, da: usize, dv: usize, gpu: bool) -> (u32, bool) {
    let own = 16 * WG as usize * (da.div_ceil(4) | 1);
    let tiles: &[usize] = match gpu {
        true => &[32, 16, 8],
        false => &[32, 16],
    };
    match largest_tile_of(tiles, limit, [da, dv], 1, |_| own) {
        Some(tile) => (tile, true),
        None => (tile_for_limit(limit, da, dv, 1), false),
    }
}

/// The staged tile of the backward's kernels with `lanes` invocations per row (and of the forward
/// where its own rows do not fit beside one).
fn tile_for_limit(limit: usize, da: usize, dv: usize, lanes: u32) -> u32 {
    // The key side's four per-row scalars and the lanes' partial sums.
    let sums = if lanes > 1 { 32 * WG as usize } else { 0 };
    largest_tile_of(&[32, 16], limit, [da, dv], lanes, |tile| 16 * tile + sums).unwrap_or(8)
}

/// The largest staged tile of `tiles` rows (in decreasing order) whose workgroup memory (the staged
/// pair rows, value rows and `w` of `additive/common.wgsl`, padded for `lanes` invocations per row,
/// plus a kernel's `extra` bytes) fits `limit` bytes.
fn largest_tile_of(
    tiles: &[usize],
    limit: usize,
    [da, dv]: [usize; 2],
    lanes: u32,
    extra: impl Fn(usize) -> usize,
) -> Option<u32> {
    let lanes = lanes as usize;
    let da4 = da.div_ceil(4).next_multiple_of(lanes);
    let dv = dv.next_multiple_of(lanes);
    let bytes = |tile: usize| 16 * (tile * da4 + tile / 4 * dv + da4) + extra(tile);
    tiles
        .iter()
        .copied()
        .find(|&t| bytes(t) <= limit)
        .map(|t| t as u32)
}

/// The fused kernels' loop iterations per invocation (llvmpipe caps their total: `loop_chunks`),
/// counted from the shaders' loops, the 4-wide loops of the header's helpers included.
#[derive(Clone, Copy)]
pub(super) enum AdditiveKernel {
    Forward,
    Decode,
    BackwardQuerySide,
    BackwardKeySide,
}

impl AdditiveKernel {
    /// (iterations per row of the other side, fixed iterations) for score dim `da`, value dim `dv`,
    /// staged tiles of `tile` rows and `lanes` invocations per row (the backward's; 1 elsewhere).
    pub(super) fn loop_cost(self, da: usize, dv: usize, tile: u32, lanes: u32) -> (usize, usize) {
        let (wg, tile, lanes) = (WG as usize, tile as usize, lanes as usize);
        let da4 = da.div_ceil(4).next_multiple_of(lanes);
        let dv = dv.next_multiple_of(lanes);
        // Staging the other side's rows (a helper's 4-wide loop per vec4) and the value (or dO) rows.
        let staging = (tile * da4).div_ceil(wg) * 5 + (tile * dv).div_ceil(wg) + 1;
        let fixed = 16 * da4 + 4 * dv + 32;
        // Per step of the backward, a lane's loops over its score vec4s (twice) and value dims
        // (twice on the key side), and the sum over the row's lanes.
        let (lane_da4, lane_dv) = (da4 / lanes, dv / lanes);
        let backward_step = 1 + 2 * lane_da4 + 2 * lane_dv + lanes;
        // (iterations per step of the key or query loop, rows that step covers, fixed iterations)
        let (per_step, rows, fixed) = match self {
            // Per four keys: the scores, a rescale (at worst every time), P V.
            Self::Forward => (staging + tile / 4 * (2 + da4 + 2 * dv), tile, fixed),
            // One key per invocation and tile of WG: the score, the tile's max and sum, P V for
            // the owned value dims.
            Self::Decode => {
                let own = dv.div_ceil(wg);
                (
                    5 * da4 + 2 * wg + own * (wg + 1) + 1,
                    wg,
                    16 * da4 + 4 * own + 32,
                )
            }
            // Scores, dO . v, the derivatives; the key side also stages lse, D and the ranges.
            Self::BackwardQuerySide => (staging + tile / 4 * backward_step, tile, fixed),
            Self::BackwardKeySide => (
                staging + tile.div_ceil(wg) + tile / 4 * backward_step,
                tile,
                fixed,
            ),
        };
        (per_step.div_ceil(rows) + 1, fixed)
    }
}

#[cfg(test)]
mod tests {
    use super::{forward_tile_for_limit, tile_for_limit};

    #[test]
    fn the_forward_keeps_its_rows_in_workgroup_memory_on_gpus() {
        // NVIDIA's 48 KiB: Da 64 beside 32 rows; Da 128 only beside 8 on GPUs (with the rows in
        // registers it spills on RDNA3), in registers on CPU drivers.
        assert_eq!(forward_tile_for_limit(49152, 64, 64, true), (32, true));
        assert_eq!(forward_tile_for_limit(49152, 128, 128, true), (8, true));
        assert_eq!(forward_tile_for_limit(49152, 128, 128, false), (32, false));
        // lavapipe's and Apple's 32 KiB: Da 64 beside 16, Da 96 beside 8 on GPUs.
        assert_eq!(forward_tile_for_limit(32768, 64, 64, true), (16, true));
        assert_eq!(forward_tile_for_limit(32768, 96, 96, true), (8, true));
        assert_eq!(forward_tile_for_limit(32768, 96, 96, false), (32, false));
    }

    #[test]
    fn staged_tiles_fit_the_workgroup_memory_limit() {
        // WebGPU's default 16 KiB, lavapipe's and Apple's 32 KiB, NVIDIA's 48 KiB.
        assert_eq!(tile_for_limit(49152, 128, 128, 1), 32);
        assert_eq!(tile_for_limit(32768, 64, 64, 1), 32);
        assert_eq!(tile_for_limit(32768, 128, 128, 1), 16);
        assert_eq!(tile_for_limit(16384, 64, 64, 1), 16);
        assert_eq!(tile_for_limit(16384, 128, 128, 1), 8);
        // The GPU family's lanes: their partial sums take 2 KiB.
        assert_eq!(tile_for_limit(32768, 64, 64, 8), 32);
        assert_eq!(tile_for_limit(16384, 64, 64, 8), 16);
        assert_eq!(tile_for_limit(32768, 128, 128, 16), 16);
    }
}
