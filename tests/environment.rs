//! The library reads no environment variable unless the caller asks it to
//! (`ContextOptions::from_env`), and reports what it ignores through the `log` crate. One test in
//! its own binary: it sets process environment variables, which no other test may see.

use std::sync::Mutex;

use wgpu_attention::{Context, ContextOptions, Error, KernelFamily};

/// Keeps the warnings logged through the `log` crate.
struct Captured(Mutex<Vec<String>>);

impl log::Log for Captured {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        if record.level() <= log::Level::Warn {
            let mut lines = self.0.lock().unwrap();
            lines.push(record.args().to_string());
        }
    }
    fn flush(&self) {}
}

static LOGGER: Captured = Captured(Mutex::new(Vec::new()));

#[test]
fn the_environment_is_read_only_when_asked() {
    log::set_logger(&LOGGER).unwrap();
    log::set_max_level(log::LevelFilter::Warn);
    // SAFETY (edition 2021: safe, but racy with threads reading the environment): this binary
    // runs this one test, on one thread, before it creates any context.
    let dump = std::env::temp_dir().join(format!("wgpu-attention-{}-env-dump", std::process::id()));
    let _ = std::fs::remove_dir_all(&dump);
    std::env::set_var("WGPU_ATTENTION_DUMP_PIPELINES", &dump);
    for (name, value) in [
        ("WGPU_ATTENTION_KERNELS", "gpu"),
        ("WGPU_ATTENTION_TRUSTED_SHADERS", "all"),
        ("WGPU_ATTENTION_PASS_PER_KERNEL", "on"),
        ("WGPU_ATTENTION_SUBGROUPS", "perhaps"),
        ("WGPU_ATTENTION_COOP_FORWARD", "2x32"),
        ("WGPU_ATTENTION_DECODE", "48x2048"),
        ("WGPU_ATTENTION_FIXED_FLAG_BUILDS", "off"),
        ("WGPU_ATTENTION_TUNE_TENSOR_CORES", "on"),
        ("WGPU_BACKEND", "not-a-backend"),
    ] {
        std::env::set_var(name, value);
    }

    // Asked: the variables apply, a bad back end is an error, a bad value a logged warning.
    let err = ContextOptions::from_env().expect_err("WGPU_BACKEND is not a back end");
    assert!(matches!(err, Error::UnknownBackend(_)), "{err}");
    std::env::set_var("WGPU_BACKEND", "vulkan");
    let asked = ContextOptions::from_env().unwrap();
    assert_eq!(asked.backends, Some(wgpu::Backends::VULKAN));
    assert_eq!(asked.kernel_family, Some(KernelFamily::Gpu));
    assert!(asked.unchecked_measurement && asked.pass_per_kernel);
    assert_eq!(asked.subgroups, None);
    assert_eq!(asked.coop_forward_shape, Some((2, 32)));
    assert_eq!(asked.fixed_flag_builds, Some(false));
    assert!(asked.tune_tensor_cores);
    // 48 keys is no power of two: logged and ignored.
    assert_eq!(asked.decode_shape, None);
    assert_eq!(asked.dump_pipelines.as_deref(), Some(dump.as_path()));
    let warnings = LOGGER.0.lock().unwrap().clone();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("WGPU_ATTENTION_SUBGROUPS=perhaps")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("WGPU_ATTENTION_DECODE=48x2048")),
        "{warnings:?}"
    );

    // Not asked: a context made with explicit options, and a wrapped device, see none of them.
    std::env::set_var("WGPU_BACKEND", "not-a-backend");
    let options = ContextOptions::new().backends(wgpu::Backends::VULKAN);
    let ctx = match Context::new_with(&options) {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("no Vulkan adapter ({e}): skipped");
            return;
        }
    };
    let by_class = match ctx.is_cpu() {
        true => KernelFamily::CpuDriver,
        false => KernelFamily::Gpu,
    };
    assert_eq!(ctx.kernel_family(), by_class);
    assert!(!ctx.pass_per_kernel());
    assert!(ctx.trusted_shaders(), "on by default for a device it owns");
    assert_eq!(ctx.fixed_flag_builds(), !ctx.is_cpu(), "by adapter class");
    assert!(!ctx.tunes_tensor_cores());
    let forward = |ctx: &Context| {
        let x = wgpu_attention::GpuTensor::from_slice(ctx, &[0.5; 8], &[1, 2, 1, 4]).unwrap();
        let x = x.heads().unwrap();
        let opts = wgpu_attention::AttentionOptions::new();
        wgpu_attention::attention_forward(ctx, &x, &x, &x, &opts).unwrap();
    };
    forward(&ctx);
    assert!(!dump.exists(), "pipelines dumped without being asked");
    let wrapped = Context::from_device(ctx.device().clone(), ctx.queue().clone()).unwrap();
    assert_eq!(wrapped.kernel_family(), by_class);
    assert!(!wrapped.pass_per_kernel());
    assert!(
        !wrapped.trusted_shaders(),
        "off on a device it does not own"
    );
    // The environment's choice, once asked for, on a wrapped device too.
    std::env::set_var("WGPU_BACKEND", "vulkan");
    let tuned = Context::from_device_with(
        ctx.device().clone(),
        ctx.queue().clone(),
        &ContextOptions::from_env().unwrap(),
    )
    .unwrap();
    assert_eq!(tuned.kernel_family(), KernelFamily::Gpu);
    assert!(tuned.pass_per_kernel());
    assert!(!tuned.fixed_flag_builds() && tuned.tunes_tensor_cores());
    forward(&tuned);
    let dumped = std::fs::read_dir(&dump).map_or(0, |d| d.count());
    assert!(dumped >= 2, "asked to dump, {dumped} files in {dump:?}");
    std::fs::remove_dir_all(&dump).unwrap();
}
