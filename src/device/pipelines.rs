//! Compiled pipelines (cached by shader and override constants, nothing compiled in the hot path)
//! and the bind groups of their dispatches (cached across recordings with a [`BindingCache`]).

use super::dump::runtime_checks_name;
use super::Context;
use std::collections::HashMap;
use std::sync::Arc;

/// Cache key of a compiled pipeline: the kernel's name (with what changes its code), its override
/// constants, the sizes its source declares besides them, and whether it was compiled with the
/// kernel's relaxed runtime checks. The label is formatted from the first two on a miss only.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(super) struct PipelineKey {
    name: String,
    constants: Vec<(&'static str, u32)>,
    sizes: Vec<(&'static str, u32)>,
    trusted: bool,
}

/// One pipeline as a kernel asks for it: what [`Context::compiled`] keys, labels and compiles.
pub(crate) struct PipelineSpec<'a, S: FnOnce() -> String> {
    /// The kernel's name with what changes its code: unique per source together with `sizes`
    /// (the label adds the constants: [`crate::kernels::constants_label`]).
    pub name: String,
    /// Constants the source declares that the label leaves out (array sizes the constants imply).
    pub sizes: &'a [(&'static str, u32)],
    /// The WGSL source, built only on a cache miss.
    pub source: S,
    /// Override constants.
    pub constants: &'a [(&'static str, u32)],
    /// The runtime checks the kernel goes without when the context trusts its kernels.
    pub relaxed_checks: Option<wgpu::ShaderRuntimeChecks>,
}

/// One storage binding of a kernel: `size` bytes of `buffer` from `offset` (`None`: to its end).
pub(crate) struct StorageBinding<'a> {
    pub binding: u32,
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub size: Option<wgpu::BufferSize>,
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

impl Context {
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
        self.compiled(PipelineSpec {
            name: shader.to_string(),
            sizes: &[],
            source,
            constants,
            relaxed_checks: crate::kernels::relaxed_runtime_checks(shader),
        })
    }

    /// Returns the cached pipeline of `spec`, compiling it once.
    pub(crate) fn compiled(
        &self,
        spec: PipelineSpec<'_, impl FnOnce() -> String>,
    ) -> Arc<wgpu::ComputePipeline> {
        let PipelineSpec {
            name,
            sizes,
            source,
            constants,
            relaxed_checks,
        } = spec;
        let relaxed = if self.untrusted_measurement {
            Some(wgpu::ShaderRuntimeChecks::unchecked())
        } else if self.unbounded_loops_measurement {
            let mut checks = wgpu::ShaderRuntimeChecks::checked();
            checks.force_loop_bounding = false;
            Some(checks)
        } else {
            relaxed_checks.filter(|_| self.trusted_shaders)
        };
        let key = PipelineKey {
            name,
            constants: constants.to_vec(),
            sizes: sizes.to_vec(),
            trusted: relaxed.is_some(),
        };
        let mut cache = self.pipelines.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cache.get(&key) {
            return p.clone();
        }
        let label = &crate::kernels::constants_label(key.name.clone(), constants);
        let source = source();
        let read_write = cfg!(debug_assertions).then(|| read_write_bindings(&source));
        if cfg!(debug_assertions) {
            let limit = self.limits().max_compute_workgroup_storage_size as u64;
            if let Some(bytes) = workgroup_bytes(&source, constants) {
                assert!(
                    bytes <= limit,
                    "kernel {} uses {bytes} B of workgroup memory, over the device's {limit} B: \
                     its host wrapper must size its tiles from the limit",
                    label
                );
            }
        }
        if let Some(dump) = &self.pipeline_dump {
            // Before compiling, so a kernel the driver rejects is in the dump too.
            dump.write(
                label,
                &source,
                constants,
                runtime_checks_name(relaxed.as_ref()),
            );
        }
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
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
                label: Some(label),
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
        if let Some(bindings) = read_write {
            self.read_write_bindings
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(pipeline.clone(), bindings);
        }
        let pipeline = Arc::new(pipeline);
        cache.insert(key, pipeline.clone());
        pipeline
    }

    /// Runs `record` with `cache` serving the bind groups of every kernel it records on this thread
    /// (see [`BindingCache`]); without one, each dispatch creates its own. Recordings on other
    /// threads sharing the context neither use nor fill `cache`, so it holds only its owner's work.
    pub fn with_binding_cache<R>(&self, cache: &mut BindingCache, record: impl FnOnce() -> R) -> R {
        cache.epoch += 1;
        let thread = std::thread::current().id();
        self.binding_caches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((thread, std::mem::take(cache)));
        // Give the cache back even if `record` panics, so a caught panic leaves no stale entry.
        struct Return<'a> {
            ctx: &'a Context,
            thread: std::thread::ThreadId,
            cache: &'a mut BindingCache,
        }
        impl Drop for Return<'_> {
            fn drop(&mut self) {
                let mut lent = self
                    .ctx
                    .binding_caches
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                // The innermost cache this thread lent is the last of its entries.
                if let Some(i) = lent.iter().rposition(|(t, _)| *t == self.thread) {
                    *self.cache = lent.remove(i).1;
                }
            }
        }
        let _return = Return {
            ctx: self,
            thread,
            cache,
        };
        record()
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
        if cfg!(debug_assertions) {
            self.assert_no_usage_conflict(pipeline, label, storage);
        }
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
        // Written through the queue rather than mapped at creation: on a device lost without the
        // context hearing of it (a wrapped device whose application forwards nothing), mapping
        // panics inside wgpu, while an unmapped buffer and a queued write do not. On a device the
        // context knows is lost nothing is written: the buffer is invalid, a write to it a
        // validation error (a panic under wgpu's default handler), and nothing recorded with it
        // will be submitted (`Context::submit` refuses).
        let new_uniform = || {
            let uniform = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: params.len() as u64,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            if self.check_lost().is_ok() {
                self.queue.write_buffer(&uniform, 0, params);
            }
            uniform
        };
        let thread = std::thread::current().id();
        let mut guard = self
            .binding_caches
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some((_, cache)) = guard.iter_mut().rev().find(|(t, _)| *t == thread) else {
            drop(guard);
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
                if self.check_lost().is_ok() {
                    self.queue.write_buffer(&slot.uniform, 0, params);
                }
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
}

