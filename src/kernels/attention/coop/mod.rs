//! The tensor-core kernel family of the fused forward ([`KernelFamily::Coop`],
//! `shaders/attention/coop/forward.wgsl`): S = Q K^T and P V as 16x16 tile multiply-adds through a
//! small matrix interface with two builds, wgpu's cooperative matrices
//! (`matrix/cooperative.wgsl`) and ordinary arithmetic
//! (`matrix/portable.wgsl`, which runs on any adapter, so every test proves the
//! kernel's tiling, masks, modifiers and softmax). The tensor-core build is used only on a device
//! that lists the f16 16x16x16 configuration with f32 accumulation and whose result on a small
//! problem matches the GPU family's (wgpu does not check a configuration, and an unlisted one
//! computes garbage); otherwise the portable build runs and one log line says why. Inputs are
//! rounded to f16 (MatElem) in workgroup memory where the device has f16, so the family promises
//! f16 accuracy for every input type. The backward's kernels are in [`backward`].

use super::call::{AttentionOutput, CacheRead, ForwardCall};
use super::gpu;
use super::gpu::encode_forward_gpu;
use super::options::AttentionOptions;
use super::shape::check_options;
use super::tune::qualification_values;
use super::variant::{FamilyBuild, FusedKernel, FusedVariant, KvWords, MatrixBuild};
use crate::device::{Context, KernelChoice, KernelFamily};
use crate::error::Result;
use crate::kernels::matrix::{mismatch, record_qualification};
use crate::spec::AttentionShape;
use crate::tensor::{DType, GpuTensor, HeadsView};
use gpu::{encode_split_forward, SplitForwardKernel};

mod backward;

pub use backward::qualify_backward_build;
pub(super) use backward::{encode_backward_coop, CoopBackward};

/// The side of one matrix tile, and the rows each tile group owns.
const TILE: usize = 16;
/// Tile group of the portable build (the tensor-core build's is the subgroup, 16 to 128 wide: the
/// softmax gives each of a group's 16 rows group / 16 invocations): 32, NVIDIA's subgroup, so the
/// tests run the shape the tensor cores do.
const PORTABLE_GROUP: u32 = 32;
/// (tile groups per workgroup, keys per staged tile) tried in order, the first that fits the
/// workgroup storage taken: more groups share each staged K/V tile, and longer key tiles cut the
/// barriers per key; four groups with 64 keys fit 48 KiB at head dim 64 in f16, 32 keys at 128.
const SHAPES: [(u32, u32); 9] = [
    (4, 64),
    (4, 32),
    (2, 64),
    (2, 32),
    (1, 64),
    (1, 32),
    (4, 16),
    (2, 16),
    (1, 16),
];

/// The element type of the staged tiles: f16 where the device has it (what tensor cores take).
fn mat_elem(ctx: &Context) -> DType {
    crate::kernels::matrix::tile_element(ctx)
}

/// Shape of one coop forward pipeline on a context: `groups` tile groups of `group` invocations
/// (a subgroup each in the tensor-core build), 16 query rows per group, `block_n` keys per tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CoopForward {
    pub build: MatrixBuild,
    pub group: u32,
    pub groups: u32,
    pub block_n: u32,
}

impl CoopForward {
    /// The build and workgroup `ctx` runs the family with (qualifying the tensor-core build on the
    /// device at first use): the most tile groups whose tiles fit the workgroup storage, or `None`
    /// where the context runs another family or not even one group's fit (the GPU family then
    /// runs it).
    pub fn choose(ctx: &Context, s: &AttentionShape, choice: KernelChoice) -> Result<Option<Self>> {
        if choice.family_on(ctx) != KernelFamily::Coop {
            return Ok(None);
        }
        let build = matrix_build(ctx)?;
        Ok(Self::fitting(ctx, s, build, choice.coop_forward))
    }

    /// The shapes `(groups, keys)` the static choice considers for `s` on `ctx` (every one of
    /// [`SHAPES`] that fits, within the CPU drivers' bounds), with the build the context runs: the
    /// autotuner's candidates.
    pub fn candidates(ctx: &Context, s: &AttentionShape) -> Result<Vec<(u32, u32)>> {
        let build = matrix_build(ctx)?;
        let (_, preferred) = Self::shapes(ctx, s, build);
        Ok(preferred.iter().map(|c| (c.groups, c.block_n)).collect())
    }

