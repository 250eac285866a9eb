//! Checkpoints as safetensors: every parameter (`param.<name>`), the AdamW moments
//! (`adam_m.<name>`, `adam_v.<name>`), and metadata: the format and its version, the model
//! configuration as JSON, the optimizer's step count, mixed precision's loss scale and a CRC-32 of
//! all of them: every header field (format, version, configuration, step count, loss scale) and the
//! tensor data.
//!
//! A checkpoint is either the old file or the new one, never half of each: [`save`] writes a
//! temporary file beside the target, flushes it to disk and renames it over the target. It refuses to
//! save a trainer whose last steps were not finite, so the last good checkpoint stays. [`load`]
//! validates the whole file against the model first (format, checksum, configuration field by field,
//! every name, shape and dtype, finite values, no missing or extra tensor) and writes nothing unless
//! all of it matches. [`Checkpointer`] saves every N steps and resumes from the last save.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::Value;

use crate::model::TransformerConfig;
use crate::training::Trainer;
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, Result};
use wgpu_attention::kernels::loss_scale::{LossScaleState, LossScaling};
use wgpu_attention::tensor::GpuTensor;

const FORMAT: &str = "wgpu-attention transformer checkpoint";
/// Version 4: mixed precision's loss scale (`loss_scale`: its state as JSON, or `none`). Version 3
/// (the CRC-32 covers the header fields too: an edited step count or configuration is refused),
/// version 2 (CRC-32 of the tensor data only) and version 1 (configuration as Rust `Debug` text, no
/// checksum) are still read.
const FORMAT_VERSION: u32 = 4;
const FORMAT_V1: &str = "wgpu-attention transformer checkpoint v1";
/// The header fields the checksum covers, in the order they are hashed: version 4's; version 3's
/// are the first four.
const CHECKED_FIELDS: [&str; 5] = [
    "format",
    "format_version",
    "config",
    "adam_steps",
    "loss_scale",
];

/// Feeds header fields to the checksum (the first `count` of [`CHECKED_FIELDS`]): each name and
/// value with its length, so no two different headers hash the same bytes.
fn hash_fields(hasher: &mut crc32fast::Hasher, count: usize, field: impl Fn(&str) -> String) {
    for name in &CHECKED_FIELDS[..count] {
        let value = field(name);
        for part in [name, value.as_str()] {
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part.as_bytes());
        }
    }
}

fn error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{}: {e}", path.display()))
}

/// The tensors of a checkpoint in a fixed order (the checksum's), with their GPU tensors.
fn tensors(trainer: &Trainer) -> Vec<(String, &GpuTensor)> {
    let names = trainer.model.params.names();
    let (m, v) = trainer.optimizer.moments();
    ["param", "adam_m", "adam_v"]
        .into_iter()
        .zip([trainer.model.params.values(), m, v])
        .flat_map(|(prefix, list)| {
            names
                .iter()
                .zip(list)
                .map(move |(n, t)| (format!("{prefix}.{n}"), t))
        })
        .collect()
}

/// Checks before a run that `path` can be saved to: creates its directory if missing and writes and
/// removes a probe file there, so that an unwritable location fails now and not after training.
pub fn check_writable(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(error(path, "is a directory; give a file path"));
    }
    let probe = temporary_path(path)?;
    File::create(&probe)
        .and_then(|mut f| f.write_all(b"probe"))
        .map_err(|e| {
            error(
                path,
                format!("cannot be written ({e}); choose another path"),
            )
        })?;
    std::fs::remove_file(&probe).map_err(|e| error(&probe, e))
}

/// The temporary file a save goes through: beside `path` (so the rename stays on one file system),
/// after creating the directory if needed.
fn temporary_path(path: &Path) -> Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| error(path, "has no file name"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(|e| {
        error(
            path,
            format!("cannot create directory {} ({e})", dir.display()),
        )
    })?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".tmp-{}", std::process::id()));
    Ok(dir.join(tmp))
}

/// Writes `bytes` to `path` atomically: a temporary file, flushed to disk, renamed over the target.
/// On failure the temporary file is removed and the old `path` is untouched.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temporary_path(path)?;
    let written = File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        std::fs::remove_file(&tmp).ok();
        return Err(error(
            path,
            format!("could not be written ({e}); the previous checkpoint, if any, is unchanged"),
        ));
    }
    // Make the rename itself durable. Directories cannot be opened for this everywhere (Windows);
    // there the rename is as durable as the file system makes it.
    if let Some(dir) = tmp.parent() {
        if let Ok(d) = File::open(dir) {
            d.sync_all().ok();
        }
    }
    Ok(())
}

