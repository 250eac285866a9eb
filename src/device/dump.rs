//! Pipeline dumps ([`ContextOptions::dump_pipelines`]): for every pipeline a context compiles,
//! `DIR/<label>.wgsl` (the source handed to wgpu, before override constants) and `DIR/<label>.json`
//! (`label`, `entry_point`, `constants`, `runtime_checks`), the input of
//! `shared/tools/gpu-compile-report` and of any offline compiler.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Where a context writes its pipelines, and whether it has already said it could not.
#[derive(Debug)]
pub(super) struct PipelineDump {
    dir: PathBuf,
    failed: AtomicBool,
}

/// wgpu's runtime checks as the dump names them: all on, loop bounding off, or none.
pub(super) fn runtime_checks_name(checks: Option<&wgpu::ShaderRuntimeChecks>) -> &'static str {
    match checks {
        None => "checked",
        Some(c) if c.bounds_checks => {
            if c.force_loop_bounding {
                "checked"
            } else {
                "noloop"
            }
        }
        Some(_) => "unchecked",
    }
}

impl PipelineDump {
    pub(super) fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            failed: AtomicBool::new(false),
        }
    }

    /// Writes one pipeline's source and description. A failure is logged once per context and
    /// never fails the kernel: the dump is a diagnostic, the dispatch is the user's work.
    pub(super) fn write(
        &self,
        label: &str,
        source: &str,
        constants: &[(&'static str, u32)],
        runtime_checks: &str,
    ) {
        let description = serde_json::json!({
            "label": label,
            "entry_point": "main",
            "constants": constants
                .iter()
                .map(|&(name, value)| (name.to_string(), serde_json::Value::from(value)))
                .collect::<serde_json::Map<_, _>>(),
            "runtime_checks": runtime_checks,
        });
        let written = std::fs::create_dir_all(&self.dir)
            .and_then(|()| std::fs::write(self.dir.join(format!("{label}.wgsl")), source))
            .and_then(|()| {
                let text =
                    serde_json::to_string_pretty(&description).map_err(std::io::Error::other)?;
                std::fs::write(self.dir.join(format!("{label}.json")), text + "\n")
            });
        if let Err(e) = written {
            if !self.failed.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "wgpu-attention: cannot dump pipelines to {}: {e} (kernels run regardless)",
                    self.dir.display()
                );
            }
        }
    }
}