    /// The first of [`SHAPES`] whose workgroup fits `ctx`'s limits for `s`; one tile group where a
    /// tile's rows hold the whole query (decoding), and at most two groups of 32-key tiles on a CPU
    /// driver (where the portable build's speed does not depend on it: fewer and shorter variants
    /// to compile). A `wanted` shape ([`crate::ContextOptions::coop_forward_shape`], or the
    /// tuned one) comes first where it fits.
    fn fitting(
        ctx: &Context,
        s: &AttentionShape,
        build: MatrixBuild,
        wanted: Option<(u32, u32)>,
    ) -> Option<Self> {
        let (fits, preferred) = Self::shapes(ctx, s, build);
        if let Some((groups, block_n)) = wanted {
            if let Some(&forced) = fits
                .iter()
                .find(|c| (c.groups, c.block_n) == (groups, block_n))
            {
                return Some(forced);
            }
            log::warn!(
                "wgpu-attention: ignoring the tensor-core forward shape {groups}x{block_n}: it \
                 needs 1, 2 or 4 groups and 16, 32 or 64 keys within the device's limits"
            );
        }
        preferred.into_iter().next()
    }

    /// The shapes of [`SHAPES`] whose workgroup fits `ctx`'s limits for `s`, and of those the ones
    /// the static choice considers (in order; see [`CoopForward::fitting`]).
    fn shapes(ctx: &Context, s: &AttentionShape, build: MatrixBuild) -> (Vec<Self>, Vec<Self>) {
        let most = match (s.q_seq <= TILE, ctx.is_cpu()) {
            (true, _) => 1,
            (false, true) => 2,
            (false, false) => u32::MAX,
        };
        // The portable build's tile products unroll into code llvmpipe compiles once per variant:
        // 32-key tiles there, half the code of 64-key ones (a CPU driver is not what the tensor-core
        // family is for).
        let longest = if ctx.is_cpu() { 32 } else { 64 };
        let group = match build {
            MatrixBuild::Cooperative => ctx.subgroup_size().unwrap_or(PORTABLE_GROUP),
            MatrixBuild::Portable => PORTABLE_GROUP,
        };
        let limits = ctx.limits();
        let takes = |c: &Self| {
            // The softmax gives each row group / 16 invocations and each of them a multiple of
            // four keys.
            c.block_n.is_multiple_of(4 * (c.group / TILE as u32).max(1))
                && c.wg() <= limits.max_compute_invocations_per_workgroup
                && c.wg() <= limits.max_compute_workgroup_size_x
                && c.workgroup_bytes(ctx, s) <= u64::from(limits.max_compute_workgroup_storage_size)
        };
        let shape = |(groups, block_n)| Self {
            build,
            group,
            groups,
            block_n,
        };
        let fits: Vec<Self> = SHAPES.into_iter().map(shape).filter(takes).collect();
        let preferred = fits
            .iter()
            .copied()
            .filter(|c| c.groups <= most && c.block_n <= longest)
            .collect();
        (fits, preferred)
    }

    /// Invocations per workgroup.
    pub fn wg(&self) -> u32 {
        self.group * self.groups
    }

    /// Query rows per workgroup (`BM` in the shader).
    pub fn block_m(&self) -> usize {
        TILE * self.groups as usize
    }

    /// Keys per staged tile (`BN` in the shader).
    pub fn block_n(&self) -> usize {
        self.block_n as usize
    }

    /// Workgroup memory: Q, K (then P) and V tiles in MatElem, S in f32 (each row padded as the
    /// shader's QS, VS, PS and SS say), three row values, the softmax's partials (two per
    /// invocation) and the three flags.
    fn workgroup_bytes(&self, ctx: &Context, s: &AttentionShape) -> u64 {
        let (dkp, dvp) = padded(s);
        let (bm, bn) = (self.block_m(), self.block_n());
        let (qs, vs, ps, ss) = (dkp + 8, dvp + 8, bn + 8, bn + 4);
        let elem = mat_elem(ctx).size();
        let mat = (bm * qs + (bn * qs).max(bm * ps) + bn * vs) as u64 * elem;
        let acc = (bm * ss + 3 * bm + 2 * self.wg() as usize + 12) as u64 * 4;
        mat.next_multiple_of(16) + acc
    }

    /// Accumulator elements each invocation owns (`MAT_SLOTS` of the portable build).
    fn slots(&self) -> u32 {
        (TILE * TILE) as u32 / self.group.min(256)
    }

