//! The tensor-core family's backward (`shaders/attention/coop/backward_dkdv.wgsl` and
//! `backward_dq.wgsl`): the GPU family's two gradient kernels with their seven products (S and dP
//! in each, dV += P^T dO and dK += dS^T Q, dQ += dS K) as 16x16 tile multiply-adds through the
//! same matrix interface as the family's forward, f16 operands and f32 accumulation. Deterministic:
//! every sum has one owner and a fixed order (no atomics). The cooperative build runs only where
//! the forward's build qualified and a small backward on the device matches the GPU family's; the
//! GPU family's backward runs where it does not, where no tile shape fits the workgroup storage, and
//! for learned relative buckets (whose per-row table gradient only the GPU family's dQ sums).

use super::{
    mat_elem, matrix_build, padded, qualification_problem, worst_error, PORTABLE_GROUP, TILE,
};
use crate::device::{Context, KernelChoice, KernelFamily};
use crate::error::Result;
use crate::kernels::attention::backward::{
    attention_backward_workspace, encode_backward_core, encode_gradient, Gradient, GradientKernel,
};
use crate::kernels::attention::call::{AttentionOutput, CacheRead, ForwardCall};
use crate::kernels::attention::call::{BackwardCall, BackwardViews};
use crate::kernels::attention::gpu::{self, encode_forward_gpu};
use crate::kernels::attention::shape::check_options;
use crate::kernels::attention::tune::qualification_values;
use crate::kernels::attention::variant::{FamilyBuild, FusedKernel, FusedVariant, MatrixBuild};
use crate::kernels::matrix::{mismatch, record_qualification};
use crate::spec::AttentionShape;
use crate::tensor::DType;
use crate::tensor::{GpuTensor, HeadsView};

/// (tile groups, query rows per tile) of the dK/dV kernel, and (tile groups, keys per tile) of dQ,
/// tried in order, the first that fits the workgroup storage taken: more groups share each staged
/// tile, longer tiles cut the barriers per row or key. At head dim 64 in f16, 48 KiB fits two
/// groups with 32-row (dK/dV) or 32-key (dQ) tiles; 128 takes 16 (and the reads ahead allow no
/// more).
const SHAPES: [(u32, u32); 8] = [
    (4, 64),
    (4, 32),
    (2, 64),
    (2, 32),
    (4, 16),
    (2, 16),
    (1, 32),
    (1, 16),
];

/// The most four-element reads per invocation of the tile a kernel reads one tile ahead (`LOADS`):
/// sixteen (dQ with 32-key tiles at head dim 128 over 64 invocations) spilled 67 VGPRs on RDNA3,
/// eight spill nothing (benchmarks/coop-backward-2026-11-28).
const MAX_READS_AHEAD: usize = 8;

/// The two kernels' shapes on a context: `group` invocations per tile group (a subgroup in the
/// tensor-core build), each group owning 16 keys (dK/dV) or 16 query rows (dQ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::kernels::attention) struct CoopBackward {
    pub build: MatrixBuild,
    pub group: u32,
    /// dK/dV: tile groups and query rows per tile (`NSG`, `BM`).
    pub dkdv: (u32, u32),
    /// dQ: tile groups and keys per tile (`NSG`, `BN`).
    pub dq: (u32, u32),
}

/// Which of the two kernels a shape is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    DkDv,
    Dq,
}

impl CoopBackward {
    /// The build and shapes `ctx` runs the family's backward with, or `None` where the GPU
    /// family's backward runs instead: learned relative buckets (`relative_grad`), a cooperative
    /// build whose backward failed its qualification on the device, or no shape that fits.
    pub fn choose(ctx: &Context, s: &AttentionShape, relative_grad: bool) -> Result<Option<Self>> {
        if relative_grad {
            return Ok(None);
        }
        let build = matrix_build(ctx)?;
        if build == MatrixBuild::Cooperative && !backward_qualified(ctx)? {
            return Ok(None);
        }
        Ok(Self::fitting(ctx, s, build))
    }

