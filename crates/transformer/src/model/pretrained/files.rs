//! A checkpoint's weight files: `model.safetensors`, or the shards `model.safetensors.index.json`
//! lists, memory-mapped; tensors read as f32 (f16 and bf16 converted with `half`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;

use wgpu_attention::error::PretrainedProblem;

/// The weight files of a model directory.
pub(crate) struct WeightFiles {
    shards: Vec<Shard>,
    /// Tensor name to its shard.
    index: BTreeMap<String, usize>,
}

struct Shard {
    file: String,
    map: Mmap,
    /// Where the data section starts (after the length and the header).
    data_start: usize,
    metadata: Metadata,
}

pub(crate) fn file_error(file: &str, message: impl std::fmt::Display) -> PretrainedProblem {
    PretrainedProblem::File {
        file: file.to_string(),
        message: message.to_string(),
    }
}

impl WeightFiles {
    pub fn open(dir: &Path) -> Result<Self, PretrainedProblem> {
        const INDEX: &str = "model.safetensors.index.json";
        let files: Vec<String> = if dir.join(INDEX).exists() {
            let text =
                std::fs::read_to_string(dir.join(INDEX)).map_err(|e| file_error(INDEX, e))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| file_error(INDEX, e))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| file_error(INDEX, "has no weight_map object"))?;
            let mut files: Vec<String> = map
                .values()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| file_error(INDEX, "weight_map values must be file names"))
                })
                .collect::<Result<_, _>>()?;
            files.sort();
            files.dedup();
            files
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".to_string()]
        } else {
            return Err(file_error(
                "model.safetensors",
                "not found (nor model.safetensors.index.json); PyTorch .bin checkpoints are not read: convert them with save_pretrained(safe_serialization=True)",
            ));
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = BTreeMap::new();
        for file in files {
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(file_error(&file, "shard names must be plain file names"));
            }
            let path: PathBuf = dir.join(&file);
            let handle = std::fs::File::open(&path).map_err(|e| file_error(&file, e))?;
            // SAFETY: the map is read-only; a file changed by another process while it is mapped
            // can give wrong weights but not memory unsafety in safe code reading bytes.
            let map = unsafe { Mmap::map(&handle) }.map_err(|e| file_error(&file, e))?;
            let (header, metadata) = SafeTensors::read_metadata(&map)
                .map_err(|e| file_error(&file, format!("is not a valid safetensors file ({e})")))?;
            for name in metadata.tensors().keys() {
                if index.insert(name.clone(), shards.len()).is_some() {
                    return Err(file_error(&file, format!("repeats tensor {name}")));
                }
            }
            shards.push(Shard {
                file,
                map,
                data_start: 8 + header,
                metadata,
            });
        }
        Ok(Self { shards, index })
    }

    /// Every tensor name in the files.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    /// The shape of tensor `name`, if present, after checking its element type.
    pub fn shape(&self, name: &str) -> Result<Option<Vec<usize>>, PretrainedProblem> {
        let Some(&s) = self.index.get(name) else {
            return Ok(None);
        };
        let info = self.shards[s]
            .metadata
            .info(name)
            .expect("indexed tensors are in their shard");
        match info.dtype {
            Dtype::F32 | Dtype::F16 | Dtype::BF16 => Ok(Some(info.shape.clone())),
            other => Err(PretrainedProblem::TensorDtype {
                name: name.to_string(),
                dtype: format!("{other:?}"),
            }),
        }
    }

    /// Tensor `name` as f32, row-major.
    pub fn read(&self, name: &str) -> Result<Vec<f32>, PretrainedProblem> {
        let &s = self
            .index
            .get(name)
            .ok_or_else(|| PretrainedProblem::MissingTensor(name.to_string()))?;
        let shard = &self.shards[s];
        let info = shard.metadata.info(name).expect("indexed");
        let (begin, end) = info.data_offsets;
        let bytes = shard
            .map
            .get(shard.data_start + begin..shard.data_start + end)
            .ok_or_else(|| file_error(&shard.file, format!("is truncated (tensor {name})")))?;
        let values: Vec<f32> = match info.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(PretrainedProblem::TensorDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        if values.len() != info.shape.iter().product::<usize>() {
            return Err(file_error(
                &shard.file,
                format!("tensor {name}'s data does not match its shape"),
            ));
        }
        Ok(values)
    }
}