/// Writes the trainer's weights and optimizer state to `path` atomically. Refused with
/// [`Error::NonFinite`] (nothing written) if a step since the last load had a non-finite loss or
/// gradient norm.
pub fn save(ctx: &Context, trainer: &Trainer, path: &Path) -> Result<()> {
    trainer.check_finite(ctx)?;
    let config = serde_json::to_string(trainer.model.config()).map_err(|e| error(path, e))?;
    let loss_scale = match trainer.loss_scale_state(ctx)? {
        Some(state) => serde_json::to_string(&state).map_err(|e| error(path, e))?,
        None => "none".to_string(),
    };
    let mut metadata = HashMap::from([
        ("loss_scale".to_string(), loss_scale),
        ("format".to_string(), FORMAT.to_string()),
        ("format_version".to_string(), FORMAT_VERSION.to_string()),
        ("config".to_string(), config),
        (
            "adam_steps".to_string(),
            trainer.optimizer.steps().to_string(),
        ),
    ]);
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut crc = crc32fast::Hasher::new();
    hash_fields(&mut crc, CHECKED_FIELDS.len(), |name| {
        metadata[name].clone()
    });
    for (name, t) in tensors(trainer) {
        let bytes = bytemuck::cast_slice::<f32, u8>(&t.to_vec(ctx)?).to_vec();
        crc.update(&bytes);
        data.push((name, t.shape().to_vec(), bytes));
    }
    let views = data
        .iter()
        .map(|(n, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|view| (n.clone(), view))
                .map_err(|e| error(path, e))
        })
        .collect::<Result<Vec<_>>>()?;
    metadata.insert("crc32".to_string(), format!("{:08x}", crc.finalize()));
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(|e| error(path, e))?;
    write_atomically(path, &bytes)
}

/// A version 1 configuration (`TransformerConfig { vocab: 13, pre_ln: true, .. }`) as JSON.
fn config_from_v1(text: &str) -> Option<Value> {
    let body = text.split_once('{')?.1.trim_end().strip_suffix('}')?;
    let fields = body
        .split(',')
        .filter(|f| !f.trim().is_empty())
        .map(|f| {
            let (k, v) = f.split_once(':')?;
            Some((k.trim().to_string(), serde_json::from_str(v.trim()).ok()?))
        })
        .collect::<Option<serde_json::Map<_, _>>>()?;
    Some(Value::Object(fields))
}

