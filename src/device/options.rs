//! [`ContextOptions`]: how a context picks its adapter and its kernels. The library reads no
//! environment variable on its own; [`ContextOptions::from_env`] is the explicit opt-in (the
//! crate's binaries, examples and tests use it).

use super::autotune::{TuningBudget, TuningMode};
use super::report::parse_backends;
use super::tuning::{GemmTiles, KernelFamily, TiledShape, ATTENTION_WORKGROUPS};
use crate::error::Result;
use std::fmt;

/// How a [`Context`](super::Context) picks its adapter (when it creates the device) and its
/// kernels.
///
/// Build it with [`ContextOptions::new`] (or `default()`) and the builder methods; fields stay
/// public for reading and for setting one at a time. `#[non_exhaustive]`: adding a field breaks no
/// caller. Nothing here comes from the environment unless [`ContextOptions::from_env`] is asked to
/// read it.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ContextOptions {
    /// Back ends to consider when creating a device. `None`: all of them.
    pub backends: Option<wgpu::Backends>,
    /// Case-insensitive substring of the adapter name. `None`: any adapter (real GPUs first).
    pub adapter_name: Option<String>,
    /// Request at most this much workgroup storage per workgroup (bytes), to run the kernels as on
    /// a smaller device (WebGPU's default limit is 16384). `None`: what the adapter offers.
    pub max_workgroup_storage: Option<u32>,
    /// Request at most this many workgroups per dimension of a dispatch, to run the kernels as on a
    /// device with that limit (WebGPU's default and most adapters': 65535); kernels lay their
    /// workgroups out in a 2-D grid within it. `None`: WebGPU's default.
    pub max_workgroups_per_dimension: Option<u32>,
    /// The fused attention kernel family
    /// ([`Context::set_kernel_family`](super::Context::set_kernel_family)). `None`: by adapter
    /// class.
    pub kernel_family: Option<KernelFamily>,
    /// The GEMM's output tiles ([`Context::set_gemm_tiles`](super::Context::set_gemm_tiles)).
    /// `None`: by adapter class.
    pub gemm_tiles: Option<GemmTiles>,
    /// Workgroup width of the CPU-driver attention kernels
    /// ([`Context::set_attention_workgroup`](super::Context::set_attention_workgroup)).
    pub attention_workgroup: Option<u32>,
    /// Whether kernels may use subgroup operations where the device offers them. `None`: yes.
    pub subgroups: Option<bool>,
    /// Whether the backward kernels that have them get builds with the mask and modifier flags
    /// fixed for calls without masks or with causal alone (`FIXED_FLAGS`), one more pipeline per
    /// shape ([`Context::fixed_flag_builds`](super::Context::fixed_flag_builds)). `None`: on GPUs
    /// (2x on an H200), off on CPU drivers (no faster on lavapipe, and compile time).
    pub fixed_flag_builds: Option<bool>,
    /// Whether the kernels listed as safe are compiled without wgpu's shader runtime checks
    /// ([`Context::trusted_shaders`](super::Context::trusted_shaders)). `None`: on for a device the
    /// context creates, **off** for a device handed to
    /// [`Context::from_device_with`](super::Context::from_device_with) (the library never relaxes
    /// checks on a device it does not own unless asked).
    pub trusted_shaders: Option<bool>,
    /// Compile *every* kernel without runtime checks: a benchmark setting to find the kernels worth
    /// listing on a new adapter, not a mode the tests prove. Off by default.
    pub unchecked_measurement: bool,
    /// Compile *every* kernel without wgpu's loop counters, index clamps kept: the benchmark
    /// setting that tells the two kinds of check apart (`unchecked_measurement` drops both). Off by
    /// default.
    pub unbounded_loops_measurement: bool,
    /// Every kernel in a compute pass of its own
    /// ([`Context::set_pass_per_kernel`](super::Context::set_pass_per_kernel)). Off by default.
    pub pass_per_kernel: bool,
    /// Shape overrides of the GPU family's tiled forward, dK/dV and dQ kernels, for tuning on a new
    /// GPU; a shape a kernel cannot take (divisibility, workgroup storage, width) is logged and
    /// ignored. `None`: the measured defaults.
    pub tiled_shapes: [Option<TiledShape>; 3],
    /// Shape override of the tensor-core forward `(tile groups, keys per tile)` (`GROUPSxBN`: 1, 2
    /// or 4 groups of 16 query rows; 16, 32 or 64 keys), for tuning on a new GPU; a shape that does
    /// not fit the workgroup storage or limits is logged and ignored. `None`: the first that fits.
    pub coop_forward_shape: Option<(u32, u32)>,
    /// Split-KV workgroups per forward query block of the GPU family. `None`: chosen per problem.
    pub forward_splits: Option<usize>,
    /// Shape override of decode attention `(keys per tile, workgroups)`: the keys each staged tile
    /// holds (a power of two from 4 to 64; also the invocations per workgroup) and the workgroups a
    /// grid is split over the key range to reach, for tuning on a new GPU; a tile that does not fit
    /// the workgroup storage is logged and ignored. `None`: the widest tile that fits, and the
    /// measured target.
    pub decode_shape: Option<(u32, u32)>,
    /// Write every pipeline the context compiles to this directory (created if missing), as
    /// `<label>.wgsl` (the source handed to wgpu, before override constants) and `<label>.json`
    /// (`label`, `entry_point`, `constants`, `runtime_checks`): what
    /// `shared/tools/gpu-compile-report` and offline compilers read. With
    /// [`crate::kernels::attention::attention_precompile`],
    /// `wgpu_attention_transformer::Trainer::precompile` or
    /// `wgpu_attention_serve::Generator::precompile` a whole kernel set is written without running
    /// it. A write that fails is logged once and never fails a kernel. `None`: no dump.
    pub dump_pipelines: Option<std::path::PathBuf>,
    /// Whether the fused attention's configuration (family, tile shapes, split-KV count: what the
    /// fields above leave unset) is tuned on this device ([`TuningMode`]). Default: off, the static
    /// choice.
    pub tuning: TuningMode,
    /// The file tuned choices are read from and written to, keyed inside by adapter, driver,
    /// limits and library version (other adapters' sections are kept). The library never picks a
    /// path itself: `None` keeps choices for the context's life only. A file that is unreadable,
    /// corrupt or of another format is ignored with a `log` warning, and replaced at the next save.
    pub tuning_cache: Option<std::path::PathBuf>,
    /// How long tuning may take, per key and in all ([`TuningBudget`]).
    pub tuning_budget: TuningBudget,
    /// Whether tuning may pick the tensor-core family ([`KernelFamily::Coop`]) for calls the
    /// context leaves the family of: it is then timed beside the others, and wins where it is
    /// faster. Its results have the tensor-core tolerances (inputs and P rounded to f16, SPEC.md;
    /// `reference::compare::TENSOR_CORE_*`), looser than f32's and f16's, so this is the caller's
    /// choice, as PyTorch's `allow_tf32`. Tuned choices made with it are cached under keys of
    /// their own. Default: off.
    pub tune_tensor_cores: bool,
    /// Whether the GPU and tensor-core families' attention backward may add dQ with f32 atomics
    /// from its dK/dV kernel (FlashAttention-2's split of the backward: five products instead of
    /// seven, and no dQ kernel), where the device has `Features::SHADER_FLOAT32_ATOMIC`
    /// ([`Context::atomic_gradients`](super::Context::atomic_gradients) says whether it applies).
    /// The key blocks' terms then arrive in no fixed order: dQ is within the f32 tolerances of
    /// SPEC.md but no longer bitwise repeatable between runs (dK and dV still are). Calls with a
    /// learned relative table keep the dQ kernel. Default: off, every gradient bitwise
    /// deterministic.
    pub atomic_gradients: bool,
}

