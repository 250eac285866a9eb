//! The settings that choose kernels and their shapes on a context: kernel family, GEMM tiles,
//! workgroup width, subgroups, trusted shaders and the llvmpipe loop budget.

use super::Context;
use crate::error::{Error, Result};

/// A tiled-kernel shape override `(workgroup invocations, first block, second block)`: the GPU
/// family's forward (`WG x BM x BN`), dK/dV (`WG x BN x BM`) and dQ (`WG x BM x BN`) kernels.
pub type TiledShape = (u32, u32, u32);

/// Loop iterations one invocation may run on llvmpipe (lavapipe and GL): Mesa's gallivm stops every
/// loop of a shader once 65535 iterations have run in total in one invocation, silently, so longer
/// kernels return wrong results. Kept below that, with room for the kernels' set-up loops.
pub const LLVMPIPE_LOOP_BUDGET: u32 = 60_000;

/// Workgroup widths the fused attention kernels are written for.
pub const ATTENTION_WORKGROUPS: [u32; 4] = [16, 32, 64, 128];

/// Which family of kernels a context runs: the fused attention's, and the shape of the row
/// reductions (LayerNorm and RMSNorm: a row per invocation or per workgroup) and of the few-row
/// GEMM of a decoding step (an element per invocation, or k split over lanes). All compute the
/// same results (SPEC.md) and are tested against the same reference; they differ in shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum KernelFamily {
    /// Shaped for CPU drivers (lavapipe, llvmpipe): each invocation keeps four rows in vec4 lanes
    /// with head-dim-sized private arrays, wide workgroups, long loops split under the driver's
    /// cap.
    #[serde(rename = "cpu")]
    CpuDriver,
    /// Shaped for GPUs: small query blocks, Q/K/V tiles in workgroup memory, register micro-tiles,
    /// split-KV when the grid would leave the GPU idle.
    Gpu,
    /// Tensor cores: the forward's two products as 16x16 f16 tile multiply-adds with f32
    /// accumulation (wgpu's cooperative matrices where the device offers and passes them, else the
    /// same tiles in ordinary arithmetic; `kernels::attention::matrix_build` says which). Inputs
    /// are rounded to f16, so results have f16 accuracy. The backward runs the GPU family's
    /// kernels.
    Coop,
}

impl KernelFamily {
    /// Parses `cpu` / `cpu-driver` or `gpu` (as `WGPU_ATTENTION_KERNELS` and the bench's
    /// `--kernels`).
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_lowercase().as_str() {
            "cpu" | "cpu-driver" => Ok(Self::CpuDriver),
            "gpu" => Ok(Self::Gpu),
            "coop" => Ok(Self::Coop),
            other => Err(Error::shape(
                "kernel family",
                format!("'{other}' is not one: use cpu, gpu or coop"),
            )),
        }
    }

    /// The family's name, as `parse` reads it.
    pub fn name(self) -> &'static str {
        match self {
            Self::CpuDriver => "cpu",
            Self::Gpu => "gpu",
            Self::Coop => "coop",
        }
    }
}

