//! The device layer: a [`Context`] owns (or borrows) a `wgpu::Device` and `Queue`, knows the adapter's
//! limits and features, and caches compiled pipelines so nothing is compiled in the hot path.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// How [`Context::new_with`] picks its adapter.
#[derive(Clone, Debug, Default)]
pub struct ContextOptions {
    /// Back ends to consider. `None`: `WGPU_BACKEND` (vulkan, gl, metal, dx12) or all of them.
    pub backends: Option<wgpu::Backends>,
    /// Case-insensitive substring of the adapter name. `None`: `WGPU_ADAPTER_NAME`, or any adapter.
    pub adapter_name: Option<String>,
}

/// What the context runs on, for logs and benchmark reports.
#[derive(Clone, Debug)]
pub struct AdapterReport {
    pub name: String,
    pub backend: wgpu::Backend,
    pub device_type: wgpu::DeviceType,
    pub driver: String,
    pub driver_info: String,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    /// The cooperative-matrix (tensor core) configurations the adapter lists through wgpu
    /// (`Adapter::cooperative_matrix_properties`; empty for a device wrapped without its adapter).
    /// Listed, not enabled: no kernel uses them yet.
    pub cooperative_matrices: Vec<wgpu::CooperativeMatrixProperties>,
}

impl fmt::Display for AdapterReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({:?}, {:?}, driver {} {}); workgroup storage {} B, invocations {}, storage binding {} B, storage buffers/stage {}; features {:?}",
            self.name,
            self.backend,
            self.device_type,
            self.driver,
            self.driver_info,
            self.limits.max_compute_workgroup_storage_size,
            self.limits.max_compute_invocations_per_workgroup,
            self.limits.max_storage_buffer_binding_size,
            self.limits.max_storage_buffers_per_shader_stage,
            self.features,
        )?;
        if !self.cooperative_matrices.is_empty() {
            let listed: Vec<String> = self
                .cooperative_matrices
                .iter()
                .map(|c| {
                    format!(
                        "{}x{}x{} {:?}->{:?}",
                        c.m_size, c.n_size, c.k_size, c.ab_type, c.cr_type
                    )
                })
                .collect();
            write!(f, "; cooperative matrices {}", listed.join(", "))?;
        }
        Ok(())
    }
}

/// Cache key of a compiled pipeline: shader name plus its override constants, and whether it was
/// compiled with the kernel's relaxed runtime checks.
#[derive(Clone, PartialEq, Eq, Hash)]
struct PipelineKey {
    shader: &'static str,
    constants: Vec<(&'static str, u32)>,
    trusted: bool,
}

/// A GPU device with its queue, adapter report and pipeline cache. Cheap to share behind `Arc`.
pub struct Context {
    device: wgpu::Device,
    queue: wgpu::Queue,
    report: AdapterReport,
    pipelines: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
    memory: Arc<MemoryCounter>,
    /// Compute passes begun and command buffers submitted through this context, for benchmarks.
    recorded_passes: std::sync::atomic::AtomicU64,
    submissions: std::sync::atomic::AtomicU64,
    /// Bound where a kernel's optional storage input (sequence lengths) is absent.
    empty_storage: wgpu::Buffer,
    /// Bound where an optional read-write storage binding is absent: a buffer bound read-only
    /// and read-write in one dispatch is a usage conflict.
    empty_storage_rw: wgpu::Buffer,
    loop_budget: Option<u32>,
    attention_workgroup: Option<u32>,
    kernel_family: Option<KernelFamily>,
    gemm_tiles: Option<GemmTiles>,
    /// The adapter's fixed subgroup size where the device has `Features::SUBGROUP`.
    subgroup_size: Option<u32>,
    subgroups_enabled: bool,
    trusted_shaders: bool,
    /// `WGPU_ATTENTION_TRUSTED_SHADERS=all`: every kernel without runtime checks, to measure which
    /// would gain on a new adapter (benchmarks only; results are validated there, not proven).
    untrusted_measurement: bool,
    /// Grow-only scratch storage of kernels that need a workspace the caller does not pass (the
    /// split-KV partial results of the forward). Dispatches in one queue run in order, so one buffer
    /// serves every call; a larger request replaces it (recorded work keeps the old one alive).
    scratch: Mutex<HashMap<&'static str, (Arc<wgpu::Buffer>, Allocation)>>,
    /// Why the device was lost, once it has been: later waits report it instead of hanging or
    /// panicking inside wgpu.
    lost: Arc<Mutex<Option<String>>>,
    /// The first device error no error scope caught, on devices this crate created (wgpu's default
    /// handler would panic): reported by the next [`Context::synchronize`].
    uncaptured: Arc<Mutex<Option<String>>>,
    profiler: Mutex<Option<PassProfiler>>,
    binding_cache: Mutex<Option<BindingCache>>,
}

/// One storage binding of a kernel: `size` bytes of `buffer` from `offset` (`None`: to its end).
pub(crate) struct StorageBinding<'a> {
    pub binding: u32,
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub size: Option<wgpu::BufferSize>,
}