/// The environment variables [`ContextOptions::from_env`] reads, with what each sets.
pub const ENVIRONMENT_VARIABLES: [(&str, &str); 20] = [
    (
        "WGPU_BACKEND",
        "backends: vulkan, gl, metal, dx12 (comma-separated)",
    ),
    ("WGPU_ADAPTER_NAME", "adapter_name"),
    ("WGPU_ATTENTION_KERNELS", "kernel_family: cpu or gpu"),
    ("WGPU_ATTENTION_GEMM_TILES", "gemm_tiles: 64x64, 128x64, coop, coop64 or coop128"),
    (
        "WGPU_ATTENTION_WORKGROUP",
        "attention_workgroup: 16, 32, 64 or 128",
    ),
    ("WGPU_ATTENTION_SUBGROUPS", "subgroups: on or off"),
    (
        "WGPU_ATTENTION_FIXED_FLAG_BUILDS",
        "fixed_flag_builds: on or off",
    ),
    (
        "WGPU_ATTENTION_TRUSTED_SHADERS",
        "trusted_shaders: on or off; all sets unchecked_measurement, noloop unbounded_loops_measurement",
    ),
    (
        "WGPU_ATTENTION_PASS_PER_KERNEL",
        "pass_per_kernel: on or off",
    ),
    ("WGPU_ATTENTION_TILED_FORWARD", "tiled_shapes[0]: WGxBMxBN"),
    ("WGPU_ATTENTION_TILED_DKDV", "tiled_shapes[1]: WGxBNxBM"),
    ("WGPU_ATTENTION_TILED_DQ", "tiled_shapes[2]: WGxBMxBN"),
    ("WGPU_ATTENTION_COOP_FORWARD", "coop_forward_shape: GROUPSxBN"),
    ("WGPU_ATTENTION_SPLITS", "forward_splits: a count >= 1"),
    ("WGPU_ATTENTION_DECODE", "decode_shape: KEYSxWORKGROUPS"),
    (
        "WGPU_ATTENTION_DUMP_PIPELINES",
        "dump_pipelines: a directory to write every compiled pipeline to",
    ),
    ("WGPU_ATTENTION_TUNING", "tuning: off, cache or tune"),
    (
        "WGPU_ATTENTION_TUNING_CACHE",
        "tuning_cache: the file tuned choices are kept in",
    ),
    (
        "WGPU_ATTENTION_TUNE_TENSOR_CORES",
        "tune_tensor_cores: on or off",
    ),
    (
        "WGPU_ATTENTION_ATOMIC_GRADIENTS",
        "atomic_gradients: on or off",
    ),
];