    /// The first of [`SHAPES`] per kernel that fits `ctx`'s limits for `s`; at most two groups
    /// with 32-row or 32-key tiles on a CPU driver (as the forward: fewer and shorter variants to
    /// compile where the portable build's speed does not depend on them).
    fn fitting(ctx: &Context, s: &AttentionShape, build: MatrixBuild) -> Option<Self> {
        let (most, longest) = match ctx.is_cpu() {
            true => (2, 32),
            false => (u32::MAX, 64),
        };
        let group = match build {
            MatrixBuild::Cooperative => ctx.subgroup_size().unwrap_or(PORTABLE_GROUP),
            MatrixBuild::Portable => PORTABLE_GROUP,
        };
        let limits = ctx.limits();
        let elem = mat_elem(ctx).size();
        let pick = |kernel: Kernel| {
            SHAPES.into_iter().find(|&(groups, tile)| {
                let wg = group * groups;
                groups <= most
                    && tile <= longest
                    && reads_ahead(s, wg, tile) <= MAX_READS_AHEAD
                    && wg <= limits.max_compute_invocations_per_workgroup
                    && wg <= limits.max_compute_workgroup_size_x
                    && workgroup_bytes(kernel, s, elem, (groups, tile))
                        <= u64::from(limits.max_compute_workgroup_storage_size)
            })
        };
        Some(Self {
            build,
            group,
            dkdv: pick(Kernel::DkDv)?,
            dq: pick(Kernel::Dq)?,
        })
    }

    /// `(tile groups, rows or keys per tile)` of `kernel`.
    fn shape_of(&self, kernel: Kernel) -> (u32, u32) {
        match kernel {
            Kernel::DkDv => self.dkdv,
            Kernel::Dq => self.dq,
        }
    }

    /// The two kernels' shapes as [`crate::BackwardPlan`] gives them: dK/dV (invocations, keys,
    /// query rows per tile) and dQ (invocations, query rows, keys per tile).
    pub fn shapes(&self) -> ((u32, u32, u32), (u32, u32, u32)) {
        let shape = |(groups, tile): (u32, u32)| (self.group * groups, TILE as u32 * groups, tile);
        (shape(self.dkdv), shape(self.dq))
    }

    /// Accumulator elements each invocation owns (`MAT_SLOTS` of the portable build).
    fn slots(&self) -> u32 {
        (TILE * TILE) as u32 / self.group.min(256)
    }

    /// Loop iterations one invocation runs per step of the kernel's long loop (a query row of
    /// dK/dV, a key of dQ) and outside it, counted as if nothing were unrolled (for llvmpipe's
    /// loop budget; the portable build's tile products are the bulk).
    fn loop_cost(&self, kernel: Kernel, s: &AttentionShape) -> (usize, usize) {
        let (dkp, dvp) = padded(s);
        let (groups, tile) = self.shape_of(kernel);
        let (wg, slots) = ((self.group * groups) as usize, self.slots() as usize);
        // The rows (or keys) each group owns, and those of a step of the loop.
        let (own, step) = (TILE * groups as usize, tile as usize);
        let tiles = (dkp + dvp) / TILE;
        // Staging four elements per iteration (four stores each), the rows' values, the two
        // products into S and dP and the gradient products (each tile product slots x (16 + 2)),
        // the elementwise step, and the scalar products of a tile with a non-finite operand.
        let products = 2 * (step / TILE) * tiles * slots * (TILE + 2) + 2 * (step / TILE) * slots;
        let elementwise = (own * step / 4).div_ceil(wg) * 16;
        let scalar = tiles * (3 * slots + (own * TILE).div_ceil(wg) * (step + 2));
        let per_tile =
            step * (dkp + dvp) / wg * 2 + step.div_ceil(wg) + products + elementwise + scalar + 16;
        let fixed = own * (dkp + dvp) / wg * 2
            + own.div_ceil(wg)
            + tiles * (slots + (own * TILE).div_ceil(wg))
            + 64;
        (per_tile.div_ceil(step) + 1, fixed)
    }