    /// The lengths of the shader's register arrays: keys per tile, Q's and O's tiles, and the
    /// four-element reads of a K and a V tile per invocation.
    fn sizes(&self, s: &AttentionShape) -> Sizes {
        let (dkp, dvp) = padded(s);
        let reads = |dim: usize| (self.block_n() * dim).div_ceil(4 * self.wg() as usize) as u32;
        Sizes {
            block_n: self.block_n,
            q_tiles: (dkp / TILE) as u32,
            o_tiles: (dvp / TILE) as u32,
            k_loads: reads(dkp),
            v_loads: reads(dvp),
        }
    }

    /// Loop iterations one invocation runs per key tile and outside the key loop, counted as if
    /// nothing were unrolled (for llvmpipe's loop budget; the portable build's tile products are
    /// the bulk).
    fn loop_cost(&self, s: &AttentionShape) -> (usize, usize) {
        let (dkp, dvp) = padded(s);
        let (bm, bn) = (self.block_m(), self.block_n());
        let (wg, slots) = (self.wg() as usize, self.slots().max(1) as usize);
        // Per group: S's bn/16 x dkp/16 products and P V's dvp/16 x bn/16, each slots x (16 + 2)
        // iterations, plus the tiles' stores.
        let products = (bn / TILE) * (dkp + dvp) / TILE * slots * (TILE + 2) + (bn / TILE) * slots;
        let rows = bm.div_ceil(wg);
        // A rescale or a scalar P V: O's tiles through workgroup memory, each element over the
        // tile's keys (counted in every tile: the loop budget bounds the worst case).
        let fix = dvp / TILE * (2 * slots + (bm * TILE).div_ceil(wg) * (bn + 2));
        let per_tile =
            bn * (dkp + dvp) / wg + products + rows * (bn / 4) * 12 + rows * 16 + fix + 16;
        let fixed = bm * dkp / wg + dvp / TILE * (slots + (bm * TILE).div_ceil(wg)) + rows * 4 + 64;
        (per_tile, fixed)
    }

    /// Split-KV workgroups per query block: enough to fill a GPU, and as many as the loop budget
    /// needs on llvmpipe.
    pub fn splits(&self, ctx: &Context, s: &AttentionShape, wanted: Option<usize>) -> usize {
        let groups = s.q_seq.div_ceil(self.block_m()) * s.batch * s.heads;
        let kv_tiles = s.kv_seq.div_ceil(self.block_n());
        let mut splits = 1;
        if let Some(tuned) = wanted {
            splits = tuned.min(kv_tiles).max(1);
        } else if !ctx.is_cpu() && groups < gpu::SPLIT_TARGET_WORKGROUPS {
            splits = gpu::SPLIT_TARGET_WORKGROUPS
                .div_ceil(groups)
                .min(kv_tiles / gpu::SPLIT_MIN_TILES)
                .max(1);
        }
        if let Some(budget) = ctx.loop_budget() {
            let (per_tile, fixed) = self.loop_cost(s);
            let max_tiles = ((budget as usize).saturating_sub(fixed) / per_tile).max(1);
            splits = splits.max(kv_tiles.div_ceil(max_tiles));
        }
        splits
    }
}

/// The lengths of the shader's arrays in functions (constants there, not overrides).
#[derive(Clone, Copy, Debug)]
struct Sizes {
    block_n: u32,
    q_tiles: u32,
    o_tiles: u32,
    k_loads: u32,
    v_loads: u32,
}

/// Head dims rounded up to whole tiles.
fn padded(s: &AttentionShape) -> (usize, usize) {
    (
        s.head_dim_qk.div_ceil(TILE) * TILE,
        s.head_dim_v.div_ceil(TILE) * TILE,
    )
}

/// The key of the family's forward: `build` on `input` elements written as `written` and staged as
/// `tiles`, with the portable build's `slots`, arrays sized by `sizes`, and Q, K and V read four
/// elements per access with `vec4_inputs` (`binding::inputs_on_vec4`).
fn key(
    build: MatrixBuild,
    [input, written, tiles]: [DType; 3],
    slots: u32,
    sizes: Sizes,
    vec4_inputs: bool,
) -> FusedVariant {
    let family = FamilyBuild::Coop {
        build,
        tiles,
        slots,
    };
    let mut key = FusedVariant::new(FusedKernel::Forward, family);
    (key.input, key.written, key.vec4_inputs) = (input, written, vec4_inputs);
    key.arrays = vec![
        ("MAX_BN", sizes.block_n),
        ("Q_TILES", sizes.q_tiles),
        ("O_TILES", sizes.o_tiles),
        ("K_LOADS", sizes.k_loads),
        ("V_LOADS", sizes.v_loads),
    ];
    key
}

