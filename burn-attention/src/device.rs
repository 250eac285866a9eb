//! One wgpu device for burn and for the attention kernels: registration (burn's device and the
//! [`Context`] wrapping the same `wgpu::Device`) and the lookup from a tensor's device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::wgpu::WgpuDevice;
use burn::backend::DispatchDevice;
use burn::tensor::wgpu::{WgpuOptions, WgpuSetup};
use burn::tensor::Device;
use wgpu_attention::{Context, ContextOptions};

use crate::{Error, Result};

/// Contexts by the burn device they share a `wgpu::Device` with.
fn registry() -> &'static Mutex<HashMap<WgpuDevice, Arc<Context>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<WgpuDevice, Arc<Context>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Brings up burn's wgpu runtime as `options` say (`Device::wgpu_options()`, burn's builder: adapter
/// kind, graphics API, memory) and wraps the same `wgpu::Device` in a [`Context`] for the attention
/// kernels, which `attention` configures. Returns the burn device to create tensors on
/// (`.autodiff()` for training).
///
/// The device is brought up here, as [`Context::new`] brings up its own: the kernels the library
/// lists as safe run without wgpu's shader runtime checks unless `attention` sets
/// `trusted_shaders` (the checks cost the fused kernels much of their speed on GPUs: benchmarks/HISTORY.md).
///
/// Call it before burn first touches that device: burn does not hand out the `wgpu::Device` of a
/// runtime it already brought up. An application that creates its own wgpu device registers it
/// with [`register_setup`] instead.
pub fn init(options: WgpuOptions, attention: &ContextOptions) -> Result<Device> {
    let (device, setup) = options
        .init_with_setup()
        .map_err(|e| Error::Burn(e.to_string()))?;
    let mut attention = attention.clone();
    attention.trusted_shaders.get_or_insert(true);
    let ctx = Context::from_device_with(setup.device, setup.queue, &attention)?;
    insert(wgpu_device_of("device", &device)?, ctx);
    Ok(device)
}

/// Registers a wgpu setup the application made (instance, adapter, device, queue) with burn and
/// wraps its device for the attention kernels. Returns the burn device. The device's error handler
/// and lost callback stay the application's, and wgpu's shader runtime checks stay on unless
/// `attention` sets `trusted_shaders` ([`Context::from_device_with`]).
pub fn register_setup(setup: WgpuSetup, attention: &ContextOptions) -> Result<Device> {
    let (wgpu_device, queue) = (setup.device.clone(), setup.queue.clone());
    let device = Device::wgpu_options()
        .setup(setup)
        .init()
        .map_err(|e| Error::Burn(e.to_string()))?;
    let ctx = Context::from_device_with(wgpu_device, queue, attention)?;
    insert(wgpu_device_of("device", &device)?, ctx);
    Ok(device)
}

fn insert(device: WgpuDevice, ctx: Context) {
    log::info!(
        "burn-attention: {device:?} on {} ({:?})",
        ctx.report().name,
        ctx.report().backend
    );
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(device, Arc::new(ctx));
}

/// The attention [`Context`] sharing a registered burn device's `wgpu::Device` (with or without
/// autodiff): its adapter report, memory statistics, profiling. [`Error::Device`] for a device not
/// registered with [`init`] or [`register_setup`].
pub fn context(device: &Device) -> Result<Arc<Context>> {
    context_of("device", device)
}

/// The wgpu device of a burn device, through autodiff: the device the kernels run on, or a typed
/// error naming `arg` for a device of another back end.
pub(crate) fn wgpu_device_of(arg: &'static str, device: &Device) -> Result<WgpuDevice> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cubecl::Device::Wgpu(wgpu)) => Ok(wgpu.clone()),
        other => Err(not_wgpu(arg, other)),
    }
}

/// The context registered for a burn device, or a typed error naming `arg` (another back end, or a
/// wgpu device not registered here).
pub(crate) fn context_of(arg: &'static str, device: &Device) -> Result<Arc<Context>> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cube) => cube_context(arg, cube),
        other => Err(not_wgpu(arg, other)),
    }
}

/// [`context_of`] for the device of a cubecl tensor (what the op's implementation holds).
pub(crate) fn cube_context(arg: &'static str, device: &cubecl::Device) -> Result<Arc<Context>> {
    let cubecl::Device::Wgpu(wgpu) = device else {
        return Err(not_wgpu(arg, device));
    };
    let registered = registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(wgpu)
        .cloned();
    registered.ok_or_else(|| Error::Device {
        arg,
        found: format!("{wgpu:?}"),
        message: "was not registered: create it with burn_attention::init or register_setup so \
                  the kernels share burn's wgpu device"
            .into(),
    })
}

fn not_wgpu(arg: &'static str, found: &impl std::fmt::Debug) -> Error {
    Error::Device {
        arg,
        found: format!("{found:?}"),
        message: "is not a wgpu device: the fused kernels run on wgpu devices registered with \
                  burn_attention::init or register_setup"
            .into(),
    }
}