/// See [`Context::recorded_counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordedCounts {
    pub passes: u64,
    pub submissions: u64,
}

/// A pipeline and the storage it binds: what identifies a dispatch across recordings.
type BindKey = (
    wgpu::ComputePipeline,
    Vec<(u32, wgpu::Buffer, u64, Option<wgpu::BufferSize>)>,
);

struct BindSlot {
    uniform: wgpu::Buffer,
    params: Vec<u8>,
    bind_group: wgpu::BindGroup,
}

#[derive(Default)]
struct BindEntry {
    slots: Vec<BindSlot>,
    epoch: u64,
    used: usize,
}

/// Bind groups and their uniform parameter blocks, kept across recordings of the same work: a
/// training loop records the same kernels on the same buffers every step, so after the first step it
/// creates no bind group and no buffer; parameter blocks whose values change (the optimizer's step
/// count, chunk bounds) are rewritten in place through the queue. The n-th dispatch of a pipeline on
/// given buffers within one recording reuses the n-th slot, so one submission never needs one slot
/// twice. Owned by whoever records repeatedly (`Trainer` does) and lent to the context with
/// [`Context::with_binding_cache`]; it keeps the buffers it binds alive until it is dropped.
#[derive(Default)]
pub struct BindingCache {
    entries: HashMap<BindKey, BindEntry>,
    epoch: u64,
    created: u64,
    reused: u64,
}

impl BindingCache {
    /// Bind groups created (cache misses) and reused (hits) so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.created, self.reused)
    }
}

/// Timestamps around every compute pass the kernels record, while profiling is on.
struct PassProfiler {
    query_set: Arc<wgpu::QuerySet>,
    capacity: u32,
    labels: Vec<&'static str>,
}

/// Most passes one profile records (two timestamps each; wgpu allows 4096 queries per set).
pub const MAX_PROFILED_PASSES: u32 = 2048;

/// Loop iterations one invocation may run on llvmpipe (lavapipe and GL): Mesa's gallivm stops every
/// loop of a shader once 65535 iterations have run in total in one invocation, silently, so longer
/// kernels return wrong results. Kept below that, with room for the kernels' set-up loops.
pub const LLVMPIPE_LOOP_BUDGET: u32 = 60_000;

/// Bytes of tensor storage this crate has allocated on a context (user-wrapped buffers, uniform
/// blocks and readback staging are not counted).
#[derive(Debug, Default)]
pub(crate) struct MemoryCounter {
    current: AtomicU64,
    peak: AtomicU64,
}

/// A live allocation: releases its bytes from the counter when the last tensor using it is dropped.
#[derive(Debug)]
pub(crate) struct Allocation {
    bytes: u64,
    counter: Arc<MemoryCounter>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.counter
            .current
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Current and peak bytes of tensors allocated through a [`Context`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryStats {
    pub current_bytes: u64,
    pub peak_bytes: u64,
}

/// Features used when offered; none is required.
const WANTED_FEATURES: wgpu::Features = wgpu::Features::TIMESTAMP_QUERY
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP);

/// Workgroup widths the fused attention kernels are written for.
pub const ATTENTION_WORKGROUPS: [u32; 4] = [16, 32, 64, 128];

/// Which family of fused attention kernels a context runs. Both compute the same results (SPEC.md)
/// and are tested against the same reference; they differ in shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// Shaped for CPU drivers (lavapipe, llvmpipe): each invocation keeps four rows in vec4 lanes
    /// with head-dim-sized private arrays, wide workgroups, long loops split under the driver's cap.
    CpuDriver,
    /// Shaped for GPUs: small query blocks, Q/K/V tiles in workgroup memory, register micro-tiles,
    /// split-KV when the grid would leave the GPU idle.
    Gpu,
}