    /// The key of one of the two kernels: `build` on `input` elements, written as `input`, staged
    /// as `tiles`, with Q, K, V and dO read four elements per access with `vec4_inputs`.
    fn key(
        &self,
        kernel: Kernel,
        s: &AttentionShape,
        [input, tiles]: [DType; 2],
        vec4_inputs: bool,
    ) -> FusedVariant {
        let (dkp, dvp) = padded(s);
        let (groups, tile) = self.shape_of(kernel);
        let arrays = Arrays {
            k_tiles: (dkp / TILE) as u32,
            v_tiles: (dvp / TILE) as u32,
            loads: reads_ahead(s, self.group * groups, tile) as u32,
        };
        let mut key = backward_key(
            kernel,
            self.build,
            [input, tiles],
            self.slots(),
            arrays,
            vec4_inputs,
        );
        key.constants = vec![
            ("SG", self.group),
            ("NSG", groups),
            (if kernel == Kernel::DkDv { "BM" } else { "BN" }, tile),
            ("DK", s.head_dim_qk as u32),
            ("DV", s.head_dim_v as u32),
        ];
        key
    }
}

/// The four-element reads per invocation of the tile a kernel reads one tile ahead (`LOADS`):
/// `tile` query rows (dK/dV) or keys (dQ) of the wider padded head dim over `wg` invocations.
fn reads_ahead(s: &AttentionShape, wg: u32, tile: u32) -> usize {
    let (dkp, dvp) = padded(s);
    (tile as usize * dkp.max(dvp)).div_ceil(4 * wg as usize)
}

/// The lengths of the shaders' arrays in functions (constants there, not overrides): the tiles
/// of K and dK, and of V and dV (dQ: of Q and dQ, and of dO), and the reads of the tile read
/// ahead.
#[derive(Clone, Copy, Debug)]
struct Arrays {
    k_tiles: u32,
    v_tiles: u32,
    loads: u32,
}

/// Workgroup memory of `kernel` with `(groups, tile)`: the MatElem tiles of `elem` bytes (K, V,
/// Q, dO and P^T / dS^T or dS, rows padded as the shaders' KS, VS and PS say), S and dP in f32
/// (rows padded as SS), four values per query row and the two flags.
fn workgroup_bytes(
    kernel: Kernel,
    s: &AttentionShape,
    elem: u64,
    (groups, tile): (u32, u32),
) -> u64 {
    let (dkp, dvp) = padded(s);
    let (ks, vs) = (dkp + 8, dvp + 8);
    let (own, tile) = (TILE * groups as usize, tile as usize);
    let (keys, rows, products) = match kernel {
        // P^T and dS^T [keys x rows].
        Kernel::DkDv => (own, tile, 2 * own * (tile + 8)),
        // dS [rows x keys].
        Kernel::Dq => (tile, own, own * (tile + 8)),
    };
    let mat = ((keys + rows) * (ks + vs) + products) as u64 * elem;
    // S and dP: [keys x rows] with rows padded (dK/dV), [rows x keys] with keys padded (dQ).
    let scores = 2 * own * (tile + 4);
    let acc = (scores + 4 * rows + 8) as u64 * 4;
    mat.next_multiple_of(16) + acc
}

/// A backward key of the family with its array sizes.
fn backward_key(
    kernel: Kernel,
    build: MatrixBuild,
    [input, tiles]: [DType; 2],
    slots: u32,
    arrays: Arrays,
    vec4_inputs: bool,
) -> FusedVariant {
    let family = FamilyBuild::Coop {
        build,
        tiles,
        slots,
    };
    let fused = match kernel {
        Kernel::DkDv => FusedKernel::BackwardDkDv,
        Kernel::Dq => FusedKernel::BackwardDq,
    };
    let mut key = FusedVariant::new(fused, family);
    (key.input, key.written, key.vec4_inputs) = (input, input, vec4_inputs);
    // As the GPU family's backward: on RADV the fixed flags take 12-14% off the estimated cycles
    // (23-35% of the branches), where the GPU family's 5-17% became 2x on an H200.
    key.fixed_flags_build = true;
    key.arrays = vec![
        ("K_TILES", arrays.k_tiles),
        ("V_TILES", arrays.v_tiles),
        ("LOADS", arrays.loads),
    ];
    key
}

