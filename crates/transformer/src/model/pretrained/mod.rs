//! Published checkpoints: a Hugging Face model directory (`config.json` and `model.safetensors`, or
//! shards with their index) loaded into a [`Transformer`], and a model saved back in that layout.
//!
//! ```no_run
//! # fn main() -> wgpu_attention::Result<()> {
//! use wgpu_attention_transformer::model::{pretrained::Pretrained, BatchShape};
//! let ctx = wgpu_attention::Context::new()?;
//! let checkpoint = Pretrained::open("models/TinyLlama")?;
//! let shape = BatchShape { batch: 1, src_len: 0, tgt_len: 64 };
//! let model = checkpoint.model(&ctx, shape)?;
//! # Ok(()) }
//! ```
//!
//! Architectures: GPT-2 and LLaMA (with the models that differ from it only in configuration).
//! Every `config.json` option is mapped, checked or known not to change the result; anything else is
//! refused by name ([`wgpu_attention::PretrainedProblem::UnsupportedOption`]), so a checkpoint that loads
//! computes what `transformers` computes. Weights in f32, f16 or bf16 are converted to f32.

mod config;
mod files;
mod names;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

pub use config::Architecture;

use crate::layers::params::Params;
use crate::model::transformer::{BatchShape, Transformer, TransformerConfig};
use files::{file_error, WeightFiles};
use names::Source;
use wgpu_attention::device::Context;
use wgpu_attention::error::{Error, PretrainedProblem, Result};

/// An opened Hugging Face model directory: its configuration mapped to a [`TransformerConfig`]
/// and its weight files memory-mapped (nothing is read into memory until weights are loaded).
pub struct Pretrained {
    dir: PathBuf,
    architecture: Architecture,
    config: TransformerConfig,
    hf_config: serde_json::Value,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    /// The checkpoint's prefix of body tensors (`transformer.`, `model.` or none).
    prefix: String,
    files: WeightFiles,
}

/// Where each engine parameter's values come from, checked against the files.
struct Plan {
    sources: Vec<Planned>,
}

/// One engine parameter (its index in the store), its checkpoint tensors, and each tensor's rows
/// (its first dimension: where it sits in a stacked parameter).
struct Planned {
    param: usize,
    source: Source,
    rows: Vec<usize>,
}