/// The numbers of a shape override such as `128x64x32`.
fn shape_dims(value: &str) -> Vec<u32> {
    value.split('x').filter_map(|n| n.parse().ok()).collect()
}

impl ContextOptions {
    /// The defaults: any adapter, kernels chosen by adapter class, no environment read.
    pub fn new() -> Self {
        Self::default()
    }

    /// The defaults overridden by the environment variables listed in [`ENVIRONMENT_VARIABLES`]:
    /// the opt-in for programs that want to be tuned from outside (the crate's binaries, examples
    /// and tests use it). An unparsable back-end name is an error; any other unparsable value is
    /// logged (`log::warn!`) and ignored.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let ignore = |name: &str, value: &str, why: &dyn fmt::Display| {
            log::warn!("wgpu-attention: ignoring {name}={value}: {why}");
        };
        let on_off = |name: &str| -> Option<bool> {
            let value = var(name)?;
            match value.trim() {
                "1" | "on" => Some(true),
                "0" | "off" => Some(false),
                _ => {
                    ignore(name, &value, &"use on or off");
                    None
                }
            }
        };
        let mut options = Self::new();
        if let Some(name) = var("WGPU_BACKEND") {
            options.backends = Some(parse_backends(&name)?);
        }
        options.adapter_name = var("WGPU_ADAPTER_NAME");
        if let Some(value) = var("WGPU_ATTENTION_KERNELS") {
            match KernelFamily::parse(&value) {
                Ok(family) => options.kernel_family = Some(family),
                Err(e) => ignore("WGPU_ATTENTION_KERNELS", &value, &e),
            }
        }
        if let Some(value) = var("WGPU_ATTENTION_GEMM_TILES") {
            match GemmTiles::parse(&value) {
                Ok(tiles) => options.gemm_tiles = Some(tiles),
                Err(e) => ignore("WGPU_ATTENTION_GEMM_TILES", &value, &e),
            }
        }
        if let Some(value) = var("WGPU_ATTENTION_WORKGROUP") {
            match value.trim().parse::<u32>() {
                Ok(width) if ATTENTION_WORKGROUPS.contains(&width) => {
                    options.attention_workgroup = Some(width)
                }
                _ => ignore("WGPU_ATTENTION_WORKGROUP", &value, &"use 16, 32, 64 or 128"),
            }
        }
        options.subgroups = on_off("WGPU_ATTENTION_SUBGROUPS");
        options.fixed_flag_builds = on_off("WGPU_ATTENTION_FIXED_FLAG_BUILDS");
        if let Some(value) = var("WGPU_ATTENTION_TRUSTED_SHADERS") {
            match value.trim() {
                "1" | "on" => options.trusted_shaders = Some(true),
                "0" | "off" => options.trusted_shaders = Some(false),
                "all" => options.unchecked_measurement = true,
                "noloop" => options.unbounded_loops_measurement = true,
                _ => ignore(
                    "WGPU_ATTENTION_TRUSTED_SHADERS",
                    &value,
                    &"use on, off, noloop or all",
                ),
            }
        }
        options.pass_per_kernel = on_off("WGPU_ATTENTION_PASS_PER_KERNEL").unwrap_or(false);
        let tiled = [
            "WGPU_ATTENTION_TILED_FORWARD",
            "WGPU_ATTENTION_TILED_DKDV",
            "WGPU_ATTENTION_TILED_DQ",
        ];
        for (slot, name) in options.tiled_shapes.iter_mut().zip(tiled) {
            if let Some(value) = var(name) {
                match shape_dims(&value)[..] {
                    [wg, a, b] => *slot = Some((wg, a, b)),
                    _ => ignore(name, &value, &"expected WGxAxB"),
                }
            }
        }
        if let Some(value) = var("WGPU_ATTENTION_COOP_FORWARD") {
            match shape_dims(&value)[..] {
                [groups, block_n] => options.coop_forward_shape = Some((groups, block_n)),
                _ => ignore("WGPU_ATTENTION_COOP_FORWARD", &value, &"expected GROUPSxBN"),
            }
        }
        if let Some(value) = var("WGPU_ATTENTION_SPLITS") {
            match value.trim().parse::<usize>() {
                Ok(n) if n >= 1 => options.forward_splits = Some(n),
                _ => ignore("WGPU_ATTENTION_SPLITS", &value, &"expected a count >= 1"),
            }
        }
        if let Some(value) = var("WGPU_ATTENTION_DECODE") {
            match shape_dims(&value)[..] {
                [keys, workgroups]
                    if keys.is_power_of_two() && (4..=64).contains(&keys) && workgroups >= 1 =>
                {
                    options.decode_shape = Some((keys, workgroups))
                }
                _ => ignore(
                    "WGPU_ATTENTION_DECODE",
                    &value,
                    &"expected KEYSxWORKGROUPS, KEYS a power of two from 4 to 64",
                ),
            }
        }
        options.dump_pipelines = var("WGPU_ATTENTION_DUMP_PIPELINES").map(Into::into);
        if let Some(value) = var("WGPU_ATTENTION_TUNING") {
            match TuningMode::parse(&value) {
                Ok(mode) => options.tuning = mode,
                Err(e) => ignore("WGPU_ATTENTION_TUNING", &value, &e),
            }
        }
        options.tuning_cache = var("WGPU_ATTENTION_TUNING_CACHE").map(Into::into);
        if let Some(allowed) = on_off("WGPU_ATTENTION_TUNE_TENSOR_CORES") {
            options.tune_tensor_cores = allowed;
        }
        if let Some(allowed) = on_off("WGPU_ATTENTION_ATOMIC_GRADIENTS") {
            options.atomic_gradients = allowed;
        }
        Ok(options)
    }

    /// Sets [`ContextOptions::backends`].
    pub fn backends(mut self, backends: wgpu::Backends) -> Self {
        self.backends = Some(backends);
        self
    }

    /// Sets [`ContextOptions::adapter_name`].
    pub fn adapter_name(mut self, name: impl Into<String>) -> Self {
        self.adapter_name = Some(name.into());
        self
    }

    /// Sets [`ContextOptions::max_workgroup_storage`].
    pub fn max_workgroup_storage(mut self, bytes: u32) -> Self {
        self.max_workgroup_storage = Some(bytes);
        self
    }

    /// Sets [`ContextOptions::max_workgroups_per_dimension`].
    pub fn max_workgroups_per_dimension(mut self, workgroups: u32) -> Self {
        self.max_workgroups_per_dimension = Some(workgroups);
        self
    }

    /// Sets [`ContextOptions::kernel_family`].
    pub fn kernel_family(mut self, family: KernelFamily) -> Self {
        self.kernel_family = Some(family);
        self
    }

    /// Sets [`ContextOptions::gemm_tiles`].
    pub fn gemm_tiles(mut self, tiles: GemmTiles) -> Self {
        self.gemm_tiles = Some(tiles);
        self
    }

    /// Sets [`ContextOptions::attention_workgroup`] (checked when the context is created).
    pub fn attention_workgroup(mut self, width: u32) -> Self {
        self.attention_workgroup = Some(width);
        self
    }

    /// Sets [`ContextOptions::subgroups`].
    pub fn subgroups(mut self, enabled: bool) -> Self {
        self.subgroups = Some(enabled);
        self
    }

    /// Sets [`ContextOptions::fixed_flag_builds`].
    pub fn fixed_flag_builds(mut self, enabled: bool) -> Self {
        self.fixed_flag_builds = Some(enabled);
        self
    }

    /// Sets [`ContextOptions::trusted_shaders`].
    pub fn trusted_shaders(mut self, trusted: bool) -> Self {
        self.trusted_shaders = Some(trusted);
        self
    }

    /// Sets [`ContextOptions::dump_pipelines`].
    pub fn dump_pipelines(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.dump_pipelines = Some(dir.into());
        self
    }

    /// Sets [`ContextOptions::pass_per_kernel`].
    pub fn pass_per_kernel(mut self, separate: bool) -> Self {
        self.pass_per_kernel = separate;
        self
    }

    /// Sets [`ContextOptions::tuning`].
    pub fn tuning(mut self, mode: TuningMode) -> Self {
        self.tuning = mode;
        self
    }

    /// Sets [`ContextOptions::tuning_cache`].
    pub fn tuning_cache(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.tuning_cache = Some(path.into());
        self
    }

    /// Sets [`ContextOptions::tuning_budget`].
    pub fn tuning_budget(mut self, budget: TuningBudget) -> Self {
        self.tuning_budget = budget;
        self
    }

    /// Sets [`ContextOptions::tune_tensor_cores`].
    pub fn tune_tensor_cores(mut self, allowed: bool) -> Self {
        self.tune_tensor_cores = allowed;
        self
    }

    /// Sets [`ContextOptions::atomic_gradients`].
    pub fn atomic_gradients(mut self, allowed: bool) -> Self {
        self.atomic_gradients = allowed;
        self
    }
}