impl Context {
    /// Debug builds' safety net under `kernels::arguments`: a buffer bound read-write and read-only
    /// in one dispatch is a usage conflict wgpu reports inside the user's `queue.submit`; every
    /// entry point must have refused the call with a typed error before recording. Two read-write
    /// bindings over overlapping ranges of one buffer WebGPU refuses too, though wgpu 30 does not
    /// check it: kernels bind such ranges once. A panic here names the kernel that missed a case.
    fn assert_no_usage_conflict(
        &self,
        pipeline: &wgpu::ComputePipeline,
        label: &str,
        storage: &[StorageBinding<'_>],
    ) {
        let known = self
            .read_write_bindings
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let Some(read_write) = known.get(pipeline) else {
            return;
        };
        let written: Vec<_> = storage
            .iter()
            .filter(|s| read_write.contains(&s.binding))
            .collect();
        let end = |s: &StorageBinding<'_>| s.size.map_or(u64::MAX, |n| s.offset + n.get());
        for (n, first) in written.iter().enumerate() {
            if let Some(second) = written[n + 1..].iter().find(|other| {
                other.buffer == first.buffer
                    && other.offset < end(first)
                    && first.offset < end(other)
            }) {
                panic!(
                    "kernel {label}: one buffer bound read-write at bindings {} and {} over \
                     overlapping ranges: WebGPU refuses this dispatch (Chromium checks it, wgpu 30 \
                     does not); bind one range for both (binding::bind_output_pair)",
                    first.binding, second.binding
                );
            }
        }
        for written in written {
            if let Some(read) = storage
                .iter()
                .find(|s| !read_write.contains(&s.binding) && s.buffer == written.buffer)
            {
                panic!(
                    "kernel {label}: one buffer bound read-write at binding {} and read-only at \
                     binding {}: wgpu would reject this dispatch; its host wrapper must refuse the \
                     call first (kernels::arguments)",
                    written.binding, read.binding
                );
            }
        }
    }
}

/// The `@binding` numbers of `source`'s `var<storage, read_write>` declarations.
fn read_write_bindings(source: &str) -> Vec<u32> {
    source
        .lines()
        .filter(|line| line.contains("var<storage, read_write>"))
        .filter_map(|line| {
            let rest = &line[line.find("@binding(")? + "@binding(".len()..];
            rest[..rest.find(')')?].trim().parse().ok()
        })
        .collect()
}

/// Bytes of workgroup memory the entry point `main` of `source` uses once `constants` are applied
/// (naga's layout of each workgroup variable it touches), or `None` if naga cannot tell; wgpu 30
/// does not check this against the device limit, and lavapipe runs over-limit pipelines anyway.
/// In the browser WebGPU checks it at pipeline creation (`None` there).
#[cfg(target_arch = "wasm32")]
fn workgroup_bytes(_source: &str, _constants: &[(&'static str, u32)]) -> Option<u64> {
    None
}

/// See the wasm32 form above.
#[cfg(not(target_arch = "wasm32"))]
fn workgroup_bytes(source: &str, constants: &[(&'static str, u32)]) -> Option<u64> {
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(source).ok()?;
    let info = Validator::new(ValidationFlags::all(), Capabilities::all())
        .validate(&module)
        .ok()?;
    let constants: naga::back::PipelineConstants = constants
        .iter()
        .map(|&(name, value)| (name.to_string(), f64::from(value)))
        .collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, "main")),
        &constants,
    )
    .ok()?;
    let entry = module.entry_points.iter().position(|e| e.name == "main")?;
    let uses = info.get_entry_point(entry);
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).ok()?;
    Some(
        module
            .global_variables
            .iter()
            .filter(|(handle, var)| {
                var.space == naga::AddressSpace::WorkGroup && !uses[*handle].is_empty()
            })
            .map(|(_, var)| u64::from(layouter[var.ty].size))
            .sum(),
    )
}