/// The backward builds the family compiles, for the naga translation tests: head dim 64 and 128,
/// both matrix builds, f32 and f16 inputs, element and vec4 reads.
pub(super) fn shader_variants() -> Vec<FusedVariant> {
    use DType::{F16, F32};
    let d64 = Arrays {
        k_tiles: 4,
        v_tiles: 4,
        loads: 8,
    };
    let d128 = Arrays {
        k_tiles: 8,
        v_tiles: 8,
        ..d64
    };
    // LOADS: two groups of 32 with 32-row or 32-key tiles at head dim 64 (and 16-row ones at 128).
    let mut keys = Vec::new();
    for kernel in [Kernel::DkDv, Kernel::Dq] {
        for build in [MatrixBuild::Cooperative, MatrixBuild::Portable] {
            for types in [[F32, F16], [F16, F16]] {
                keys.push(backward_key(kernel, build, types, 8, d64, false));
            }
            keys.push(backward_key(kernel, build, [F16, F16], 8, d128, true));
        }
        keys.push(backward_key(
            kernel,
            MatrixBuild::Portable,
            [F32, F32],
            8,
            d64,
            true,
        ));
    }
    // dK/dV adding dQ with f32 atomics (ContextOptions::atomic_gradients), both builds.
    for build in [MatrixBuild::Cooperative, MatrixBuild::Portable] {
        let mut key = backward_key(Kernel::DkDv, build, [F16, F16], 8, d64, false);
        key.dq_sums = true;
        keys.push(key);
    }
    keys
}

/// Records the family's dK/dV and dQ kernels with `config` (after the shared preprocess wrote
/// `(lse, D)` into the workspace), each split into accumulating dispatches under a loop budget.
pub(in crate::kernels::attention) fn encode_backward_coop(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    config: CoopBackward,
    call: &BackwardCall<'_>,
) -> Result<()> {
    let s = &call.s;
    let types = [call.dtype, mat_elem(ctx)];
    // The family takes no learned relative table: dQ with atomics wherever the context allows.
    let dq_sums = gpu::DqSums::new(ctx, call, 0)?;
    let dkdv = Gradient::DkDv {
        dq_sums: dq_sums.as_ref().map(gpu::DqSums::binding),
    };
    for (kernel, which) in [
        (Kernel::DkDv, dkdv),
        (Kernel::Dq, Gradient::Dq { rel: None }),
    ] {
        if kernel == Kernel::Dq && dq_sums.is_some() {
            break;
        }
        let (groups, tile) = config.shape_of(kernel);
        encode_gradient(
            ctx,
            encoder,
            call,
            which,
            GradientKernel {
                key: &|vec4_inputs| {
                    let mut key = config.key(kernel, s, types, vec4_inputs);
                    key.dq_sums = kernel == Kernel::DkDv && dq_sums.is_some();
                    key
                },
                block: TILE * groups as usize,
                cost: config.loop_cost(kernel, s),
                align: tile as usize,
            },
        )?;
    }
    if let Some(sums) = &dq_sums {
        sums.encode_store(ctx, encoder, call);
    }
    Ok(())
}

/// Whether the family's backward may use the cooperative build on `ctx` (whose forward build
/// qualified): decided once per context by [`qualify_backward_build`], the reason kept in
/// [`Context::qualifications`] and logged.
fn backward_qualified(ctx: &Context) -> Result<bool> {
    const KEY: &str = "attention_backward_coop";
    if let Some(passed) = ctx.qualification(KEY) {
        return Ok(passed);
    }
    let why_not = mismatch(qualify_backward_build(ctx, MatrixBuild::Cooperative));
    Ok(record_qualification(
        ctx,
        KEY,
        why_not,
        "the tensor-core attention backward runs the GPU family's kernels",
        "the tensor-core attention backward runs on cooperative matrices",
    ))
}

