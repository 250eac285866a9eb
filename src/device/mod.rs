//! The device layer: a [`Context`] owns (or borrows) a `wgpu::Device` and `Queue`, knows the adapter's
//! limits and features, and caches compiled pipelines so nothing is compiled in the hot path.
//!
//! - this file: the context, how it is created (or wraps a user's device) and its plain accessors;
//! - `report`: the adapter report, back-end selection, adapter enumeration;
//! - `tuning`: the settings that pick kernels (family, GEMM tiles, widths, subgroups, trusted shaders);
//! - `pipelines`: the pipeline cache and the bind groups of dispatches (`BindingCache`);
//! - `memory`: counted allocations and scratch buffers;
//! - `profile`: submissions, passes and their timestamps.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

mod autotune;
mod dump;
mod memory;
mod options;
mod ordered_writes;
mod pipelines;
mod profile;
mod report;
mod tuning;
mod wait;

pub(crate) use autotune::Search;
pub use autotune::{CandidateRecord, TuningBudget, TuningMode, TuningRecord, TuningSource};
pub use memory::MemoryStats;
pub(crate) use memory::{Allocation, MemoryCounter};
pub use options::{ContextOptions, ENVIRONMENT_VARIABLES};
pub use pipelines::BindingCache;
use pipelines::PipelineKey;
pub(crate) use pipelines::{PipelineSpec, StorageBinding};
use profile::{PassProfiler, SharedPass};
pub use profile::{RecordedCounts, MAX_PROFILED_PASSES};
use report::new_instance;
pub use report::{enumerate_adapters, parse_backends, quiet_headless_start_up, AdapterReport};
pub use tuning::{
    GemmTiles, KernelChoice, KernelFamily, TiledShape, ATTENTION_WORKGROUPS, LLVMPIPE_LOOP_BUDGET,
};
pub use wait::{block_on, read_mapped};

/// A GPU device with its queue, adapter report and pipeline cache. Cheap to share behind `Arc`.
pub struct Context {
    id: ContextId,
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
    empty_storage_rw: [wgpu::Buffer; 2],
    loop_budget: Option<u32>,
    attention_workgroup: Option<u32>,
    kernel_family: Option<KernelFamily>,
    gemm_tiles: Option<GemmTiles>,
    /// The adapter's fixed subgroup size where the device has `Features::SUBGROUP`.
    subgroup_size: Option<u32>,
    subgroups_enabled: bool,
    /// [`ContextOptions::fixed_flag_builds`].
    fixed_flag_builds: Option<bool>,
    /// [`ContextOptions::atomic_gradients`], where the device has f32 atomics.
    atomic_gradients: bool,
    trusted_shaders: bool,
    /// Every kernel in a compute pass of its own, even inside [`Context::with_one_pass`].
    pass_per_kernel: bool,
    /// [`ContextOptions::unchecked_measurement`]: every kernel without runtime checks, to measure
    /// which would gain on a new adapter (benchmarks only; results are validated there, not proven).
    untrusted_measurement: bool,
    /// [`ContextOptions::unbounded_loops_measurement`]: every kernel without loop counters.
    unbounded_loops_measurement: bool,
    /// [`ContextOptions::tiled_shapes`] and [`ContextOptions::forward_splits`].
    tiled_shapes: [Option<TiledShape>; 3],
    /// [`ContextOptions::coop_forward_shape`].
    coop_forward_shape: Option<(u32, u32)>,
    forward_splits: Option<usize>,
    /// [`ContextOptions::decode_shape`].
    decode_shape: Option<(u32, u32)>,
    /// Whether this context created its device (and so installed its own error and device-lost
    /// handlers).
    owns_device: bool,
    /// Grow-only scratch storage of kernels that need a workspace the caller does not pass (the
    /// split-KV partial results of the forward). Dispatches in one queue run in order, so one buffer
    /// serves every call; a larger request replaces it (recorded work keeps the old one alive).
    scratch: Mutex<HashMap<&'static str, (wgpu::Buffer, Allocation)>>,
    /// Why the device was lost, once it has been: later waits report it instead of hanging or
    /// panicking inside wgpu.
    lost: Arc<Mutex<Option<String>>>,
    /// The first device error no error scope caught, on devices this crate created (wgpu's default
    /// handler would panic): reported by the next [`Context::synchronize`].
    uncaptured: Arc<Mutex<Option<String>>>,
    profiler: Mutex<Option<PassProfiler>>,
    /// Open [`Context::with_one_pass`] scopes, by encoder.
    shared_passes: Mutex<Vec<SharedPass>>,
    /// Writes waiting for the next compute pass ([`Context::write_in_recording_order`]).
    ordered_writes: Mutex<Vec<ordered_writes::OrderedWrite>>,
    /// Binding caches lent with [`Context::with_binding_cache`], by the thread that lent them: only
    /// that thread's recordings use (and fill) a cache.
    binding_caches: Mutex<Vec<(std::thread::ThreadId, BindingCache)>>,
    /// Debug builds: each pipeline's read-write storage bindings, to assert that no dispatch binds a
    /// buffer read-write and read-only at once (a usage conflict the argument checks must have
    /// refused before recording).
    read_write_bindings: Mutex<HashMap<wgpu::ComputePipeline, Vec<u32>>>,
    /// [`ContextOptions::dump_pipelines`].
    pipeline_dump: Option<dump::PipelineDump>,
    /// Kernels qualified (or refused) on this device at their first use, by name.
    qualified: Mutex<HashMap<&'static str, Qualification>>,
    /// [`ContextOptions::tuning`]: the choices tuned per key, their cache file and report.
    tuner: autotune::Tuner,
}

