//! The device layer: a [`Context`] owns (or borrows) a `wgpu::Device` and `Queue`, knows the adapter's
//! limits and features, and caches compiled pipelines so nothing is compiled in the hot path.
//!
//! - this file: the context, how it is created (or wraps a user's device) and its plain accessors;
//! - `report`: the adapter report, back-end selection, adapter enumeration;
//! - `tuning`: the settings that pick kernels (family, GEMM tiles, widths, subgroups, trusted shaders);
//! - `pipelines`: the pipeline cache and the bind groups of dispatches (`BindingCache`);
//! - `memory`: counted allocations and scratch buffers;
//! - `profile`: submissions, passes and their timestamps.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

mod memory;
mod pipelines;
mod profile;
mod report;
mod tuning;

pub use memory::MemoryStats;
pub(crate) use memory::{Allocation, MemoryCounter};
pub use pipelines::BindingCache;
use pipelines::PipelineKey;
pub(crate) use pipelines::StorageBinding;
use profile::{PassProfiler, SharedPass};
pub use profile::{RecordedCounts, MAX_PROFILED_PASSES};
use report::{backends_from_env, new_instance};
pub use report::{enumerate_adapters, parse_backends, quiet_headless_start_up, AdapterReport};
pub use tuning::{GemmTiles, KernelFamily, ATTENTION_WORKGROUPS, LLVMPIPE_LOOP_BUDGET};

/// How [`Context::new_with`] picks its adapter.
#[derive(Clone, Debug, Default)]
pub struct ContextOptions {
    /// Back ends to consider. `None`: `WGPU_BACKEND` (vulkan, gl, metal, dx12) or all of them.
    pub backends: Option<wgpu::Backends>,
    /// Case-insensitive substring of the adapter name. `None`: `WGPU_ADAPTER_NAME`, or any adapter.
    pub adapter_name: Option<String>,
    /// Request at most this much workgroup storage per workgroup (bytes), to run the kernels as on a
    /// smaller device (WebGPU's default limit is 16384). `None`: what the adapter offers.
    pub max_workgroup_storage: Option<u32>,
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
    /// Every kernel in a compute pass of its own, even inside [`Context::with_one_pass`].
    pass_per_kernel: bool,
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
    /// Open [`Context::with_one_pass`] scopes, by encoder.
    shared_passes: Mutex<Vec<SharedPass>>,
    binding_cache: Mutex<Option<BindingCache>>,
}

/// Features used when offered; none is required.
const WANTED_FEATURES: wgpu::Features = wgpu::Features::TIMESTAMP_QUERY
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP);

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
        limits.max_compute_workgroup_storage_size = offered
            .max_compute_workgroup_storage_size
            .min(options.max_workgroup_storage.unwrap_or(u32::MAX));
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
            pass_per_kernel: false,
            untrusted_measurement: false,
            scratch: Mutex::default(),
            lost,
            uncaptured: Arc::default(),
            profiler: Mutex::new(None),
            shared_passes: Mutex::new(Vec::new()),
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
        if let Ok(value) = std::env::var("WGPU_ATTENTION_PASS_PER_KERNEL") {
            match value.trim() {
                "1" | "on" => ctx.pass_per_kernel = true,
                "0" | "off" => {}
                _ => eprintln!(
                    "wgpu-attention: ignoring WGPU_ATTENTION_PASS_PER_KERNEL={value}: use on or off"
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

    /// Whether the adapter is a CPU driver (lavapipe, llvmpipe, WARP), which runs workgroups as SIMD
    /// loops on host threads: kernels pick their shapes for it differently.
    pub fn is_cpu(&self) -> bool {
        self.report.device_type == wgpu::DeviceType::Cpu || self.loop_budget.is_some()
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
