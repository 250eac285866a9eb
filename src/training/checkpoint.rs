//! Checkpoints as safetensors: every parameter (`param.<name>`), the AdamW moments
//! (`adam_m.<name>`, `adam_v.<name>`), and metadata holding the format, the model configuration and
//! the optimizer's step count. Loading validates the whole file against the model first (format,
//! configuration, every name, shape and dtype, no missing or extra tensor) and writes nothing unless
//! all of it matches: never a silent partial load.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::device::Context;
use crate::error::{Error, Result};
use crate::training::Trainer;

const FORMAT: &str = "wgpu-attention transformer checkpoint v1";

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("{}: {e}", path.display()))
}

/// Writes the trainer's weights and optimizer state to `path`.
pub fn save(ctx: &Context, trainer: &Trainer, path: &Path) -> Result<()> {
    let model = &trainer.model;
    let names = model.params.names();
    let (m, v) = trainer.optimizer.moments();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (prefix, list) in [
        ("param", model.params.values()),
        ("adam_m", m),
        ("adam_v", v),
    ] {
        for (name, t) in names.iter().zip(list) {
            let data: Vec<f32> = t.to_vec(ctx)?;
            tensors.push((
                format!("{prefix}.{name}"),
                t.shape().to_vec(),
                bytemuck::cast_slice(&data).to_vec(),
            ));
        }
    }
    let views = tensors
        .iter()
        .map(|(n, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|view| (n.clone(), view))
                .map_err(|e| io(path, e))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("config".to_string(), format!("{:?}", model.config())),
        (
            "adam_steps".to_string(),
            trainer.optimizer.steps().to_string(),
        ),
    ]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| io(path, e))
}

/// Restores weights and optimizer state saved by [`save`] from a model of the same configuration.
pub fn load(ctx: &Context, trainer: &mut Trainer, path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| io(path, e))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| io(path, e))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let field = |key: &str| meta.get(key).map(String::as_str).unwrap_or("(missing)");
    if field("format") != FORMAT {
        return Err(io(
            path,
            format!("not a checkpoint of this format ({:?})", field("format")),
        ));
    }
    let expected = format!("{:?}", trainer.model.config());
    if field("config") != expected {
        return Err(io(
            path,
            format!(
                "was saved from model {}, but this model is {expected}; build the model with the \
                 checkpoint's configuration",
                field("config")
            ),
        ));
    }
    let steps: u32 = field("adam_steps")
        .parse()
        .map_err(|_| io(path, format!("bad adam_steps {:?}", field("adam_steps"))))?;
    let names = trainer.model.params.names().to_vec();
    let (m, v) = trainer.optimizer.moments();
    let targets: Vec<(String, &crate::tensor::GpuTensor)> = ["param", "adam_m", "adam_v"]
        .into_iter()
        .zip([trainer.model.params.values(), m, v])
        .flat_map(|(prefix, list)| {
            names
                .iter()
                .zip(list)
                .map(move |(n, t)| (format!("{prefix}.{n}"), t))
        })
        .collect();
    // Validate everything before writing anything.
    let mut data = Vec::with_capacity(targets.len());
    for (name, t) in &targets {
        let view = file
            .tensor(name)
            .map_err(|_| io(path, format!("has no tensor {name}")))?;
        if view.dtype() != Dtype::F32 || view.shape() != t.shape() {
            return Err(io(
                path,
                format!(
                    "tensor {name} is {:?} {:?}; the model needs F32 {:?}",
                    view.dtype(),
                    view.shape(),
                    t.shape()
                ),
            ));
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
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
        return Err(io(path, format!("has tensors this model lacks: {extra:?}")));
    }
    for ((_, t), values) in targets.iter().zip(&data) {
        t.write(ctx, values)?;
    }
    trainer.optimizer.set_steps(steps);
    Ok(())
}