/// What one fused attention call runs where the context leaves it open: the kernel family, the
/// GPU family's tile shapes (forward, dK/dV, dQ: as [`ContextOptions::tiled_shapes`]), the
/// forward's split-KV count, the CPU-driver family's workgroup width and the tensor-core
/// forward's shape. `None` takes the context's setting, and where that is unset, the
/// measured default for the problem. The autotuner's candidates and winners are these
/// ([`Context::tuning_report`]); a context's explicit settings are never tuned over.
///
/// [`ContextOptions::tiled_shapes`]: super::ContextOptions::tiled_shapes
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[non_exhaustive]
pub struct KernelChoice {
    /// The kernel family.
    pub family: Option<KernelFamily>,
    /// The GPU family's forward, dK/dV and dQ shapes `(workgroup, first block, second block)`.
    pub tiles: [Option<TiledShape>; 3],
    /// Split-KV workgroups per query block of the GPU family's forward.
    pub splits: Option<usize>,
    /// Invocations per workgroup of the CPU-driver family's kernels (one of
    /// [`ATTENTION_WORKGROUPS`]).
    #[serde(default)]
    pub workgroup: Option<u32>,
    /// The tensor-core forward's `(tile groups, keys per tile)` (as
    /// [`ContextOptions::coop_forward_shape`](super::ContextOptions::coop_forward_shape)).
    #[serde(default)]
    pub coop_forward: Option<(u32, u32)>,
    /// Whether the GPU and tensor-core families' backward adds dQ with f32 atomics from the dK/dV
    /// kernel, where the context allows it
    /// ([`ContextOptions::atomic_gradients`](super::ContextOptions::atomic_gradients)):
    /// `Some(false)` runs the dQ kernel, `None` takes the atomics where allowed.
    #[serde(default)]
    pub dq_atomic: Option<bool>,
    /// Whether additive attention runs its unfused path (the scores materialised `[B, H, Lq, Lk]`
    /// in the context's scratch) instead of its fused kernels: the tuner's candidate for where the
    /// fused kernels lose. `None` and `Some(false)` run the fused kernels.
    #[serde(default)]
    pub unfused: Option<bool>,
}

impl KernelChoice {
    /// This choice with the unset fields taken from `fallback`.
    pub fn or(self, fallback: KernelChoice) -> KernelChoice {
        let tile = |i: usize| self.tiles[i].or(fallback.tiles[i]);
        KernelChoice {
            family: self.family.or(fallback.family),
            tiles: [tile(0), tile(1), tile(2)],
            splits: self.splits.or(fallback.splits),
            workgroup: self.workgroup.or(fallback.workgroup),
            coop_forward: self.coop_forward.or(fallback.coop_forward),
            dq_atomic: self.dq_atomic.or(fallback.dq_atomic),
            unfused: self.unfused.or(fallback.unfused),
        }
    }

    /// The family this choice runs on `ctx`.
    pub fn family_on(&self, ctx: &Context) -> KernelFamily {
        self.family.unwrap_or_else(|| ctx.kernel_family())
    }
}

impl std::fmt::Display for KernelChoice {
    /// `gpu forward 128x64x32 split 2`: the fields set, `default` where none is.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(family) = self.family {
            parts.push(family.name().to_string());
        }
        for (name, tile) in ["forward", "dkdv", "dq"].iter().zip(self.tiles) {
            if let Some((wg, a, b)) = tile {
                parts.push(format!("{name} {wg}x{a}x{b}"));
            }
        }
        if let Some(splits) = self.splits {
            parts.push(format!("split {splits}"));
        }
        if let Some(wg) = self.workgroup {
            parts.push(format!("wg {wg}"));
        }
        if let Some((groups, keys)) = self.coop_forward {
            parts.push(format!("coop forward {groups}x{keys}"));
        }
        if let Some(atomic) = self.dq_atomic {
            parts.push(format!("dq {}", if atomic { "atomic" } else { "kernel" }));
        }
        if let Some(unfused) = self.unfused {
            parts.push(if unfused { "unfused" } else { "fused" }.to_string());
        }
        match parts.is_empty() {
            true => write!(f, "default"),
            false => write!(f, "{}", parts.join(" ")),
        }
    }
}