/// The qualification the tensor-core backward's choice runs before it uses the tensor-core build
/// on a device: the family's two gradient kernels with `build` on the forward qualification's
/// problem (80 query rows, 104 keys, two heads, head dim 64, causal) against the GPU family's
/// backward on the same device. `None` if dQ, dK and dV agree within f16 accuracy, else what
/// differed. (The tests run it with the portable build.)
pub fn qualify_backward_build(ctx: &Context, build: MatrixBuild) -> Result<Option<String>> {
    let (s, [q, k, v], opts) = qualification_problem(ctx)?;
    let Some(config) = CoopBackward::fitting(ctx, &s, build) else {
        return Ok(Some(
            "its tiles at head dim 64 do not fit the workgroup storage".to_string(),
        ));
    };
    let d_out = GpuTensor::from_slice(
        ctx,
        &qualification_values(s.q_seq * 2 * 64, 4),
        &[1, s.q_seq, 2, 64],
    )?
    .heads()?;
    let scale = check_options(ctx, &s, &opts)?;
    let gpu_choice = KernelChoice {
        family: Some(KernelFamily::Gpu),
        ..ctx.kernel_settings()
    };
    let forward = AttentionOutput::recorded(ctx, &s, |encoder, out, lse| {
        let call = ForwardCall {
            s,
            scale,
            q: &q,
            k: &k,
            v: &v,
            out,
            lse,
            opts: &opts,
            choice: gpu_choice,
            cache: CacheRead::VIEWS,
        };
        encode_forward_gpu(ctx, encoder, &call)
    })?;
    let grads = || -> Result<[GpuTensor; 3]> {
        Ok([
            GpuTensor::uninit(ctx, "dq", &[1, s.q_seq, 2, 64])?,
            GpuTensor::uninit(ctx, "dk", &[1, s.kv_seq, 2, 64])?,
            GpuTensor::uninit(ctx, "dv", &[1, s.kv_seq, 2, 64])?,
        ])
    };
    let (gpu, coop) = (grads()?, grads()?);
    let heads = |t: &[GpuTensor; 3]| -> Result<[HeadsView; 3]> {
        Ok([t[0].heads()?, t[1].heads()?, t[2].heads()?])
    };
    let (gpu_views, coop_views) = (heads(&gpu)?, heads(&coop)?);
    let out = forward.out.heads()?;
    let workspace = attention_backward_workspace(ctx, &s)?;
    let gpu_grads = BackwardViews {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        lse: &forward.lse,
        d_out: &d_out,
        dq: &gpu_views[0],
        dk: &gpu_views[1],
        dv: &gpu_views[2],
        workspace: &workspace,
    };
    let coop_grads = BackwardViews {
        dq: &coop_views[0],
        dk: &coop_views[1],
        dv: &coop_views[2],
        ..gpu_grads
    };
    let mut encoder = ctx.device().create_command_encoder(&Default::default());
    // The GPU family's backward, whose preprocess leaves (lse, D) in the workspace for the
    // family's kernels recorded after it.
    encode_backward_core(ctx, &mut encoder, gpu_grads, &opts, Some(gpu_choice))?;
    let call = BackwardCall {
        s,
        scale,
        views: coop_grads,
        opts: &opts,
        group_rows: s.q_seq,
        dtype: DType::F32,
        choice: gpu_choice,
    };
    encode_backward_coop(ctx, &mut encoder, config, &call)?;
    ctx.submit(encoder)?;
    let mut report = Vec::new();
    for (name, (a, b)) in ["dq", "dk", "dv"].into_iter().zip(coop.iter().zip(&gpu)) {
        let (a, b) = (a.to_vec(ctx)?, b.to_vec(ctx)?);
        let largest = b.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        let err = worst_error(&a, &b);
        // Operands rounded to f16 (relative 2^-11) against f32: within 1e-2 of the largest
        // gradient (at least 1).
        if err > 1e-2 * largest {
            report.push(format!("{name} by {err:e} (largest {largest:e})"));
        }
    }
    Ok((!report.is_empty()).then(|| {
        format!(
            "on a test problem its gradients differ from the GPU family's: {}",
            report.join(", ")
        )
    }))
}
