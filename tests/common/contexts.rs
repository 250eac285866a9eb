//! GPU contexts for every back end under test (native only: a browser test makes its own, async).

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::{BACKWARD_ATOL, BACKWARD_RTOL, FORWARD_ATOL, FORWARD_RTOL};
use wgpu_attention::{Context, ContextOptions, KernelFamily};

/// Back ends the suite must run on: `WGPU_ATTENTION_TEST_BACKENDS` (comma list), default
/// `vulkan,gl` (lavapipe and llvmpipe in CI). A missing one fails the test with instructions,
/// unless `WGPU_ATTENTION_ALLOW_NO_GPU=1`, which skips it.
fn backends_under_test() -> Vec<String> {
    std::env::var("WGPU_ATTENTION_TEST_BACKENDS")
        .unwrap_or_else(|_| "vulkan,gl".into())
        .split(',')
        .map(|s| s.trim().to_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

fn contexts_cell() -> &'static Vec<(String, Arc<Context>)> {
    static CONTEXTS: OnceLock<Vec<(String, Arc<Context>)>> = OnceLock::new();
    CONTEXTS.get_or_init(|| {
        let allow_missing = std::env::var("WGPU_ATTENTION_ALLOW_NO_GPU").is_ok_and(|v| v == "1");
        let mut out = Vec::new();
        for name in backends_under_test() {
            let backends = wgpu_attention::parse_backends(&name)
                .unwrap_or_else(|e| panic!("WGPU_ATTENTION_TEST_BACKENDS: {e}"));
            let opts = ContextOptions::from_env().unwrap().backends(backends);
            match Context::new_with(&opts) {
                Ok(ctx) => {
                    eprintln!("[{name}] {}", ctx.report().name);
                    out.push((name, Arc::new(ctx)));
                }
                Err(e) if allow_missing => eprintln!("skipping back end {name}: {e}"),
                Err(e) => panic!(
                    "no adapter for back end {name}: {e}\nInstall a driver (apt-get install mesa-vulkan-drivers), \
                     choose back ends with WGPU_ATTENTION_TEST_BACKENDS=vulkan|gl|metal|dx12, \
                     or set WGPU_ATTENTION_ALLOW_NO_GPU=1 to skip GPU tests explicitly."
                ),
            }
        }
        out
    })
}

/// Runs `f` once per back end under test, on its shared context, which no other test uses
/// meanwhile (see [`usage_lock`]).
pub fn for_each_backend(f: impl Fn(&str, &Context) + Sync) {
    at_once(
        contexts_cell().iter().enumerate(),
        |(index, (name, ctx))| {
            let _guard = usage_lock(name, index, Some(&SHARED_LOCKS[index.min(LOCKS - 1)]));
            f(name, ctx);
        },
    );
}

/// Runs `run` on every item, each on a thread of its own, all at once, and re-raises the first
/// panic. Each back end and kernel family has its own context, and lavapipe and llvmpipe compile a
/// pipeline on the thread that submits its first dispatch: on a cold shader cache one test then
/// compiles on every core, not one (`benchmarks/ci-time-2026-11-29/`). GL contexts still take turns
/// ([`usage_lock`]).
fn at_once<T: Send>(items: impl IntoIterator<Item = T>, run: impl Fn(T) + Sync) {
    let run = &run;
    std::thread::scope(|scope| {
        let threads: Vec<_> = items
            .into_iter()
            .map(|item| scope.spawn(move || run(item)))
            .collect();
        for thread in threads {
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
}

/// The fused attention kernel families every attention test runs: both run on every adapter (the GPU
/// family is forced on CPU drivers so that CI proves it on lavapipe and llvmpipe).
pub const FAMILIES: [KernelFamily; 2] = [KernelFamily::CpuDriver, KernelFamily::Gpu];

/// The families of the forward tests: the tensor-core family (its portable build here) too. Its
/// backward has a test of its own (`tests/engine/attention_backward.rs`), on its own tolerance.
pub const FORWARD_FAMILIES: [KernelFamily; 3] = [
    KernelFamily::CpuDriver,
    KernelFamily::Gpu,
    KernelFamily::Coop,
];

/// Whether the family matrices run `family` on back end `backend`. The tensor-core family's portable
/// build is not run on GL: no GL adapter has cooperative matrices, so it runs there only when forced,
/// its GLSL is translated and validated for every kernel by `tests/engine/shaders.rs`, llvmpipe compiles it
/// with the same LLVM as lavapipe (where the whole matrix runs it), and each of its pipelines costs
/// 2-6 s to compile on a cold cache (`benchmarks/ci-time-2026-11-27/`). `coop_forward_shape_override`
/// still runs it on GL.
pub fn in_family_matrix(backend: &str, family: KernelFamily) -> bool {
    !(backend == "gl" && family == KernelFamily::Coop)
}

/// The forward tolerances of `ctx`'s kernel family `(atol, rtol)`: f32's, or the tensor-core
/// family's (inputs rounded to f16).
pub fn forward_tolerances(ctx: &Context) -> (f64, f64) {
    match ctx.kernel_family() {
        KernelFamily::Coop => (
            wgpu_attention::reference::compare::TENSOR_CORE_ATOL,
            wgpu_attention::reference::compare::TENSOR_CORE_RTOL,
        ),
        _ => (FORWARD_ATOL, FORWARD_RTOL),
    }
}

/// The backward tolerances of `ctx`'s kernel family `(atol, rtol)`: f32's, or the tensor-core
/// family's (operands rounded to f16).
pub fn backward_tolerances(ctx: &Context) -> (f64, f64) {
    match ctx.kernel_family() {
        KernelFamily::Coop => (
            wgpu_attention::reference::compare::TENSOR_CORE_ATOL,
            wgpu_attention::reference::compare::TENSOR_CORE_RTOL,
        ),
        _ => (BACKWARD_ATOL, BACKWARD_RTOL),
    }
}

/// Runs `f` on a fresh context of every back end whose family matrix has the tensor-core family
/// (Vulkan here), running it, adjusted by `configure`.
pub fn for_tensor_core_family_with(
    configure: impl Fn(&mut Context) + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    each_family_with(&[KernelFamily::Coop], configure, f);
}

/// Runs `f` once per back end under test and forward kernel family ([`FORWARD_FAMILIES`]).
pub fn for_each_forward_family(f: impl Fn(&str, &Context) + Sync) {
    each_family(&FORWARD_FAMILIES, f);
}

/// [`for_each_forward_family`] on fresh contexts whose loop budget is `budget`.
pub fn for_each_forward_family_with_loop_budget(budget: u32, f: impl Fn(&str, &Context) + Sync) {
    each_family_with(
        &FORWARD_FAMILIES,
        |ctx| ctx.set_loop_budget(Some(budget)),
        f,
    );
}

/// A shared context of one back end and kernel family: `(backend/family, back end index, family,
/// context)`.
type FamilyContext = (String, usize, KernelFamily, Arc<Context>);

/// Contexts of every back end under test, one per kernel family of [`FORWARD_FAMILIES`], created
/// once.
fn family_contexts() -> &'static Vec<FamilyContext> {
    static CONTEXTS: OnceLock<Vec<FamilyContext>> = OnceLock::new();
    CONTEXTS.get_or_init(|| {
        let mut out = Vec::new();
        for (index, (name, shared)) in contexts_cell().iter().enumerate() {
            for family in FORWARD_FAMILIES {
                if !in_family_matrix(name, family) {
                    continue;
                }
                let mut ctx = fresh_context(name, shared);
                ctx.set_kernel_family(Some(family));
                let label = format!("{name}/{}", family.name());
                out.push((label, index, family, Arc::new(ctx)));
            }
        }
        out
    })
}

/// Runs `f` once per back end under test and fused attention kernel family; the name passed is
/// `backend/family`.
pub fn for_each_family(f: impl Fn(&str, &Context) + Sync) {
    each_family(&FAMILIES, f);
}

/// Runs `f` on the shared context of every back end and each of `families`.
fn each_family(families: &[KernelFamily], f: impl Fn(&str, &Context) + Sync) {
    let chosen = family_contexts()
        .iter()
        .enumerate()
        .filter(|(_, (_, _, family, _))| families.contains(family));
    at_once(chosen, |(slot, (name, index, _, ctx))| {
        let backend = name.split('/').next().unwrap_or(name);
        let own = &FAMILY_LOCKS[slot.min(FAMILY_LOCKS.len() - 1)];
        let _guard = usage_lock(backend, *index, Some(own));
        f(name, ctx);
    });
}

/// Like [`for_each_family`], on fresh contexts made with options `adjust` changed.
pub fn for_each_family_with_options(
    adjust: impl Fn(ContextOptions) -> ContextOptions + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    each_family_with_options(&FAMILIES, adjust, |_| {}, f);
}

/// Like [`for_each_family`], on fresh contexts that `configure` has adjusted.
pub fn for_each_family_with(
    configure: impl Fn(&mut Context) + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    each_family_with(&FAMILIES, configure, f);
}

/// Like [`for_each_forward_family`], on fresh contexts made with options `adjust` changed.
pub fn for_each_forward_family_with_options(
    adjust: impl Fn(ContextOptions) -> ContextOptions + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    each_family_with_options(&FORWARD_FAMILIES, adjust, |_| {}, f);
}

/// Runs `f` on a fresh context of every back end and each of `families`, adjusted by `configure`.
fn each_family_with(
    families: &[KernelFamily],
    configure: impl Fn(&mut Context) + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    each_family_with_options(families, |opts| opts, configure, f);
}

/// Runs `f` on a fresh context of every back end and each of `families`, made with options
/// `adjust` changed, then adjusted by `configure`.
fn each_family_with_options(
    families: &[KernelFamily],
    adjust: impl Fn(ContextOptions) -> ContextOptions + Sync,
    configure: impl Fn(&mut Context) + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    let chosen = contexts_cell()
        .iter()
        .enumerate()
        .flat_map(|(index, (name, shared))| {
            families
                .iter()
                .filter(|&&family| in_family_matrix(name, family))
                .map(move |&family| (index, name, shared, family))
        });
    at_once(chosen, |(index, name, shared, family)| {
        let _guard = usage_lock(name, index, None);
        let mut ctx = fresh_context_with_options(name, shared, &adjust);
        ctx.set_kernel_family(Some(family));
        configure(&mut ctx);
        f(&format!("{name}/{}", family.name()), &ctx);
    });
}

/// A new context on the adapter of `shared` (`name`: its back end).
pub fn fresh_context(name: &str, shared: &Context) -> Context {
    fresh_context_with_options(name, shared, |opts| opts)
}

/// A new context on the adapter of `shared` (`name`: its back end), with options `adjust` changed.
pub fn fresh_context_with_options(
    name: &str,
    shared: &Context,
    adjust: impl FnOnce(ContextOptions) -> ContextOptions,
) -> Context {
    let opts = ContextOptions::from_env()
        .unwrap()
        .backends(wgpu_attention::parse_backends(name).unwrap())
        .adapter_name(shared.report().name.clone());
    Context::new_with(&adjust(opts)).unwrap()
}

/// Like [`for_each_backend`], on a fresh context of each back end made with options `adjust`
/// changed (given the back end's name).
pub fn for_each_backend_with_options(
    adjust: impl Fn(&str, ContextOptions) -> ContextOptions + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    each_backend_fresh(adjust, |_| {}, f);
}

/// Like [`for_each_backend`], on a fresh context of each back end that requested at most `bytes` of
/// workgroup storage (WebGPU's default is 16384), with the GPU kernel family.
pub fn for_each_backend_with_storage(bytes: u32, f: impl Fn(&str, &Context) + Sync) {
    for_each_backend_with_storage_and(bytes, |_| {}, f);
}

/// [`for_each_backend_with_storage`] with each context adjusted by `configure` first.
pub fn for_each_backend_with_storage_and(
    bytes: u32,
    configure: impl Fn(&mut Context) + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    each_backend_fresh(
        |_, mut opts| {
            opts.max_workgroup_storage = Some(bytes);
            opts
        },
        |ctx| {
            ctx.set_kernel_family(Some(KernelFamily::Gpu));
            configure(ctx);
            assert!(ctx.limits().max_compute_workgroup_storage_size <= bytes);
        },
        f,
    );
}

/// Runs `f` on a fresh context of every back end, all at once, made with options `adjust` changed
/// (given the back end's name), then adjusted by `configure`.
fn each_backend_fresh(
    adjust: impl Fn(&str, ContextOptions) -> ContextOptions + Sync,
    configure: impl Fn(&mut Context) + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    at_once(
        contexts_cell().iter().enumerate(),
        |(index, (name, shared))| {
            let _guard = usage_lock(name, index, None);
            let mut ctx = fresh_context_with_options(name, shared, |opts| adjust(name, opts));
            configure(&mut ctx);
            f(name, &ctx);
        },
    );
}

/// Locks kept per back end under test (more share the last).
const LOCKS: usize = 4;
/// One per shared context of [`contexts_cell`].
static SHARED_LOCKS: [Mutex<()>; LOCKS] = [const { Mutex::new(()) }; LOCKS];
/// One per shared context of [`family_contexts`].
static FAMILY_LOCKS: [Mutex<()>; 16] = [const { Mutex::new(()) }; 16];

/// What a test holds while it uses a context of back end `name` (the `index`-th under test), `own`
/// being the context's lock (`None` for a fresh context, which no other test sees).
/// - GL: one lock for the back end, whatever the context: wgpu's GL back end gives up on its
///   context lock when another thread holds it through a long dispatch.
/// - Any other: the context's own lock, so that a test that counts a shared context's pipelines or
///   bind groups sees only its own work, while tests on different contexts run at once. lavapipe
///   compiles a pipeline at its first dispatch on the device's queue thread: a cold shader cache
///   then compiles on both cores, not one (`benchmarks/ci-time-2026-11-28/`).
fn usage_lock(
    name: &str,
    index: usize,
    own: Option<&'static Mutex<()>>,
) -> Option<MutexGuard<'static, ()>> {
    static GL_LOCKS: [Mutex<()>; LOCKS] = [const { Mutex::new(()) }; LOCKS];
    let lock = match name {
        "gl" => Some(&GL_LOCKS[index.min(LOCKS - 1)]),
        _ => own,
    };
    lock.map(|l| l.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Like [`for_each_backend`], on a fresh context of each back end that `configure` has adjusted.
pub fn for_each_backend_with(
    configure: impl Fn(&mut Context) + Sync,
    f: impl Fn(&str, &Context) + Sync,
) {
    each_backend_fresh(|_, opts| opts, configure, f);
}

/// Like [`for_each_backend`], on a fresh context of each back end whose loop budget is `budget`, so
/// that kernels split their long loops into many dispatches (the path llvmpipe takes on long
/// sequences) at test sizes.
pub fn for_each_backend_with_loop_budget(budget: u32, f: impl Fn(&str, &Context) + Sync) {
    for_each_backend_with(|ctx| ctx.set_loop_budget(Some(budget)), f);
}

/// [`for_each_backend_with_loop_budget`] for every kernel family.
pub fn for_each_family_with_loop_budget(budget: u32, f: impl Fn(&str, &Context) + Sync) {
    for_each_family_with(|ctx| ctx.set_loop_budget(Some(budget)), f);
}

/// A device on the first Vulkan adapter created with WebGPU's default limits (8 storage buffers per
/// stage, 16 KiB of workgroup storage), as an application might hand one over; `None` without one.
pub fn vulkan_device_with_default_limits() -> Option<(wgpu::Device, wgpu::Queue)> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN));
    let adapter = adapters.into_iter().next()?;
    let descriptor = wgpu::DeviceDescriptor {
        required_limits: wgpu::Limits::defaults(),
        ..Default::default()
    };
    Some(pollster::block_on(adapter.request_device(&descriptor)).unwrap())
}