/// Output tiles of the strided GEMM (`shaders/matmul_*.wgsl`) for products of more than a few rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GemmTiles {
    /// 64 x 64 per 256-invocation workgroup, 4 x 4 per invocation (`matmul_strided.wgsl`): the
    /// default on GPUs, the kernel measured on an H100 (benchmarks/HISTORY.md).
    Square64,
    /// 128 x 64, 8 x 4 per invocation with vec4 workgroup-memory reads (`matmul_wide.wgsl`): twice
    /// the multiply-adds per staged value, half the workgroups. The default on CPU drivers, where
    /// it measured 1.9-2.1x faster on the layer shapes (`gemm-bench`); unmeasured on a GPU, where
    /// the smaller grid may not fill the machine.
    Wide128x64,
    /// The tensor cores (`matmul_coop.wgsl`: subgroups of 16x16 f16 tiles with f32 accumulation,
    /// through the attention's matrix interface, on cooperative matrices where the attention's
    /// build and the GEMM's own check (`kernels::matmul::qualify_gemm_build`) qualified on the
    /// device; its portable build elsewhere), [`GemmTiles::Coop128`]'s tiles where a product has enough of them to fill a GPU
    /// (256 workgroups), else [`GemmTiles::Coop64`]'s. A and B are rounded to f16 in workgroup
    /// memory, so f32 products get f16 accuracy (`reference::compare::TENSOR_CORE_*`); f16 ones
    /// lose nothing. Never a default: asked for by name. Products of a few rows keep the SKINNY
    /// path, and a device whose limits leave no room for the workgroup (four subgroups, and 14.5
    /// KiB of workgroup storage with f16 tiles, 24 KiB without `SHADER_F16`) runs the square
    /// 64 x 64 kernel.
    Coop,
    /// [`GemmTiles::Coop`] with 64 x 64 tiles always: four subgroups of 2 x 2 accumulator tiles.
    Coop64,
    /// [`GemmTiles::Coop`] with 128 x 128 tiles wherever they fit (eight subgroups of 4 x 2
    /// accumulator tiles, 28 KiB of workgroup storage in f16), else 64 x 64: four times the
    /// multiply-adds per staged value, a quarter of the workgroups.
    Coop128,
}

impl GemmTiles {
    /// Parses `64x64`, `128x64`, `coop`, `coop64` or `coop128` (as `WGPU_ATTENTION_GEMM_TILES`
    /// and the benches' options).
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim() {
            "64x64" => Ok(Self::Square64),
            "128x64" => Ok(Self::Wide128x64),
            "coop" => Ok(Self::Coop),
            "coop64" => Ok(Self::Coop64),
            "coop128" => Ok(Self::Coop128),
            other => Err(Error::shape(
                "gemm tiles",
                format!("'{other}' is not one: use 64x64, 128x64, coop, coop64 or coop128"),
            )),
        }
    }

    /// The tiles' name, as `parse` reads it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Square64 => "64x64",
            Self::Wide128x64 => "128x64",
            Self::Coop => "coop",
            Self::Coop64 => "coop64",
            Self::Coop128 => "coop128",
        }
    }

    /// Whether these tiles run on the tensor cores (f16 operand tiles: their products have the
    /// tensor-core tolerances).
    pub fn is_coop(self) -> bool {
        matches!(self, Self::Coop | Self::Coop64 | Self::Coop128)
    }
}

impl Context {
    /// The most loop iterations one kernel invocation may run, if the driver caps them; kernels
    /// whose loops would run longer are split into several dispatches that merge their results.
    /// Detected for llvmpipe ([`LLVMPIPE_LOOP_BUDGET`]); `None` elsewhere.
    pub fn loop_budget(&self) -> Option<u32> {
        self.loop_budget
    }

    /// Overrides the detected loop budget: for a wrapped device whose adapter was not given, or to
    /// test the split path with a small budget.
    pub fn set_loop_budget(&mut self, budget: Option<u32>) {
        self.loop_budget = budget;
    }

    /// The workgroup width of the fused attention kernels where it is overridden; `None` picks the
    /// measured default per pass (see `kernels::attention`). Set from
    /// [`ContextOptions::attention_workgroup`](super::ContextOptions::attention_workgroup) when the
    /// context is created.
    pub fn attention_workgroup(&self) -> Option<u32> {
        self.attention_workgroup
    }