/// The checkpoint's configuration against the model's: fields it lacks take their defaults (fields
/// added later), unknown fields are refused, and every differing field is named with both values.
fn check_config(path: &Path, saved: Value, model: &TransformerConfig) -> Result<()> {
    let saved: TransformerConfig = serde_json::from_value(saved).map_err(|e| {
        error(
            path,
            format!("has a model configuration this version cannot read: {e}"),
        )
    })?;
    let as_map = |c: &TransformerConfig| match serde_json::to_value(c) {
        Ok(Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    let (saved, ours) = (as_map(&saved), as_map(model));
    let differing: Vec<String> = ours
        .iter()
        .filter(|(k, v)| saved.get(*k) != Some(*v))
        .map(|(k, v)| {
            let theirs = saved
                .get(k)
                .map_or("(absent)".to_string(), Value::to_string);
            format!("{k} (checkpoint {theirs}, this model {v})")
        })
        .collect();
    if !differing.is_empty() {
        return Err(error(
            path,
            format!(
                "was saved from a model whose configuration differs in {}; build the model with \
                 the checkpoint's configuration",
                differing.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Restores weights and optimizer state saved by [`save`] into a model of the same configuration,
/// and clears the optimizer's non-finite latch. Nothing is written unless the whole file is valid.
pub fn load(ctx: &Context, trainer: &mut Trainer, path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| error(path, e))?;
    let corrupt = |e: safetensors::SafeTensorError| {
        error(
            path,
            format!("is truncated or corrupt ({e}); load an earlier checkpoint"),
        )
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(corrupt)?;
    let file = SafeTensors::deserialize(&bytes).map_err(corrupt)?;
    let meta = header.metadata().clone().unwrap_or_default();
    let field = |key: &str| meta.get(key).map(String::as_str).unwrap_or("(missing)");
    let mut hasher = crc32fast::Hasher::new();
    let (saved_config, crc) = match (field("format"), field("format_version")) {
        (FORMAT, version @ ("2" | "3" | "4")) => {
            let checked = match version {
                "3" => 4,
                "4" => CHECKED_FIELDS.len(),
                _ => 0,
            };
            hash_fields(&mut hasher, checked, |name| field(name).to_string());
            let config = serde_json::from_str(field("config"))
                .map_err(|e| error(path, format!("has an unreadable configuration: {e}")))?;
            let crc = u32::from_str_radix(field("crc32"), 16)
                .map_err(|_| error(path, format!("has a bad crc32 {:?}", field("crc32"))))?;
            (config, Some(crc))
        }
        (FORMAT, version) => {
            return Err(error(
                path,
                format!(
                    "is checkpoint format version {version}; this version of wgpu-attention \
                     reads versions 1 to {FORMAT_VERSION}"
                ),
            ))
        }
        (FORMAT_V1, _) => {
            let config = config_from_v1(field("config")).ok_or_else(|| {
                error(
                    path,
                    format!("has a bad configuration {:?}", field("config")),
                )
            })?;
            (config, None)
        }
        (other, _) => {
            return Err(error(
                path,
                format!("is not a wgpu-attention checkpoint (format {other:?})"),
            ))
        }
    };
    check_config(path, saved_config, trainer.model.config())?;
    let steps: u32 = field("adam_steps").parse().map_err(|_| {
        error(
            path,
            format!("has a bad adam_steps {:?}", field("adam_steps")),
        )
    })?;
    let loss_scale = match field("loss_scale") {
        "none" | "(missing)" => None,
        text => Some(
            serde_json::from_str::<LossScaleState>(text)
                .ok()
                .filter(|state| LossScaling::is_scale(state.scale))
                .ok_or_else(|| error(path, format!("has a bad loss_scale {text:?}")))?,
        ),
    };
    let targets = tensors(trainer);
    // Validate everything before writing anything.
    let mut data = Vec::with_capacity(targets.len());
    for (name, t) in &targets {
        let view = file
            .tensor(name)
            .map_err(|_| error(path, format!("has no tensor {name}")))?;
        if view.dtype() != Dtype::F32 || view.shape() != t.shape() {
            return Err(error(
                path,
                format!(
                    "tensor {name} is {:?} {:?}; the model needs F32 {:?}",
                    view.dtype(),
                    view.shape(),
                    t.shape()
                ),
            ));
        }
        hasher.update(view.data());
        let values: Vec<f32> = bytemuck::pod_collect_to_vec(view.data());
        if let Some(i) = values.iter().position(|x| !x.is_finite()) {
            return Err(error(
                path,
                format!(
                    "tensor {name} holds a non-finite value ({}) at {i}",
                    values[i]
                ),
            ));
        }
        data.push(values);
    }
    if file.len() != targets.len() {
        let known: std::collections::HashSet<&str> =
            targets.iter().map(|(n, _)| n.as_str()).collect();
        let extra: Vec<String> = file
            .names()
            .into_iter()
            .filter(|n| !known.contains(n))
            .map(str::to_string)
            .collect();
        return Err(error(
            path,
            format!("has tensors this model lacks: {extra:?}"),
        ));
    }
    if let Some(expected) = crc {
        let actual = hasher.finalize();
        if actual != expected {
            return Err(error(
                path,
                format!(
                    "is corrupt or was edited: its header fields and tensor data have CRC-32 \
                     {actual:08x}, saved as {expected:08x}; load an earlier checkpoint"
                ),
            ));
        }
    }
    ctx.check_lost()?;
    for ((_, t), values) in targets.iter().zip(&data) {
        t.write(ctx, values)?;
    }
    // A mixed-precision trainer resumes the saved scale; one loading an f32 checkpoint keeps its
    // initial scale, and an f32 trainer has none to restore.
    if let (Some(scale), Some(state)) = (trainer.optimizer.loss_scale(), loss_scale) {
        scale.set_state(ctx, state)?;
    }
    trainer.optimizer.set_steps(ctx, steps)
}

/// Periodic checkpoints of a training run: the path is checked when it is created, [`Checkpointer::
/// save_if_due`] saves every `every` optimizer steps (atomically, and never after a non-finite
/// step), and [`Checkpointer::resume`] continues from the last save.
///
/// A run resumed this way is bitwise identical to an uninterrupted one of the same seed as long as
/// the caller's batches and learning rates depend only on the step number.
#[derive(Clone, Debug)]
pub struct Checkpointer {
    path: PathBuf,
    every: u32,
}

impl Checkpointer {
    /// Saves to `path` every `every` steps (`every >= 1`); fails now if `path` cannot be written.
    pub fn new(path: impl Into<PathBuf>, every: u32) -> Result<Self> {
        let path = path.into();
        if every == 0 {
            return Err(Error::shape(
                "every",
                "is 0; give the number of steps between saves (at least 1)",
            ));
        }
        check_writable(&path)?;
        Ok(Self { path, every })
    }

    /// The checkpoint file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Loads the last save into `trainer` if there is one and returns its step count; `None` (and
    /// the trainer untouched) when no checkpoint exists yet.
    pub fn resume(&self, ctx: &Context, trainer: &mut Trainer) -> Result<Option<u32>> {
        if !self.path.exists() {
            return Ok(None);
        }
        load(ctx, trainer, &self.path)?;
        Ok(Some(trainer.optimizer.steps()))
    }

    /// Whether a save is due after `steps` optimizer steps (a positive multiple of `every`).
    pub fn due(&self, steps: u32) -> bool {
        steps > 0 && steps.is_multiple_of(self.every)
    }

    /// Saves when the trainer's step count is a multiple of `every`; returns whether it saved.
    /// Fails with [`Error::NonFinite`] (nothing written) when a step was not finite.
    pub fn save_if_due(&self, ctx: &Context, trainer: &Trainer) -> Result<bool> {
        if !self.due(trainer.optimizer.steps()) {
            return Ok(false);
        }
        save(ctx, trainer, &self.path)?;
        Ok(true)
    }
}