/// Every build the family compiles, for the naga translation tests (`kernels::shaders::all`).
pub(super) fn shader_variants() -> Vec<FusedVariant> {
    use DType::{F16, F32};
    // Head dim 64's tiles with 64 keys and four groups of 32, the shape a GPU runs; head dim
    // 128's with 32 keys below.
    let sizes = Sizes {
        block_n: 64,
        q_tiles: 4,
        o_tiles: 4,
        k_loads: 8,
        v_loads: 8,
    };
    let wide = Sizes {
        block_n: 32,
        q_tiles: 8,
        o_tiles: 8,
        k_loads: 8,
        v_loads: 8,
    };
    let mut keys = Vec::new();
    for build in [MatrixBuild::Cooperative, MatrixBuild::Portable] {
        for types in [[F32, F32, F16], [F16, F16, F16], [F16, F32, F16]] {
            keys.push(key(build, types, 8, sizes, false));
        }
    }
    keys.push(key(MatrixBuild::Portable, [F32, F32, F32], 8, sizes, false));
    // The builds reading Q, K and V four elements per access; head dim 128's tiles (32 keys).
    keys.push(key(
        MatrixBuild::Cooperative,
        [F16, F16, F16],
        8,
        wide,
        true,
    ));
    keys.push(key(MatrixBuild::Portable, [F32, F32, F16], 8, wide, true));
    // The forward of prefill-shaped decoding steps: a paged cache's f32 pools read through its
    // block table, both builds; an int8 cache's words, paged, on cooperative matrices.
    for build in [MatrixBuild::Cooperative, MatrixBuild::Portable] {
        let mut paged = key(build, [F32, F32, F16], 8, sizes, true);
        paged.page = 16;
        keys.push(paged);
    }
    let mut words = key(MatrixBuild::Cooperative, [F32, F32, F16], 8, sizes, false);
    (words.page, words.kv_words) = (16, Some(KvWords::Int8));
    keys.push(words);
    keys.extend(backward::shader_variants());
    keys
}

/// Records the tensor-core family's forward with `config`, and the split-KV merge when split.
pub(super) fn encode_forward_coop(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    config: CoopForward,
    call: &ForwardCall<'_>,
) -> Result<()> {
    let s = &call.s;
    let (mat, slots, sizes) = (mat_elem(ctx), config.slots(), config.sizes(s));
    let kernel = SplitForwardKernel {
        block_m: config.block_m(),
        splits: config.splits(ctx, s, call.choice.splits),
        key: &|dtype, written, vec4_inputs| {
            let mut key = key(
                config.build,
                [dtype, written, mat],
                slots,
                sizes,
                vec4_inputs,
            );
            key.constants = vec![
                ("SG", config.group),
                ("NSG", config.groups),
                ("BN", config.block_n),
                ("DK", s.head_dim_qk as u32),
                ("DV", s.head_dim_v as u32),
            ];
            key
        },
    };
    encode_split_forward(ctx, encoder, &kernel, call)
}

/// The configuration the tensor-core build needs from the adapter's list.
fn listed(ctx: &Context) -> bool {
    ctx.report().cooperative_matrices.iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    })
}

/// The matrix build `ctx` uses, decided once per context: the tensor-core build where the device
/// offers it, lists the configuration, and its result on a small problem matches the GPU family's.
pub fn matrix_build(ctx: &Context) -> Result<MatrixBuild> {
    const KEY: &str = "attention_forward_coop";
    if let Some(cooperative) = ctx.qualification(KEY) {
        return Ok(match cooperative {
            true => MatrixBuild::Cooperative,
            false => MatrixBuild::Portable,
        });
    }
    let features = ctx.device().features();
    let why_not = if !features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        Some("the device has no cooperative matrices".to_string())
    } else if !features.contains(wgpu::Features::SHADER_F16) {
        Some("the device has no f16".to_string())
    } else if ctx.subgroup_size().is_none() {
        Some("the adapter reports no fixed subgroup size".to_string())
    } else if let Some(size) = ctx.subgroup_size().filter(|&s| !(16..=128).contains(&s)) {
        // A tile group gives each of its 16 rows SG / 16 invocations in the softmax.
        Some(format!(
            "its subgroup size {size} is outside 16 to 128, the tile groups' range"
        ))
    } else if !ctx.owns_device() {
        Some(
            "the device was handed over without its adapter, whose list of configurations wgpu \
             keeps (and an unlisted one computes garbage)"
                .to_string(),
        )
    } else if !listed(ctx) {
        Some(format!(
            "the adapter does not list f16 16x16x16 with f32 accumulation (it lists {:?})",
            ctx.report().cooperative_matrices
        ))
    } else {
        mismatch(qualify_matrix_build(ctx, MatrixBuild::Cooperative))
    };
    let cooperative = record_qualification(
        ctx,
        KEY,
        why_not,
        "the tensor-core attention runs its portable build",
        "the tensor-core attention runs on cooperative matrices",
    );
    Ok(match cooperative {
        true => MatrixBuild::Cooperative,
        false => MatrixBuild::Portable,
    })
}