    /// Overrides the workgroup width of the fused attention kernels (16, 32, 64 or 128
    /// invocations), for tuning on an adapter whose best width is not the default; `None` restores
    /// the defaults.
    pub fn set_attention_workgroup(&mut self, width: Option<u32>) -> Result<()> {
        if let Some(width) = width {
            if !ATTENTION_WORKGROUPS.contains(&width) {
                return Err(Error::shape(
                    "attention workgroup width",
                    format!(
                        "{width} is not one the kernels are written for: use 16, 32, 64 or 128"
                    ),
                ));
            }
            let limit = self.limits().max_compute_invocations_per_workgroup;
            if width > limit {
                return Err(Error::Unsupported {
                    arg: "attention workgroup width",
                    value: width.into(),
                    limit: limit.into(),
                    hint: " (the adapter's invocations per workgroup); use 16, 32, 64 or 128 within it",
                });
            }
        }
        self.attention_workgroup = width;
        Ok(())
    }

    /// The kernel family this context runs ([`KernelFamily`]): the one set with
    /// [`Context::set_kernel_family`] (or
    /// [`ContextOptions::kernel_family`](super::ContextOptions::kernel_family)), else
    /// [`KernelFamily::CpuDriver`] on CPU drivers and [`KernelFamily::Gpu`] elsewhere.
    pub fn kernel_family(&self) -> KernelFamily {
        self.kernel_family.unwrap_or(if self.is_cpu() {
            KernelFamily::CpuDriver
        } else {
            KernelFamily::Gpu
        })
    }

    /// Forces a kernel family (to test the GPU kernels on a CPU driver, or to compare both on one
    /// adapter); `None` restores the choice by adapter class.
    pub fn set_kernel_family(&mut self, family: Option<KernelFamily>) {
        self.kernel_family = family;
    }

    /// The GEMM's output tiles for products of at least 128 rows: the ones set with
    /// [`Context::set_gemm_tiles`] (or
    /// [`ContextOptions::gemm_tiles`](super::ContextOptions::gemm_tiles)), else
    /// [`GemmTiles::Wide128x64`] on CPU drivers and [`GemmTiles::Square64`] elsewhere (mixed
    /// precision's products excepted: [`GemmTiles::Coop`] where the tensor-core GEMM runs on
    /// cooperative matrices).
    pub fn gemm_tiles(&self) -> GemmTiles {
        self.gemm_tiles.unwrap_or(match self.is_cpu() {
            true => GemmTiles::Wide128x64,
            false => GemmTiles::Square64,
        })
    }

    /// Whether the application chose the GEMM's tiles ([`Context::set_gemm_tiles`],
    /// [`ContextOptions::gemm_tiles`](super::ContextOptions::gemm_tiles)): where it did not,
    /// mixed-precision products take tensor cores where they qualified.
    pub(crate) fn gemm_tiles_chosen(&self) -> bool {
        self.gemm_tiles.is_some()
    }

    /// Forces the GEMM's tiles (to compare them on one adapter); `None` restores the choice by
    /// adapter class.
    pub fn set_gemm_tiles(&mut self, tiles: Option<GemmTiles>) {
        self.gemm_tiles = tiles;
    }

    /// The subgroup size kernels may rely on: `Some` where the device has `Features::SUBGROUP`, its
    /// adapter reports one fixed size (`subgroup_min_size == subgroup_max_size`: NVIDIA 32,
    /// lavapipe 8), and subgroup reductions are enabled ([`Context::set_subgroups`], or
    /// [`ContextOptions::subgroups`](super::ContextOptions::subgroups)). Kernels take their
    /// workgroup-memory path where this is `None`; both paths give the same bits.
    pub fn subgroup_size(&self) -> Option<u32> {
        self.subgroup_size.filter(|_| self.subgroups_enabled)
    }

    /// Enables or disables the kernels' subgroup paths (to compare them with the workgroup-memory
    /// paths on one adapter).
    pub fn set_subgroups(&mut self, enabled: bool) {
        self.subgroups_enabled = enabled;
    }