impl Pretrained {
    /// Reads `dir/config.json` and maps the weight files. Refused, with the reason
    /// ([`Error::Pretrained`]): an unreadable directory, an unknown `model_type`, any option the
    /// engine does not compute as `transformers` does.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let fail = |problem| Error::Pretrained {
            dir: dir.display().to_string(),
            problem,
        };
        let text = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| fail(file_error("config.json", e)))?;
        let hf_config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| fail(file_error("config.json", e)))?;
        let parsed = config::parse(&hf_config).map_err(fail)?;
        let files = WeightFiles::open(&dir).map_err(fail)?;
        let body = match parsed.architecture {
            Architecture::Gpt2 => "transformer.",
            Architecture::Llama => "model.",
        };
        let has = |name: &str| files.names().any(|n| n == name);
        let embed = match parsed.architecture {
            Architecture::Gpt2 => "wte.weight",
            Architecture::Llama => "embed_tokens.weight",
        };
        let prefix = if has(&format!("{body}{embed}")) {
            body
        } else {
            ""
        }
        .to_string();
        Ok(Self {
            dir,
            architecture: parsed.architecture,
            config: parsed.config,
            hf_config,
            bos_token_id: parsed.bos_token_id,
            eos_token_id: parsed.eos_token_id,
            prefix,
            files,
        })
    }

    /// The engine's configuration of this model.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    /// The model family.
    pub fn architecture(&self) -> Architecture {
        self.architecture
    }

    /// The directory opened.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`'s beginning-of-sequence token, if it names one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// `config.json`'s end-of-sequence token (the first, if it lists several).
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// Builds the model for batches of `shape` (`tgt_len` at most the learned position table's
    /// rows for GPT-2) and loads the weights into it.
    pub fn model(&self, ctx: &Context, shape: BatchShape) -> Result<Transformer> {
        let model = Transformer::for_loading(ctx, self.config, shape)?;
        self.load_weights(ctx, &model)?;
        Ok(model)
    }

    fn fail(&self, problem: PretrainedProblem) -> Error {
        Error::Pretrained {
            dir: self.dir.display().to_string(),
            problem,
        }
    }

    /// Loads the weights into `params`, the parameters of layers built for this checkpoint's
    /// configuration by another level (an inference-only store of a generator).
    pub fn load_params(&self, ctx: &Context, params: &Params) -> Result<()> {
        let plan = self.plan(&self.config, params)?;
        self.write(ctx, plan, params)
    }

    /// Checks every engine parameter in `params` (of a model of configuration `config`) against the
    /// files (present, right shape, right element type) and every file tensor against the model
    /// (none left over).
    fn plan(&self, config: &TransformerConfig, params: &Params) -> Result<Plan> {
        if config != &self.config {
            return Err(Error::shape(
                "model",
                format!(
                    "has configuration {config:?}; this checkpoint's is {:?}",
                    self.config
                ),
            ));
        }
        let mut used = BTreeSet::new();
        let mut sources = Vec::new();
        for (i, (name, value)) in params.names().iter().zip(params.values()).enumerate() {
            // A tied head's weight is the embedding, which is loaded under its own name.
            let Some(source) = names::source(self.architecture, &self.prefix, name) else {
                return Err(self.fail(PretrainedProblem::MissingTensor(format!(
                    "(the checkpoint tensor of engine parameter {name})"
                ))));
            };
            let expected = value.shape().to_vec();
            let mut part_rows = Vec::with_capacity(source.tensors.len());
            for t in &source.tensors {
                let shape = self
                    .files
                    .shape(t)
                    .map_err(|p| self.fail(p))?
                    .ok_or_else(|| self.fail(PretrainedProblem::MissingTensor(t.clone())))?;
                let wrong = |expected: Vec<usize>| {
                    self.fail(PretrainedProblem::TensorShape {
                        name: t.clone(),
                        found: shape.clone(),
                        expected,
                    })
                };
                if source.transposed {
                    let want = expected.iter().rev().copied().collect::<Vec<_>>();
                    if shape != want {
                        return Err(wrong(want));
                    }
                } else if source.tensors.len() == 1 {
                    if shape != expected {
                        return Err(wrong(expected.clone()));
                    }
                } else if shape.len() != expected.len() || shape[1..] != expected[1..] {
                    let mut want = expected.clone();
                    want[0] = shape.first().copied().unwrap_or(0);
                    return Err(wrong(want));
                }
                part_rows.push(shape.first().copied().unwrap_or(0));
                used.insert(t.clone());
            }
            let rows: usize = part_rows.iter().sum();
            if source.tensors.len() > 1 && rows != expected[0] {
                return Err(self.fail(PretrainedProblem::TensorShape {
                    name: source.tensors.join(" + "),
                    found: vec![rows],
                    expected: vec![expected[0]],
                }));
            }
            sources.push(Planned {
                param: i,
                source,
                rows: part_rows,
            });
        }
        let tied = self.config.tied_embeddings;
        if let Some(extra) = self
            .files
            .names()
            .find(|n| !used.contains(*n) && !names::ignored(n, tied))
        {
            return Err(self.fail(PretrainedProblem::UnexpectedTensor(extra.clone())));
        }
        Ok(Plan { sources })
    }

    /// Loads the checkpoint's weights into `model` (built with [`Pretrained::config`]): everything
    /// is checked before anything is written, then each parameter is converted and uploaded in turn
    /// (host memory holds one tensor at a time).
    pub fn load_weights(&self, ctx: &Context, model: &Transformer) -> Result<()> {
        let plan = self.plan(model.config(), &model.params)?;
        self.write(ctx, plan, &model.params)
    }

    /// Converts and uploads each planned parameter in turn.
    fn write(&self, ctx: &Context, plan: Plan, params: &Params) -> Result<()> {
        let values = params.values();
        for Planned { param, source, .. } in plan.sources {
            let parts = source
                .tensors
                .iter()
                .map(|t| self.files.read(t).map_err(|p| self.fail(p)))
                .collect::<Result<Vec<_>>>()?;
            let data = if source.transposed {
                let shape = values[param].shape();
                transpose(&parts[0], shape[1], shape[0])
            } else {
                parts.concat()
            };
            values[param].write(ctx, &data)?;
        }
        Ok(())
    }

    /// Saves `model` (loaded from this checkpoint, then perhaps fine-tuned) to `dir` in this
    /// checkpoint's Hugging Face layout: `config.json` (this one's, with `dtype` float32),
    /// `model.safetensors` in f32 under the `transformers` names, and the tokenizer files found
    /// beside this checkpoint. `transformers`' `from_pretrained` loads the result.
    pub fn save(&self, ctx: &Context, model: &Transformer, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let plan = self.plan(model.config(), &model.params)?;
        let io = |file: &str, e: &dyn std::fmt::Display| Error::Pretrained {
            dir: dir.display().to_string(),
            problem: file_error(file, e),
        };
        std::fs::create_dir_all(dir).map_err(|e| io("", &e))?;
        let values = model.params.values();
        let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
        for Planned {
            param,
            source,
            rows: part_rows,
        } in plan.sources
        {
            let data = values[param].to_vec(ctx)?;
            let shape = values[param].shape().to_vec();
            // GPT-2 keeps its body prefix; a LLaMA body always has one.
            let name = |t: &str| match (self.architecture, self.prefix.as_str()) {
                (Architecture::Llama, "") if !t.starts_with("lm_head") => format!("model.{t}"),
                _ => t.to_string(),
            };
            if source.transposed {
                let t = transpose(&data, shape[0], shape[1]);
                let bytes = bytemuck::cast_slice(&t).to_vec();
                tensors.insert(name(&source.tensors[0]), (vec![shape[1], shape[0]], bytes));
                continue;
            }
            let cols: usize = shape[1..].iter().product();
            let mut row = 0;
            for (t, &rows) in source.tensors.iter().zip(&part_rows) {
                let part = &data[row * cols..(row + rows) * cols];
                let mut part_shape = shape.clone();
                part_shape[0] = rows;
                tensors.insert(name(t), (part_shape, bytemuck::cast_slice(part).to_vec()));
                row += rows;
            }
        }
        let views = tensors
            .iter()
            .map(|(name, (shape, bytes))| {
                TensorView::new(Dtype::F32, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| io("model.safetensors", &e))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut metadata = std::collections::HashMap::new();
        metadata.insert("format".to_string(), "pt".to_string());
        safetensors::serialize_to_file(views, Some(metadata), &dir.join("model.safetensors"))
            .map_err(|e| io("model.safetensors", &e))?;
        let mut config = self.hf_config.clone();
        if let Some(map) = config.as_object_mut() {
            map.remove("torch_dtype");
            map.insert("dtype".into(), "float32".into());
        }
        let text = serde_json::to_string_pretty(&config).map_err(|e| io("config.json", &e))?;
        std::fs::write(dir.join("config.json"), text).map_err(|e| io("config.json", &e))?;
        for file in [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
        ] {
            let from = self.dir.join(file);
            if from.exists() && from != dir.join(file) {
                std::fs::copy(&from, dir.join(file)).map_err(|e| io(file, &e))?;
            }
        }
        Ok(())
    }
}

/// `[rows, cols]` to `[cols, rows]`.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            y[c * rows + r] = x[r * cols + c];
        }
    }
    y
}