/// The qualification [`matrix_build`] runs before it uses the tensor-core build on a device: the
/// tensor-core forward with `build` on a small causal problem (80 query rows: two or more blocks,
/// the last partial; 104 keys: four tiles, the last partial; head dim 64) against the GPU family's
/// forward on the same device. `None` if O and lse agree within
/// f16 accuracy, else what differed. (The tests run it with the portable build.)
pub fn qualify_matrix_build(ctx: &Context, build: MatrixBuild) -> Result<Option<String>> {
    let (s, [q, k, v], opts) = qualification_problem(ctx)?;
    let scale = check_options(ctx, &s, &opts)?;
    let Some(config) = CoopForward::fitting(ctx, &s, build, ctx.coop_forward_shape()) else {
        return Ok(Some(
            "its tiles at head dim 64 do not fit the workgroup storage".to_string(),
        ));
    };
    let run = |coop: bool| -> Result<(Vec<f32>, Vec<f32>)> {
        let (q, k, v) = (&q, &k, &v);
        let output = AttentionOutput::recorded(ctx, &s, |encoder, out, lse| {
            let call = ForwardCall {
                s,
                scale,
                q,
                k,
                v,
                out,
                lse,
                opts: &opts,
                choice: ctx.kernel_settings(),
                cache: CacheRead::VIEWS,
            };
            match coop {
                true => encode_forward_coop(ctx, encoder, config, &call),
                false => encode_forward_gpu(ctx, encoder, &call),
            }
        })?;
        Ok((output.out.to_vec(ctx)?, output.lse.to_vec(ctx)?))
    };
    let (coop, gpu) = (run(true)?, run(false)?);
    let (error, worst) = (element_error, worst_error);
    // Inputs rounded to f16 (relative 2^-11) against f32: O within 1e-2, lse within 2e-2.
    const O_TOLERANCE: f32 = 1e-2;
    let (o_err, lse_err) = (worst(&coop.0, &gpu.0), worst(&coop.1, &gpu.1));
    Ok((o_err > O_TOLERANCE || lse_err > 2e-2).then(|| {
        // What a reader of a report needs to tell a layout mistake from a precision one.
        let off: Vec<usize> = (0..coop.0.len())
            .filter(|&i| error(coop.0[i], gpu.0[i]) > O_TOLERANCE)
            .collect();
        let first = off.first().map_or(String::new(), |&i| {
            format!(
                "; first at element {i} of [80, 2, 64]: {} against {}",
                coop.0[i], gpu.0[i]
            )
        });
        let zeros = coop.0.iter().filter(|x| **x == 0.0).count();
        format!(
            "on a test problem its O differs by {o_err:e} and its lse by {lse_err:e} from the GPU \
             family's ({} of {} O elements off, {zeros} zero{first})",
            off.len(),
            coop.0.len()
        )
    }))
}

/// The problem both qualifications run: one batch entry of 80 query rows (two or more blocks, the
/// last partial) and 104 keys (several tiles, the last partial), two heads, head dim 64, causal.
fn qualification_problem(
    ctx: &Context,
) -> Result<(AttentionShape, [HeadsView; 3], AttentionOptions<'static>)> {
    let s = AttentionShape {
        batch: 1,
        q_seq: 80,
        kv_seq: 104,
        heads: 2,
        kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let tensor = |seq: usize, seed: u32| {
        GpuTensor::from_slice(
            ctx,
            &qualification_values(seq * 2 * 64, seed),
            &[1, seq, 2, 64],
        )?
        .heads()
    };
    let inputs = [tensor(80, 1)?, tensor(104, 2)?, tensor(104, 3)?];
    Ok((s, inputs, AttentionOptions::new().causal(true)))
}

/// One element's error in a qualification: 0 where equal (infinities included), infinite where
/// one is not finite.
fn element_error(x: f32, y: f32) -> f32 {
    match x == y {
        true => 0.0,
        false if x.is_finite() && y.is_finite() => (x - y).abs(),
        false => f32::INFINITY,
    }
}

/// The largest [`element_error`] of two results.
fn worst_error(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| element_error(*x, *y))
        .fold(0.0f32, f32::max)
}