    /// Whether the backward kernels that have them (the GPU and tensor-core families') get builds
    /// with their flags fixed for calls without masks or with causal alone
    /// ([`ContextOptions::fixed_flag_builds`](super::ContextOptions::fixed_flag_builds)): by
    /// default on GPUs, off on CPU drivers.
    pub fn fixed_flag_builds(&self) -> bool {
        self.fixed_flag_builds.unwrap_or(!self.is_cpu())
    }

    /// Whether the GPU and tensor-core families' attention backward adds dQ with f32 atomics from
    /// its dK/dV kernel
    /// ([`ContextOptions::atomic_gradients`](super::ContextOptions::atomic_gradients)): asked
    /// for, and the device has `Features::SHADER_FLOAT32_ATOMIC`. dQ is then not bitwise
    /// repeatable.
    pub fn atomic_gradients(&self) -> bool {
        self.atomic_gradients
    }

    /// Turns the fixed-flag builds on or off; `None` restores the choice by adapter class.
    pub fn set_fixed_flag_builds(&mut self, enabled: Option<bool>) {
        self.fixed_flag_builds = enabled;
    }

    /// Whether the kernels that measured faster without some of wgpu's shader runtime checks (loop
    /// bounding, index clamps) are compiled without them (`create_shader_module_trusted`). On by
    /// default on a device the context created, **off** on a device it wraps
    /// ([`Context::from_device_with`]) unless
    /// [`ContextOptions::trusted_shaders`](super::ContextOptions::trusted_shaders) turns it on; off
    /// compiles every kernel with all checks. wgpu's GL back end applies no such checks either way.
    /// [`ContextOptions::unchecked_measurement`](super::ContextOptions::unchecked_measurement)
    /// compiles every kernel without any check: a benchmark setting, to find the kernels worth
    /// listing on a new adapter, not a mode the tests prove;
    /// [`ContextOptions::unbounded_loops_measurement`](super::ContextOptions::unbounded_loops_measurement) drops only the loop counters.
    pub fn trusted_shaders(&self) -> bool {
        self.trusted_shaders
    }

    /// See [`Context::trusted_shaders`]. Pipelines compiled before keep their checks; later calls
    /// compile (and cache) the other variant.
    pub fn set_trusted_shaders(&mut self, trusted: bool) {
        self.trusted_shaders = trusted;
    }

    /// Whether every kernel records a compute pass of its own. Off by default: a model's forward,
    /// backward and a training step each record one pass (wgpu orders the dispatches of a pass
    /// itself). On (`set_pass_per_kernel(true)`, or
    /// [`ContextOptions::pass_per_kernel`](super::ContextOptions::pass_per_kernel)) gives GPU
    /// debuggers a labelled pass per kernel and measures what the passes cost; profiling
    /// ([`Context::start_profiling`]) turns it on while it runs.
    pub fn pass_per_kernel(&self) -> bool {
        self.pass_per_kernel
    }

    /// See [`Context::pass_per_kernel`].
    pub fn set_pass_per_kernel(&mut self, separate: bool) {
        self.pass_per_kernel = separate;
    }

    /// The attention settings this context was given explicitly (family, tiled shapes, splits):
    /// what the autotuner leaves alone.
    pub(crate) fn kernel_settings(&self) -> KernelChoice {
        KernelChoice {
            family: self.kernel_family,
            tiles: self.tiled_shapes,
            splits: self.forward_splits,
            workgroup: self.attention_workgroup,
            coop_forward: self.coop_forward_shape,
            dq_atomic: None,
            unfused: None,
        }
    }

    /// [`ContextOptions::coop_forward_shape`].
    pub(crate) fn coop_forward_shape(&self) -> Option<(u32, u32)> {
        self.coop_forward_shape
    }

    /// [`ContextOptions::decode_shape`].
    pub(crate) fn decode_shape(&self) -> Option<(u32, u32)> {
        self.decode_shape
    }
}
