//! Cold compile time of every pipeline in pipeline dumps (`WGPU_ATTENTION_DUMP_PIPELINES`) on one
//! adapter. CPU drivers (lavapipe, llvmpipe) compile a pipeline at its first dispatch, so each
//! pipeline is dispatched twice on zeroed buffers (its parameters all zero: kernels return early or
//! loop zero times; llvmpipe ends any loop after 65535 iterations): compile = first - second.
//! Run with a fresh `MESA_SHADER_CACHE_DIR` (or `MESA_SHADER_CACHE_DISABLE=true`).
//! Prints `label<TAB>compile_ms<TAB>second_dispatch_ms`, one line per pipeline.

use std::time::Instant;

fn main() {
    let mut dirs = Vec::new();
    let mut backend = wgpu::Backends::VULKAN;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--backend" => {
                backend = match args.next().as_deref() {
                    Some("gl") => wgpu::Backends::GL,
                    _ => wgpu::Backends::VULKAN,
                }
            }
            _ => dirs.push(a),
        }
    }
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backend;
    let instance = wgpu::Instance::new(desc);
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).unwrap();
    let offered = adapter.limits();
    let mut limits = wgpu::Limits::defaults();
    limits.max_compute_workgroup_storage_size = offered.max_compute_workgroup_storage_size;
    limits.max_compute_invocations_per_workgroup = offered.max_compute_invocations_per_workgroup;
    limits.max_storage_buffers_per_shader_stage = offered.max_storage_buffers_per_shader_stage;
    limits.max_compute_workgroup_size_x = offered.max_compute_workgroup_size_x;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        required_features: adapter.features()
            & (wgpu::Features::SUBGROUP | wgpu::Features::SHADER_F16),
        required_limits: limits,
        ..Default::default()
    }))
    .unwrap();
    eprintln!("{}", adapter.get_info().name);
    let mut files: Vec<_> = dirs
        .iter()
        .flat_map(|d| std::fs::read_dir(d).unwrap().map(|e| e.unwrap().path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    for json in files {
        let desc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let label = desc["label"].as_str().unwrap_or("?").to_string();
        let wgsl = std::fs::read_to_string(json.with_extension("wgsl")).unwrap();
        let module = match naga::front::wgsl::parse_str(&wgsl) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("{label}: {e}");
                continue;
            }
        };
        let constants: Vec<(String, f64)> = desc["constants"]
            .as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, v)| (k.clone(), v.as_f64().unwrap()))
                    .collect()
            })
            .unwrap_or_default();
        let checks = match desc["runtime_checks"].as_str() {
            Some("unchecked") => wgpu::ShaderRuntimeChecks::unchecked(),
            Some("noloop") => {
                let mut checks = wgpu::ShaderRuntimeChecks::checked();
                checks.force_loop_bounding = false;
                checks
            }
            _ => wgpu::ShaderRuntimeChecks::checked(),
        };
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let shader = unsafe {
            device.create_shader_module_trusted(
                wgpu::ShaderModuleDescriptor {
                    label: Some(&label),
                    source: wgpu::ShaderSource::Wgsl(wgsl.as_str().into()),
                },
                checks,
            )
        };
        // Every group-0 binding the module declares, zeroed: uniforms at their struct's size,
        // storage at its fixed part plus room; an explicit layout, so that bindings the entry point
        // leaves unused are accepted.
        let mut layouter = naga::proc::Layouter::default();
        layouter.update(module.to_ctx()).unwrap();
        let mut entries = Vec::new();
        let mut buffers = Vec::new();
        for (_, var) in module.global_variables.iter() {
            let Some(binding) = &var.binding else {
                continue;
            };
            let size = layouter[var.ty].size as u64;
            let (ty, size) = match var.space {
                naga::AddressSpace::Uniform => {
                    (wgpu::BufferBindingType::Uniform, size.next_multiple_of(16))
                }
                naga::AddressSpace::Storage { access } => (
                    wgpu::BufferBindingType::Storage {
                        read_only: !access.contains(naga::StorageAccess::STORE),
                    },
                    size + 4096,
                ),
                _ => continue,
            };
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: binding.binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
            let usage = match ty {
                wgpu::BufferBindingType::Uniform => wgpu::BufferUsages::UNIFORM,
                _ => wgpu::BufferUsages::STORAGE,
            };
            let buffer = device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size,
                usage,
                mapped_at_creation: false,
            });
            buffers.push((binding.binding, buffer));
        }
        let group_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: None,
            entries: &entries,
        });
        let layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: None,
            bind_group_layouts: &[Some(&group_layout)],
            immediate_size: 0,
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&label),
            layout: Some(&layout),
            module: &shader,
            entry_point: desc["entry_point"].as_str(),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants
                    .iter()
                    .map(|(k, v)| (k.as_str(), *v))
                    .collect::<Vec<_>>(),
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &group_layout,
            entries: &buffers
                .iter()
                .map(|(b, buf)| wgpu::BindGroupEntry {
                    binding: *b,
                    resource: buf.as_entire_binding(),
                })
                .collect::<Vec<_>>(),
        });
        let run = || {
            let mut encoder = device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &bind_group, &[]);
                pass.dispatch_workgroups(1, 1, 1);
            }
            let t = Instant::now();
            queue.submit([encoder.finish()]);
            device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
            t.elapsed().as_secs_f64() * 1e3
        };
        let first = run();
        let second = run();
        if let Some(e) = pollster::block_on(scope.pop()) {
            eprintln!("{label}: {}", e.to_string().lines().next().unwrap_or(""));
            continue;
        }
        println!("{label}\t{:.0}\t{:.1}", first - second, second);
    }
}
