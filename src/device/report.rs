//! What a context runs on: the adapter report, back-end selection and adapter enumeration.

use crate::error::{Error, Result};
use std::fmt;

/// What the context runs on, for logs and benchmark reports.
#[derive(Clone, Debug)]
pub struct AdapterReport {
    /// The adapter's name.
    pub name: String,
    /// Its back end (Vulkan, Metal, DX12, GL).
    pub backend: wgpu::Backend,
    /// Discrete, integrated, virtual, CPU or other.
    pub device_type: wgpu::DeviceType,
    /// The driver's name.
    pub driver: String,
    /// The driver's version text.
    pub driver_info: String,
    /// The device's limits.
    pub limits: wgpu::Limits,
    /// The device's enabled features.
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

/// Parses a back-end name as accepted by `WGPU_BACKEND`.
pub fn parse_backends(name: &str) -> Result<wgpu::Backends> {
    let backends = wgpu::Backends::from_comma_list(name);
    if backends.is_empty() {
        return Err(Error::UnknownBackend(name.to_string()));
    }
    Ok(backends)
}

/// Lists the adapters of the given back ends (default: all).
pub fn enumerate_adapters(backends: Option<wgpu::Backends>) -> Result<Vec<wgpu::AdapterInfo>> {
    let backends = backends.unwrap_or(wgpu::Backends::all());
    let instance = new_instance(backends);
    let adapters = super::wait::block_on("enumerate_adapters", async {
        Ok(instance.enumerate_adapters(backends).await)
    })?;
    Ok(adapters.iter().map(|a| a.get_info()).collect())
}

/// Keeps a headless run's start-up quiet on Linux. Mesa's Vulkan device-selection layer
/// (`VK_LAYER_MESA_device_select`, installed with Mesa's drivers) connects to the Wayland display
/// to find the desktop's GPU whenever an instance enables the Wayland surface extension, which wgpu
/// 30 enables whenever the driver offers it, with no option to leave it out; without a session
/// libwayland prints
/// `error: XDG_RUNTIME_DIR is invalid or not set in the environment.` twice, harmless but alarming.
/// With no display session (`WAYLAND_DISPLAY` and `DISPLAY` unset) this sets `NODEVICE_SELECT=1`,
/// the layer's own off switch, unless the variable is already set. The layer only reorders GPUs for
/// a desktop; [`Context`](super::Context) ranks adapters itself, and `WGPU_BACKEND` and
/// `WGPU_ADAPTER_NAME` work as before.
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

pub(super) fn new_instance(backends: wgpu::Backends) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    wgpu::Instance::new(desc)
}