/// The outcome of a kernel's qualification on a device ([`Context::qualifications`]): a kernel
/// that wgpu cannot check against the adapter (the tensor-core attention) runs a small problem
/// against another family at its first use, and is used only if it passes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Qualification {
    /// The kernel, e.g. `attention_forward_coop`.
    pub kernel: &'static str,
    /// Whether it qualified (and so runs).
    pub passed: bool,
    /// Why it did not, or what it runs on: the reason the context also logs.
    pub detail: String,
}

/// Identifies a [`Context`] (unique within the process); see [`Context::id`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ContextId(u64);

fn next_context_id() -> ContextId {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    ContextId(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Features used when offered; none is required.
const WANTED_FEATURES: wgpu::Features = wgpu::Features::TIMESTAMP_QUERY
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::SHADER_FLOAT32_ATOMIC);

/// [`ContextOptions::atomic_gradients`] where the device has f32 atomics; logged where it was asked
/// for and the device has none.
fn atomic_gradients(options: &ContextOptions, features: wgpu::Features) -> bool {
    let available = features.contains(wgpu::Features::SHADER_FLOAT32_ATOMIC);
    if options.atomic_gradients && !available {
        log::info!(
            "wgpu-attention: atomic gradients asked for, but the device has no \
             Features::SHADER_FLOAT32_ATOMIC: the attention backward runs its dQ kernel"
        );
    }
    options.atomic_gradients && available
}

impl Context {
    /// Creates a device on the best adapter (real GPUs before CPU drivers) with the default
    /// [`ContextOptions`]. Reads no environment variable: see [`Context::from_env`] for that.
    pub fn new() -> Result<Self> {
        Self::new_with(&ContextOptions::default())
    }

    /// [`Context::new_with`] the options [`ContextOptions::from_env`] reads from the environment
    /// (`WGPU_BACKEND`, `WGPU_ADAPTER_NAME`, the `WGPU_ATTENTION_*` tuning variables): what the
    /// crate's binaries, examples and tests use.
    pub fn from_env() -> Result<Self> {
        Self::new_with(&ContextOptions::from_env()?)
    }

    /// Creates a device on the adapter selected by `options`.
    pub fn new_with(options: &ContextOptions) -> Result<Self> {
        wait::block_on("Context::new", Self::new_async(options))
    }

    /// Async form of [`Context::new_with`].
    pub async fn new_async(options: &ContextOptions) -> Result<Self> {
        let backends = options.backends.unwrap_or(wgpu::Backends::all());
        let filter = options.adapter_name.clone().filter(|f| !f.is_empty());
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
        if let Some(workgroups) = options.max_workgroups_per_dimension {
            limits.max_compute_workgroups_per_dimension = workgroups
                .min(offered.max_compute_workgroups_per_dimension)
                .max(1);
        }
        let features = adapter.features() & WANTED_FEATURES;
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("wgpu-attention"),
                required_features: features,
                required_limits: limits,
                // SAFETY: the one experimental feature requested is cooperative matrices, and no
                // kernel uses them before it has matched the GPU family's result on this device
                // (`kernels::attention::matrix_build`), as wgpu does not check a configuration.
                experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
                ..Default::default()
            })
            .await?;
        let mut ctx = Self::wrap(device, queue, options, true)?;
        ctx.report.cooperative_matrices = adapter.cooperative_matrix_properties();
        // Our device, so our handlers: an error no scope caught becomes an `Err` of the next
        // synchronisation instead of wgpu's default panic, and a loss is remembered. A user's device
        // keeps the user's handlers (see `Context::device_lost_handler`).
        ctx.device
            .set_device_lost_callback(ctx.device_lost_handler());
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
                log::error!("wgpu-attention: device error: {text}");
                uncaptured
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(text);
            }));
        Ok(ctx)
    }

    /// Wraps a device the application already owns, with the default [`ContextOptions`]: see
    /// [`Context::from_device_with`].
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue) -> Result<Self> {
        Self::from_device_with(device, queue, &ContextOptions::default())
    }

    /// Wraps a device the application already owns. The adapter, limits and features are read from
    /// the device itself (`Device::adapter_info`, `limits`, `features`); `options` chooses kernels
    /// (its adapter fields do not apply).
    ///
    /// Wrapping has no side effect on the device: the application's uncaptured-error handler and
    /// device-lost callback stay in place (wgpu keeps one of each per device), no environment
    /// variable is read, and wgpu's shader runtime checks stay on unless
    /// [`ContextOptions::trusted_shaders`] asks otherwise. To have [`Context::check_lost`] and
    /// waits report a lost device, call [`Context::device_lost_handler`]'s closure from the
    /// application's own callback (or install it as the callback). A wgpu validation error on
    /// this device goes to the application's handler; the library refuses up front every argument
    /// wgpu would reject. On a device lost without the context hearing of it, calls record nothing
    /// valid: what wgpu reports of them goes to that handler (wgpu's default one panics) and
    /// readbacks fail with [`Error::Readback`]; the library itself does not panic.
    pub fn from_device_with(
        device: wgpu::Device,
        queue: wgpu::Queue,
        options: &ContextOptions,
    ) -> Result<Self> {
        Self::wrap(device, queue, options, false)
    }

    /// What the lost-device state of this context needs to hear from wgpu's device-lost callback:
    /// install the returned closure with `device.set_device_lost_callback`, or call it from the
    /// application's own callback, so that waits and later calls report [`Error::DeviceLost`]
    /// with the driver's reason. Contexts that create their device install it themselves.
    pub fn device_lost_handler(&self) -> impl Fn(wgpu::DeviceLostReason, String) + Send + 'static {
        let lost = self.lost.clone();
        move |reason, message| {
            let text = match message.is_empty() {
                true => format!("{reason:?}"),
                false => format!("{reason:?}: {message}"),
            };
            log::error!("wgpu-attention: device lost ({text})");
            *lost.lock().unwrap_or_else(|e| e.into_inner()) = Some(text);
        }
    }

    fn wrap(
        device: wgpu::Device,
        queue: wgpu::Queue,
        options: &ContextOptions,
        owns_device: bool,
    ) -> Result<Self> {
        let limits = device.limits();
        let features = device.features();
        let info = device.adapter_info();
        // Kernels that place invocations by subgroup need its size fixed for the whole device.
        let subgroup_size = (features.contains(wgpu::Features::SUBGROUP)
            && info.subgroup_min_size == info.subgroup_max_size)
            .then_some(info.subgroup_min_size);
        let report = AdapterReport {
            name: info.name,
            backend: info.backend,
            device_type: info.device_type,
            driver: info.driver,
            driver_info: info.driver_info,
            limits,
            features,
            cooperative_matrices: Vec::new(),
        };
        let empty = |label| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: 8,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        };
        let empty_storage = empty("empty storage");
        let empty_storage_rw = [empty("empty storage rw 0"), empty("empty storage rw 1")];
        // Correctness on llvmpipe depends on this (its silent loop cap), so it comes from the
        // device's own adapter info, never from an argument the caller may leave out.
        let is_llvmpipe = [&report.name, &report.driver, &report.driver_info]
            .iter()
            .any(|s| s.to_lowercase().contains("llvmpipe"));
        let subgroups_enabled = options.subgroups.unwrap_or(true);
        let trusted_shaders = options.trusted_shaders.unwrap_or(owns_device);
        let tuner = autotune::Tuner::new(options, &device, trusted_shaders, subgroups_enabled);
        let mut ctx = Self {
            id: next_context_id(),
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
            kernel_family: options.kernel_family,
            gemm_tiles: options.gemm_tiles,
            subgroup_size,
            subgroups_enabled,
            fixed_flag_builds: options.fixed_flag_builds,
            atomic_gradients: atomic_gradients(options, features),
            trusted_shaders,
            pass_per_kernel: options.pass_per_kernel,
            untrusted_measurement: options.unchecked_measurement,
            unbounded_loops_measurement: options.unbounded_loops_measurement,
            tiled_shapes: options.tiled_shapes,
            coop_forward_shape: options.coop_forward_shape,
            forward_splits: options.forward_splits,
            decode_shape: options.decode_shape,
            owns_device,
            scratch: Mutex::default(),
            lost: Arc::default(),
            uncaptured: Arc::default(),
            profiler: Mutex::new(None),
            shared_passes: Mutex::new(Vec::new()),
            ordered_writes: Mutex::new(Vec::new()),
            binding_caches: Mutex::default(),
            read_write_bindings: Mutex::default(),
            pipeline_dump: options
                .dump_pipelines
                .as_deref()
                .map(dump::PipelineDump::new),
            qualified: Mutex::default(),
            tuner,
        };
        ctx.set_attention_workgroup(options.attention_workgroup)?;
        Ok(ctx)
    }

    /// Whether kernel `name` qualified on this device, if it has been tried.
    pub(crate) fn qualification(&self, name: &'static str) -> Option<bool> {
        let qualified = self.qualified.lock().unwrap_or_else(|e| e.into_inner());
        qualified.get(name).map(|q| q.passed)
    }

    /// Records whether kernel `name` qualified on this device, and why.
    pub(crate) fn set_qualification(&self, name: &'static str, passed: bool, detail: String) {
        let mut qualified = self.qualified.lock().unwrap_or_else(|e| e.into_inner());
        let outcome = Qualification {
            kernel: name,
            passed,
            detail,
        };
        qualified.insert(name, outcome);
    }

    /// The kernels qualified (or refused) on this device so far, by name, each with its reason:
    /// what a benchmark report should show next to a kernel family that did not run as asked.
    pub fn qualifications(&self) -> Vec<Qualification> {
        let qualified = self.qualified.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<Qualification> = qualified.values().cloned().collect();
        all.sort_by_key(|q| q.kernel);
        all
    }

    /// This context's identity: tensors it allocates carry it, so a tensor of another context is
    /// refused by name instead of failing inside wgpu.
    pub fn id(&self) -> ContextId {
        self.id
    }

    /// Whether this context created its device (rather than wrapping the application's).
    pub fn owns_device(&self) -> bool {
        self.owns_device
    }

    /// The wgpu device (the application's, for a context made with `from_device`).
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The device's queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// What the adapter is and offers: name, back end, driver, limits, features.
    pub fn report(&self) -> &AdapterReport {
        &self.report
    }

    /// The device's limits (what the kernels size their tiles and bindings from).
    pub fn limits(&self) -> &wgpu::Limits {
        &self.report.limits
    }

    /// `total` workgroups as a 2-D grid within the device's workgroups per dimension
    /// ([`grid_2d`]); more than fit (the limit squared, or `u32::MAX`) are refused as
    /// [`Error::Unsupported`] of the generic argument "workgroups".
    pub(crate) fn grid_2d(&self, total: u64) -> Result<(u32, u32)> {
        self.grid_2d_for(
            total,
            "workgroups",
            " (the device's max_compute_workgroups_per_dimension squared): split the call into smaller ones",
        )
    }

    /// [`Context::grid_2d`], naming what the workgroups cover and what to do in the error.
    pub(crate) fn grid_2d_for(
        &self,
        total: u64,
        arg: &'static str,
        hint: &'static str,
    ) -> Result<(u32, u32)> {
        let per_dimension = self
            .report
            .limits
            .max_compute_workgroups_per_dimension
            .max(1);
        let limit = (per_dimension as u64 * per_dimension as u64).min(u32::MAX as u64);
        if total > limit {
            return Err(Error::Unsupported {
                arg,
                value: total,
                limit,
                hint,
            });
        }
        Ok(grid_2d(total as u32, per_dimension))
    }

    /// Whether the adapter is a CPU driver (lavapipe, llvmpipe, WARP), which runs workgroups as SIMD
    /// loops on host threads: kernels pick their shapes for it differently.
    pub fn is_cpu(&self) -> bool {
        self.report.device_type == wgpu::DeviceType::Cpu || self.loop_budget.is_some()
    }

    /// `Err(`[`Error::MissingFeature`]`)` naming `what` unless the device has `SHADER_F16` (f16
    /// storage and arithmetic); `hint` follows the message (where the f32 path is). What every f16
    /// path checks first, the layers built on the engine included.
    pub fn require_f16(&self, what: &'static str, hint: &'static str) -> Result<()> {
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
    /// Two of them: WebGPU refuses a dispatch whose writable bindings overlap, even unused dummies
    /// (Chromium checks this; wgpu 30 does not), so a kernel with two absent read-write bindings
    /// binds slot 0 and slot 1.
    pub(crate) fn empty_storage_rw(&self, slot: usize) -> &wgpu::Buffer {
        &self.empty_storage_rw[slot]
    }

    /// Waits until all submitted work has finished. Reports a lost device, and on devices this
    /// crate created the first device error since the last call. In a browser, where nothing may
    /// block, it waits for nothing: use [`Context::synchronize_async`] there.
    pub fn synchronize(&self) -> Result<()> {
        self.check_lost()?;
        let waited = self.device.poll(wgpu::PollType::wait_indefinitely());
        self.check_lost()?;
        waited.map_err(|e| Error::Device(e.to_string()))?;
        self.take_device_error()
    }

    /// Async form of [`Context::synchronize`]: in a browser it resolves once the queue reports the
    /// submitted work done (natively it is `synchronize`).
    pub async fn synchronize_async(&self) -> Result<()> {
        #[cfg(target_arch = "wasm32")]
        {
            self.check_lost()?;
            let (sender, receiver) = futures_intrusive::channel::shared::oneshot_channel();
            self.queue.on_submitted_work_done(move || {
                let _ = sender.send(());
            });
            receiver.receive().await;
            self.check_lost()?;
            self.take_device_error()
        }
        #[cfg(not(target_arch = "wasm32"))]
        self.synchronize()
    }

    /// The first device error since the last call, reported by our uncaptured-error handler.
    pub(crate) fn take_device_error(&self) -> Result<()> {
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

    /// Refuses argument `arg` made by another context (`made_by`; `None` for a buffer of the
    /// application's own): its buffer lives on another device, or in another context's
    /// pipelines and memory account.
    pub(crate) fn check_owns(&self, arg: &'static str, made_by: Option<ContextId>) -> Result<()> {
        match made_by {
            Some(context) if context != self.id => Err(Error::ForeignTensor {
                arg,
                adapter: self.report.name.clone(),
            }),
            _ => Ok(()),
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

/// Splits `total` workgroups into a 2-D grid of at most `max` per dimension: (x, y), x = `max`
/// where one row is not enough. Kernels linearise with `wg.y * grid_x + wg.x` and skip ids >= total.
pub(crate) fn grid_2d(total: u32, max: u32) -> (u32, u32) {
    let max = max.max(1);
    if total <= max {
        (total.max(1), 1)
    } else {
        (max, total.div_ceil(max))
    }
}