impl KernelFamily {
    /// Parses `cpu` / `cpu-driver` or `gpu` (as `WGPU_ATTENTION_KERNELS` and the bench's `--kernels`).
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim().to_lowercase().as_str() {
            "cpu" | "cpu-driver" => Ok(Self::CpuDriver),
            "gpu" => Ok(Self::Gpu),
            other => Err(Error::shape(
                "kernel family",
                format!("'{other}' is not one: use cpu or gpu"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::CpuDriver => "cpu",
            Self::Gpu => "gpu",
        }
    }
}

/// Output tiles of the strided GEMM (`shaders/matmul_*.wgsl`) for products of at least 128 rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmTiles {
    /// 64 x 64 per 256-invocation workgroup, 4 x 4 per invocation (`matmul_strided.wgsl`): the
    /// default on GPUs, the kernel measured on an H100 (BENCHMARKS.md).
    Square64,
    /// 128 x 64, 8 x 4 per invocation with vec4 workgroup-memory reads (`matmul_wide.wgsl`): twice
    /// the multiply-adds per staged value, half the workgroups. The default on CPU drivers, where it
    /// measured 1.9-2.1x faster on the layer shapes (`gemm-bench`); unmeasured on a GPU, where the
    /// smaller grid may not fill the machine.
    Wide128x64,
}

impl GemmTiles {
    /// Parses `64x64` or `128x64` (as `WGPU_ATTENTION_GEMM_TILES` and the benches' options).
    pub fn parse(name: &str) -> Result<Self> {
        match name.trim() {
            "64x64" => Ok(Self::Square64),
            "128x64" => Ok(Self::Wide128x64),
            other => Err(Error::shape(
                "gemm tiles",
                format!("'{other}' is not one: use 64x64 or 128x64"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Square64 => "64x64",
            Self::Wide128x64 => "128x64",
        }
    }
}

/// Parses a back-end name as accepted by `WGPU_BACKEND`.
pub fn parse_backends(name: &str) -> Result<wgpu::Backends> {
    let backends = wgpu::Backends::from_comma_list(name);
    if backends.is_empty() {
        return Err(Error::UnknownBackend(name.to_string()));
    }
    Ok(backends)
}

fn backends_from_env() -> Result<wgpu::Backends> {
    match std::env::var("WGPU_BACKEND") {
        Ok(name) if !name.trim().is_empty() => parse_backends(&name),
        _ => Ok(wgpu::Backends::all()),
    }
}

/// Lists the adapters of the given back ends (default: `WGPU_BACKEND` or all).
pub fn enumerate_adapters(backends: Option<wgpu::Backends>) -> Result<Vec<wgpu::AdapterInfo>> {
    let backends = match backends {
        Some(b) => b,
        None => backends_from_env()?,
    };
    let instance = new_instance(backends);
    let adapters = pollster::block_on(instance.enumerate_adapters(backends));
    Ok(adapters.iter().map(|a| a.get_info()).collect())
}

/// Keeps a headless run's start-up quiet on Linux. Mesa's Vulkan device-selection layer
/// (`VK_LAYER_MESA_device_select`, installed with Mesa's drivers) connects to the Wayland display to
/// find the desktop's GPU whenever an instance enables the Wayland surface extension, which wgpu 30
/// enables whenever the driver offers it, with no option to leave it out; without a session libwayland prints
/// `error: XDG_RUNTIME_DIR is invalid or not set in the environment.` twice, harmless but alarming.
/// With no display session (`WAYLAND_DISPLAY` and `DISPLAY` unset) this sets `NODEVICE_SELECT=1`,
/// the layer's own off switch, unless the variable is already set. The layer only reorders GPUs for
/// a desktop; [`Context`] ranks adapters itself, and `WGPU_BACKEND` and `WGPU_ADAPTER_NAME` work
/// as before.
///
/// It changes the process environment, so call it first thing in `main`, before any thread starts:
/// the binaries and examples of this crate do. A library cannot safely do it on its user's behalf.
pub fn quiet_headless_start_up() {
    let unset = |name: &str| std::env::var_os(name).is_none();
    if cfg!(target_os = "linux")
        && unset("WAYLAND_DISPLAY")
        && unset("DISPLAY")
        && unset("NODEVICE_SELECT")
    {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

fn new_instance(backends: wgpu::Backends) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    wgpu::Instance::new(desc)
}

impl Context {
    /// Creates a device on the default adapter (see [`ContextOptions`] for the environment variables).
    pub fn new() -> Result<Self> {
        Self::new_with(&ContextOptions::default())
    }

    /// Creates a device on the adapter selected by `options`.
    pub fn new_with(options: &ContextOptions) -> Result<Self> {
        pollster::block_on(Self::new_async(options))
    }

    /// Async form of [`Context::new_with`].
    pub async fn new_async(options: &ContextOptions) -> Result<Self> {
        let backends = match options.backends {
            Some(b) => b,
            None => backends_from_env()?,
        };
        let filter = options
            .adapter_name
            .clone()
            .or_else(|| std::env::var("WGPU_ADAPTER_NAME").ok())
            .filter(|f| !f.is_empty());
        let instance = new_instance(backends);
        let adapters = instance.enumerate_adapters(backends).await;
        let available = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?})", i.name, i.backend)
            })
            .collect::<Vec<_>>();
        // Prefer real GPUs over CPU drivers, keeping enumeration order otherwise.
        let rank = |t: wgpu::DeviceType| match t {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Other => 3,
            wgpu::DeviceType::Cpu => 4,
        };
        let adapter = adapters
            .into_iter()
            .filter(|a| match &filter {
                Some(f) => a.get_info().name.to_lowercase().contains(&f.to_lowercase()),
                None => true,
            })
            .min_by_key(|a| rank(a.get_info().device_type))
            .ok_or_else(|| Error::NoAdapter {
                backends: format!("{backends:?}"),
                filter: filter.clone(),
                available: if available.is_empty() {
                    "none".into()
                } else {
                    available.join(", ")
                },
            })?;

        let offered = adapter.limits();
        // Start from the WebGPU defaults and raise what the kernels benefit from to what is offered.
        let mut limits = wgpu::Limits::defaults();
        limits.max_compute_workgroup_storage_size = offered.max_compute_workgroup_storage_size;
        limits.max_compute_invocations_per_workgroup =
            offered.max_compute_invocations_per_workgroup;
        limits.max_storage_buffer_binding_size = offered.max_storage_buffer_binding_size;
        limits.max_buffer_size = offered.max_buffer_size;
        limits.max_storage_buffers_per_shader_stage = offered.max_storage_buffers_per_shader_stage;
        limits.max_compute_workgroup_size_x = offered.max_compute_workgroup_size_x;
        limits.max_compute_workgroup_size_y = offered.max_compute_workgroup_size_y;
        let features = adapter.features() & WANTED_FEATURES;
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("wgpu-attention"),
                required_features: features,
                required_limits: limits,
                ..Default::default()
            })
            .await?;
        let mut ctx = Self::from_device(device, queue, Some(adapter.get_info()));
        ctx.report.cooperative_matrices = adapter.cooperative_matrix_properties();
        // Our device, so our handler: an error no scope caught becomes an `Err` of the next
        // synchronisation instead of wgpu's default panic. A user's device keeps the user's handler.
        let uncaptured = ctx.uncaptured.clone();
        ctx.device
            .on_uncaptured_error(Arc::new(move |error: wgpu::Error| {
                let text = error
                    .to_string()
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && *l != "Caused by:")
                    .collect::<Vec<_>>()
                    .join(": ");
                eprintln!("wgpu-attention: device error: {text}");
                uncaptured
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(text);
            }));
        Ok(ctx)
    }

    /// Wraps a device the application already owns. Limits and features are read from the device;
    /// `adapter_info` only labels reports.
    pub fn from_device(
        device: wgpu::Device,
        queue: wgpu::Queue,
        adapter_info: Option<wgpu::AdapterInfo>,
    ) -> Self {
        let limits = device.limits();
        let features = device.features();
        // Kernels that place invocations by subgroup need its size fixed for the whole device.
        let subgroup_size = adapter_info.as_ref().and_then(|info| {
            (features.contains(wgpu::Features::SUBGROUP)
                && info.subgroup_min_size == info.subgroup_max_size)
                .then_some(info.subgroup_min_size)
        });
        let report = match adapter_info {
            Some(info) => AdapterReport {
                name: info.name,
                backend: info.backend,
                device_type: info.device_type,
                driver: info.driver,
                driver_info: info.driver_info,
                limits,
                features,
                cooperative_matrices: Vec::new(),
            },
            None => AdapterReport {
                name: "user device".into(),
                backend: wgpu::Backend::Noop,
                device_type: wgpu::DeviceType::Other,
                driver: String::new(),
                driver_info: String::new(),
                limits,
                features,
                cooperative_matrices: Vec::new(),
            },
        };
        let empty = |label| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: 8,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        };
        let (empty_storage, empty_storage_rw) = (empty("empty storage"), empty("empty storage rw"));
        let lost: Arc<Mutex<Option<String>>> = Arc::default();
        {
            let lost = lost.clone();
            device.set_device_lost_callback(move |reason, message| {
                let text = match message.is_empty() {
                    true => format!("{reason:?}"),
                    false => format!("{reason:?}: {message}"),
                };
                eprintln!("wgpu-attention: device lost ({text})");
                *lost.lock().unwrap_or_else(|e| e.into_inner()) = Some(text);
            });
        }
        let is_llvmpipe = [&report.name, &report.driver]
            .iter()
            .any(|s| s.to_lowercase().contains("llvmpipe"));
        let mut ctx = Self {
            device,
            queue,
            report,
            pipelines: Mutex::new(HashMap::new()),
            memory: Arc::default(),
            recorded_passes: Default::default(),
            submissions: Default::default(),
            empty_storage,
            empty_storage_rw,
            loop_budget: is_llvmpipe.then_some(LLVMPIPE_LOOP_BUDGET),
            attention_workgroup: None,
            kernel_family: None,
            gemm_tiles: None,
            subgroup_size,
            subgroups_enabled: true,
            trusted_shaders: true,
            untrusted_measurement: false,
            scratch: Mutex::default(),
            lost,
            uncaptured: Arc::default(),
            profiler: Mutex::new(None),
            binding_cache: Mutex::new(None),
        };
        if let Ok(value) = std::env::var("WGPU_ATTENTION_KERNELS") {
            match KernelFamily::parse(&value) {
                Ok(family) => ctx.kernel_family = Some(family),
                Err(e) => eprintln!("wgpu-attention: ignoring WGPU_ATTENTION_KERNELS={value}: {e}"),
            }
        }
        if let Ok(value) = std::env::var("WGPU_ATTENTION_GEMM_TILES") {
            match GemmTiles::parse(&value) {
                Ok(tiles) => ctx.gemm_tiles = Some(tiles),
                Err(e) => {
                    eprintln!("wgpu-attention: ignoring WGPU_ATTENTION_GEMM_TILES={value}: {e}")
                }
            }
        }
        if let Ok(value) = std::env::var("WGPU_ATTENTION_SUBGROUPS") {
            match value.trim() {
                "0" | "off" => ctx.subgroups_enabled = false,
                "1" | "on" => {}
                _ => eprintln!(
                    "wgpu-attention: ignoring WGPU_ATTENTION_SUBGROUPS={value}: use on or off"
                ),
            }
        }
        if let Ok(value) = std::env::var("WGPU_ATTENTION_TRUSTED_SHADERS") {
            match value.trim() {
                "0" | "off" => ctx.trusted_shaders = false,
                "1" | "on" => {}
                "all" => ctx.untrusted_measurement = true,
                _ => eprintln!(
                    "wgpu-attention: ignoring WGPU_ATTENTION_TRUSTED_SHADERS={value}: use on, off or all"
                ),
            }
        }
        if let Ok(value) = std::env::var("WGPU_ATTENTION_WORKGROUP") {
            let applied = match value.parse::<u32>() {
                Ok(width) => ctx.set_attention_workgroup(Some(width)),
                Err(e) => Err(Error::shape("WGPU_ATTENTION_WORKGROUP", e.to_string())),
            };
            if let Err(e) = applied {
                eprintln!("wgpu-attention: ignoring WGPU_ATTENTION_WORKGROUP={value}: {e}");
            }
        }
        ctx
    }

    /// The most loop iterations one kernel invocation may run, if the driver caps them; kernels whose
    /// loops would run longer are split into several dispatches that merge their results. Detected
    /// for llvmpipe ([`LLVMPIPE_LOOP_BUDGET`]); `None` elsewhere.
    pub fn loop_budget(&self) -> Option<u32> {
        self.loop_budget
    }

    /// Overrides the detected loop budget: for a wrapped device whose adapter was not given, or to
    /// test the split path with a small budget.
    pub fn set_loop_budget(&mut self, budget: Option<u32>) {
        self.loop_budget = budget;
    }

    /// The workgroup width of the fused attention kernels where it is overridden; `None` picks the
    /// measured default per pass (see `kernels::attention`). Read once from `WGPU_ATTENTION_WORKGROUP`
    /// when the context is created.
    pub fn attention_workgroup(&self) -> Option<u32> {
        self.attention_workgroup
    }

    /// Overrides the workgroup width of the fused attention kernels (16, 32, 64 or 128 invocations),
    /// for tuning on an adapter whose best width is not the default; `None` restores the defaults.
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

    /// The fused attention kernel family this context runs: the one set with
    /// [`Context::set_kernel_family`] (or `WGPU_ATTENTION_KERNELS=cpu|gpu`, read when the context is
    /// created), else [`KernelFamily::CpuDriver`] on CPU drivers and [`KernelFamily::Gpu`] elsewhere.
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
    /// [`Context::set_gemm_tiles`] (or `WGPU_ATTENTION_GEMM_TILES=64x64|128x64`, read when the
    /// context is created), else [`GemmTiles::Wide128x64`] on CPU drivers and
    /// [`GemmTiles::Square64`] elsewhere.
    pub fn gemm_tiles(&self) -> GemmTiles {
        self.gemm_tiles.unwrap_or(match self.is_cpu() {
            true => GemmTiles::Wide128x64,
            false => GemmTiles::Square64,
        })
    }

    /// Forces the GEMM's tiles (to compare them on one adapter); `None` restores the choice by
    /// adapter class.
    pub fn set_gemm_tiles(&mut self, tiles: Option<GemmTiles>) {
        self.gemm_tiles = tiles;
    }

    /// The subgroup size kernels may rely on: `Some` where the device has `Features::SUBGROUP`, its
    /// adapter reports one fixed size (`subgroup_min_size == subgroup_max_size`: NVIDIA 32,
    /// lavapipe 8), and subgroup reductions are enabled ([`Context::set_subgroups`], or
    /// `WGPU_ATTENTION_SUBGROUPS=off` when the context is created). A device wrapped without its
    /// adapter info has none. Kernels take their workgroup-memory path where this is `None`; both
    /// paths give the same bits.
    pub fn subgroup_size(&self) -> Option<u32> {
        self.subgroup_size.filter(|_| self.subgroups_enabled)
    }

    /// Enables or disables the kernels' subgroup paths (to compare them with the workgroup-memory
    /// paths on one adapter).
    pub fn set_subgroups(&mut self, enabled: bool) {
        self.subgroups_enabled = enabled;
    }

    /// Whether the kernels that measured faster without some of wgpu's shader runtime checks (loop
    /// bounding, index clamps) are compiled without them (`create_shader_module_trusted`). On by
    /// default; off (`set_trusted_shaders(false)`, or `WGPU_ATTENTION_TRUSTED_SHADERS=off` when the
    /// context is created) compiles every kernel with all checks, to compare or to rule them out.
    /// wgpu's GL back end applies no such checks either way. `WGPU_ATTENTION_TRUSTED_SHADERS=all`
    /// compiles every kernel without any check: a benchmark setting, to find the kernels worth
    /// listing on a new adapter, not a mode the tests prove.
    pub fn trusted_shaders(&self) -> bool {
        self.trusted_shaders
    }

    /// See [`Context::trusted_shaders`]. Pipelines compiled before keep their checks; later calls
    /// compile (and cache) the other variant.
    pub fn set_trusted_shaders(&mut self, trusted: bool) {
        self.trusted_shaders = trusted;
    }

    /// The scratch buffer `what` (one per purpose, so two kinds of workspace of one call never
    /// alias), at least `bytes`, counted in [`Context::memory`]. See `scratch` above.
    pub(crate) fn scratch_buffer(
        &self,
        what: &'static str,
        bytes: u64,
    ) -> Result<Arc<wgpu::Buffer>> {
        let mut slots = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((buffer, _)) = slots.get(what).filter(|(b, _)| b.size() >= bytes) {
            return Ok(buffer.clone());
        }
        // Room to grow, within what one binding can use.
        let cap = self.limits().max_storage_buffer_binding_size.max(bytes);
        let size = bytes.max(256).next_power_of_two().min(cap).div_ceil(4) * 4;
        let (buffer, allocation) = self.create_buffer(what, size, wgpu::BufferUsages::STORAGE)?;
        let buffer = Arc::new(buffer);
        slots.insert(what, (buffer.clone(), allocation));
        Ok(buffer)
    }

    /// Allocates a buffer of `bytes` for `what`, counted in [`Context::memory`]: the allocation path
    /// of every tensor and workspace (see [`Context::create_uncounted_buffer`]).
    pub(crate) fn create_buffer(
        &self,
        what: &'static str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<(wgpu::Buffer, Allocation)> {
        let buffer = self.create_uncounted_buffer(what, bytes, usage)?;
        Ok((buffer, self.track_allocation(bytes)))
    }

    /// Allocates a buffer, refused with a typed error on a lost device, beyond `max_buffer_size`, or
    /// when the device is out of memory (caught by an error scope rather than left to wgpu's
    /// uncaptured-error handler). Not counted: for short-lived staging buffers.
    pub(crate) fn create_uncounted_buffer(
        &self,
        what: &'static str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        self.check_lost()?;
        let limit = self.limits().max_buffer_size;
        if bytes > limit {
            return Err(Error::Unsupported {
                arg: what,
                value: bytes,
                limit,
                hint:
                    " bytes (the adapter's max_buffer_size): use a smaller batch or sequence length",
            });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes,
            usage,
            mapped_at_creation: false,
        });
        if pollster::block_on(scope.pop()).is_some() {
            buffer.destroy();
            return Err(Error::OutOfMemory {
                what,
                bytes,
                allocated: self.memory().current_bytes,
            });
        }
        Ok(buffer)
    }

    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    pub fn report(&self) -> &AdapterReport {
        &self.report
    }

    pub fn limits(&self) -> &wgpu::Limits {
        &self.report.limits
    }

    /// Tensor memory allocated through this context: now and at its peak since the last
    /// [`Context::reset_peak_memory`].
    pub fn memory(&self) -> MemoryStats {
        MemoryStats {
            current_bytes: self.memory.current.load(Ordering::Relaxed),
            peak_bytes: self.memory.peak.load(Ordering::Relaxed),
        }
    }

    /// Sets the peak to the current allocation.
    pub fn reset_peak_memory(&self) {
        let current = self.memory.current.load(Ordering::Relaxed);
        self.memory.peak.store(current, Ordering::Relaxed);
    }

    pub(crate) fn track_allocation(&self, bytes: u64) -> Allocation {
        let now = self.memory.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.memory.peak.fetch_max(now, Ordering::Relaxed);
        Allocation {
            bytes,
            counter: self.memory.clone(),
        }
    }

    /// Number of pipelines compiled so far (a second identical call must not add any).
    pub fn cached_pipelines(&self) -> usize {
        self.pipelines.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// Returns the cached pipeline for `shader` specialised with `constants`, compiling it once.
    pub(crate) fn pipeline(
        &self,
        shader: &'static str,
        source: impl FnOnce() -> String,
        constants: &[(&'static str, u32)],
    ) -> Arc<wgpu::ComputePipeline> {
        let relaxed = if self.untrusted_measurement {
            Some(wgpu::ShaderRuntimeChecks::unchecked())
        } else {
            crate::kernels::relaxed_runtime_checks(shader).filter(|_| self.trusted_shaders)
        };
        let key = PipelineKey {
            shader,
            constants: constants.to_vec(),
            trusted: relaxed.is_some(),
        };
        let mut cache = self.pipelines.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cache.get(&key) {
            return p.clone();
        }
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(shader),
            source: wgpu::ShaderSource::Wgsl(source().into()),
        };
        let module = match relaxed {
            // SAFETY: `relaxed_runtime_checks` lists only kernels whose loops all end (bounds from
            // uniforms, overrides and workgroup ids) and whose array indices stay below the
            // overrides that size the arrays, as its comments say for each; their tests run them
            // in this mode on lavapipe. (`untrusted_measurement` is the benchmarks' opt-in to
            // measure the others, validated against the reference there.)
            Some(checks) => unsafe { self.device.create_shader_module_trusted(desc, checks) },
            None => self.device.create_shader_module(desc),
        };
        let constants_f64: Vec<(&str, f64)> =
            constants.iter().map(|&(k, v)| (k, f64::from(v))).collect();
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(shader),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &constants_f64,
                    // Every kernel writes its workgroup memory before reading it.
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        let pipeline = Arc::new(pipeline);
        cache.insert(key, pipeline.clone());
        pipeline
    }

    /// Runs `record` with `cache` serving the bind groups of every kernel it records (see
    /// [`BindingCache`]); without one, each dispatch creates its own.
    pub fn with_binding_cache<R>(&self, cache: &mut BindingCache, record: impl FnOnce() -> R) -> R {
        cache.epoch += 1;
        let lent = std::mem::take(cache);
        let previous = self
            .binding_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(lent);
        let result = record();
        let mut slot = self.binding_cache.lock().unwrap_or_else(|e| e.into_inner());
        *cache = std::mem::replace(&mut *slot, previous).unwrap_or_default();
        result
    }

    /// The bind group of one dispatch of `pipeline`: its parameter block at binding 0 and `storage`.
    /// Served from the lent [`BindingCache`] when there is one.
    pub(crate) fn bind_group(
        &self,
        pipeline: &wgpu::ComputePipeline,
        label: &str,
        params: &[u8],
        storage: &[StorageBinding<'_>],
    ) -> wgpu::BindGroup {
        let create = |uniform: &wgpu::Buffer| {
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: uniform.as_entire_binding(),
            }];
            entries.extend(storage.iter().map(|s| wgpu::BindGroupEntry {
                binding: s.binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: s.buffer,
                    offset: s.offset,
                    size: s.size,
                }),
            }));
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(label),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            })
        };
        let new_uniform = || {
            use wgpu::util::DeviceExt;
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: params,
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                })
        };
        let mut guard = self.binding_cache.lock().unwrap_or_else(|e| e.into_inner());
        let Some(cache) = guard.as_mut() else {
            return create(&new_uniform());
        };
        let key: BindKey = (
            pipeline.clone(),
            storage
                .iter()
                .map(|s| (s.binding, s.buffer.clone(), s.offset, s.size))
                .collect(),
        );
        let epoch = cache.epoch;
        let entry = cache.entries.entry(key).or_default();
        if entry.epoch != epoch {
            entry.epoch = epoch;
            entry.used = 0;
        }
        let index = entry.used;
        entry.used += 1;
        if let Some(slot) = entry.slots.get_mut(index) {
            if slot.params != params {
                self.queue.write_buffer(&slot.uniform, 0, params);
                slot.params = params.to_vec();
            }
            cache.reused += 1;
            return slot.bind_group.clone();
        }
        let uniform = new_uniform();
        let bind_group = create(&uniform);
        entry.slots.push(BindSlot {
            uniform,
            params: params.to_vec(),
            bind_group: bind_group.clone(),
        });
        cache.created += 1;
        bind_group
    }

    /// Submits `encoder`, or refuses with [`Error::DeviceLost`] once the device is lost. Input is
    /// validated before anything is recorded, so a well-formed call raises no device error.
    pub(crate) fn submit(&self, encoder: wgpu::CommandEncoder) -> Result<()> {
        self.check_lost()?;
        self.queue.submit([encoder.finish()]);
        self.submissions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Compute passes the kernels have begun and command buffers this crate has submitted through
    /// this context so far (an embedder's own submissions of encoders it recorded into are not
    /// counted): differences around a call tell how it records.
    pub fn recorded_counts(&self) -> RecordedCounts {
        use std::sync::atomic::Ordering::Relaxed;
        RecordedCounts {
            passes: self.recorded_passes.load(Relaxed),
            submissions: self.submissions.load(Relaxed),
        }
    }

    /// Begins a compute pass labelled `label`, with timestamps around it while profiling.
    pub(crate) fn begin_pass<'e>(
        &self,
        encoder: &'e mut wgpu::CommandEncoder,
        label: &'static str,
    ) -> wgpu::ComputePass<'e> {
        self.recorded_passes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let slot = {
            let mut profiler = self.profiler.lock().unwrap_or_else(|e| e.into_inner());
            profiler.as_mut().and_then(|p| {
                let index = p.labels.len() as u32;
                (index < p.capacity).then(|| {
                    p.labels.push(label);
                    (p.query_set.clone(), 2 * index)
                })
            })
        };
        let writes = slot
            .as_ref()
            .map(|(query_set, index)| wgpu::ComputePassTimestampWrites {
                query_set,
                beginning_of_pass_write_index: Some(*index),
                end_of_pass_write_index: Some(index + 1),
            });
        encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(label),
            timestamp_writes: writes,
        })
    }

    /// `Err(`[`Error::MissingFeature`]`)` naming `what` unless the device has `SHADER_F16` (f16
    /// storage); `hint` follows the message (where the f32 path is).
    pub(crate) fn require_f16(&self, what: &'static str, hint: &'static str) -> Result<()> {
        match self.device.features().contains(wgpu::Features::SHADER_F16) {
            true => Ok(()),
            false => Err(Error::MissingFeature {
                what,
                feature: "SHADER_F16",
                adapter: self.report.name.clone(),
                hint,
            }),
        }
    }

    /// Whether the adapter is a CPU driver (lavapipe, llvmpipe, WARP), which runs workgroups as SIMD
    /// loops on host threads: kernels pick their shapes for it differently.
    pub fn is_cpu(&self) -> bool {
        self.report.device_type == wgpu::DeviceType::Cpu || self.loop_budget.is_some()
    }

    /// Starts timing every compute pass the kernels record (up to [`MAX_PROFILED_PASSES`]), for a
    /// per-kernel breakdown of what is submitted until [`Context::finish_profiling`]. Needs the
    /// `TIMESTAMP_QUERY` feature.
    pub fn start_profiling(&self) -> Result<()> {
        if !self
            .device
            .features()
            .contains(wgpu::Features::TIMESTAMP_QUERY)
        {
            return Err(Error::Unsupported {
                arg: "profiling (TIMESTAMP_QUERY feature)",
                value: 0,
                limit: 0,
                hint: "; this adapter has no timestamp queries: time whole submissions on the host",
            });
        }
        let query_set = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("pass profiler"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * MAX_PROFILED_PASSES,
        });
        *self.profiler.lock().unwrap_or_else(|e| e.into_inner()) = Some(PassProfiler {
            query_set: Arc::new(query_set),
            capacity: MAX_PROFILED_PASSES,
            labels: Vec::new(),
        });
        Ok(())
    }

    /// Stops profiling and returns each recorded pass's label and GPU milliseconds, in recording
    /// order (after waiting for the submitted work). Passes beyond the capacity are not timed.
    pub fn finish_profiling(&self) -> Result<Vec<(&'static str, f64)>> {
        let Some(p) = self
            .profiler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return Ok(Vec::new());
        };
        let n = p.labels.len() as u32;
        if n == 0 {
            return Ok(Vec::new());
        }
        let bytes = u64::from(2 * n) * 8;
        let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass profiler resolve"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass profiler readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.resolve_query_set(&p.query_set, 0..2 * n, &resolve, 0);
        encoder.copy_buffer_to_buffer(&resolve, 0, &readback, 0, bytes);
        self.queue.submit([encoder.finish()]);
        let ticks: Vec<u64> = pollster::block_on(crate::tensor::read_mapped(self, &readback))?;
        let period_ns = f64::from(self.queue.get_timestamp_period());
        Ok(p.labels
            .iter()
            .zip(ticks.chunks_exact(2))
            .map(|(&label, t)| (label, t[1].saturating_sub(t[0]) as f64 * period_ns / 1e6))
            .collect())
    }

    pub(crate) fn empty_storage(&self) -> &wgpu::Buffer {
        &self.empty_storage
    }

    /// [`Context::empty_storage`]'s counterpart for absent read-write bindings.
    pub(crate) fn empty_storage_rw(&self) -> &wgpu::Buffer {
        &self.empty_storage_rw
    }

    /// Waits until all submitted work has finished. Reports a lost device, and on devices this
    /// crate created the first device error since the last call.
    pub fn synchronize(&self) -> Result<()> {
        self.check_lost()?;
        let waited = self.device.poll(wgpu::PollType::wait_indefinitely());
        self.check_lost()?;
        waited.map_err(|e| Error::Device(e.to_string()))?;
        match self
            .uncaptured
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            Some(text) => Err(Error::Device(text)),
            None => Ok(()),
        }
    }

    /// [`Error::DeviceLost`] with the driver's reason once the device has been lost. Drivers report a
    /// loss asynchronously: the first call that waits on the GPU after it (a readback,
    /// [`Context::synchronize`]) returns the error, and from then on every call that allocates,
    /// writes or submits refuses up front.
    pub fn check_lost(&self) -> Result<()> {
        match &*self.lost.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(reason) => Err(Error::DeviceLost(reason.clone())),
            None => Ok(()),
        }
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("adapter", &self.report.name)
            .finish()
    }
}

/// Splits `total` workgroups into a 2-D grid within the 65535-per-dimension limit.
/// Returns (x, y); kernels linearise with `wg.y * grid_x + wg.x` and skip ids >= total.
pub(crate) fn grid_2d(total: u32) -> (u32, u32) {
    const MAX: u32 = 65535;
    if total <= MAX {
        (total.max(1), 1)
    } else {
        (MAX, total.div_ceil(MAX))
    }
}
