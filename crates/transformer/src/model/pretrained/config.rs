//! `config.json` to [`TransformerConfig`], per architecture. Every key is either mapped, checked to
//! have the one value the engine computes, or known to change nothing the engine computes (metadata,
//! dropout, generation defaults); any other key is refused by name, so a checkpoint that loads
//! computes what `transformers` computes.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use crate::model::transformer::{Activation, Norm, RopeScaling, TransformerConfig};
use wgpu_attention::error::PretrainedProblem;

/// The model families the loader maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Architecture {
    /// GPT-2 (`model_type: "gpt2"`): learned positions, LayerNorm, tanh-GELU, fused `Conv1D` QKV.
    Gpt2,
    /// LLaMA and the models that differ from it only in configuration (TinyLlama, SmolLM, ...;
    /// `model_type: "llama"`): RMSNorm, SwiGLU, rotary embeddings, grouped key/value heads.
    Llama,
}

/// What `config.json` says.
#[derive(Clone, Debug)]
pub(crate) struct Parsed {
    pub architecture: Architecture,
    pub config: TransformerConfig,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}

/// Keys that change nothing the engine computes at inference: metadata, token ids read separately,
/// dropout probabilities (training-time only; the engine's training has no dropout), sequence
/// classification heads, and generation defaults saved by older `transformers` versions.
const IGNORED: &[&str] = &[
    "_name_or_path",
    "architectures",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "model_type",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "torchscript",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "task_specific_params",
    "attn_pdrop",
    "embd_pdrop",
    "resid_pdrop",
    "attention_dropout",
    "summary_activation",
    "summary_first_dropout",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "num_return_sequences",
    "bad_words_ids",
    // Only splits LLaMA's projections into slices computed one after the other; same result.
    "pretraining_tp",
    // transformers' choice of attention implementation, not the model's math.
    "_attn_implementation_autoset",
    // GPT-2's upcast of attention to f32 under mixed precision: the engine computes in f32.
    "reorder_and_upcast_attn",
    // Training-time memory saving; the same result.
    "gradient_checkpointing",
    "keys_to_ignore_at_inference",
    // Written by nanotron's LLaMA exports (SmolLM2); transformers' LlamaConfig does not read them
    // and always rotates halves, as the engine does.
    "is_llama_config",
    "rope_interleaved",
];

/// `config.json`'s keys, each marked once read.
struct Options<'a> {
    map: &'a Map<String, Value>,
    read: BTreeSet<&'a str>,
}

fn unsupported(option: &str, value: &Value, reason: impl Into<String>) -> PretrainedProblem {
    PretrainedProblem::UnsupportedOption {
        option: option.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl<'a> Options<'a> {
    fn get(&mut self, key: &'a str) -> Option<&'a Value> {
        self.read.insert(key);
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn usize(&mut self, key: &'a str) -> Result<Option<usize>, PretrainedProblem> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| unsupported(key, v, "must be a non-negative integer")),
        }
    }

    fn required(&mut self, key: &'a str) -> Result<usize, PretrainedProblem> {
        self.usize(key)?
            .ok_or_else(|| unsupported(key, &Value::Null, "is required"))
    }

    fn f32(&mut self, key: &'a str) -> Result<Option<f32>, PretrainedProblem> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| unsupported(key, v, "must be a number")),
        }
    }

    fn bool(&mut self, key: &'a str, default: bool) -> Result<bool, PretrainedProblem> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| unsupported(key, v, "must be true or false")),
        }
    }

    /// Refuses `key` unless it is absent or `ok(value)`.
    fn expect(
        &mut self,
        key: &'a str,
        ok: impl Fn(&Value) -> bool,
        reason: &str,
    ) -> Result<(), PretrainedProblem> {
        match self.get(key) {
            Some(v) if !ok(v) => Err(unsupported(key, v, reason)),
            _ => Ok(()),
        }
    }

    fn token(&mut self, key: &'a str) -> Option<u32> {
        // Lists (several end-of-sequence ids) keep their first.
        match self.get(key) {
            Some(Value::Array(ids)) => ids.first().and_then(Value::as_u64).map(|n| n as u32),
            Some(v) => v.as_u64().map(|n| n as u32),
            None => None,
        }
    }

    /// Refuses the first key neither read nor ignorable.
    fn finish(self) -> Result<(), PretrainedProblem> {
        match self
            .map
            .iter()
            .find(|(k, _)| !self.read.contains(k.as_str()) && !IGNORED.contains(&k.as_str()))
        {
            Some((k, v)) => Err(unsupported(
                k,
                v,
                "the engine does not implement this option; loading anyway could compute something other than transformers",
            )),
            None => Ok(()),
        }
    }
}

/// A `hidden_act` / `activation_function` the engine computes exactly.
fn activation(key: &str, v: &Value) -> Result<Activation, PretrainedProblem> {
    match v.as_str() {
        // gelu_new, gelu_fast and PyTorch's tanh approximation are one formula.
        Some("gelu_new" | "gelu_fast" | "gelu_pytorch_tanh") => Ok(Activation::Gelu),
        Some("silu" | "swish") => Ok(Activation::Silu),
        Some("relu") => Ok(Activation::Relu),
        _ => Err(unsupported(
            key,
            v,
            "supported: gelu_new, gelu_fast, gelu_pytorch_tanh (tanh GELU), silu, relu; the erf GELU (\"gelu\") is not implemented",
        )),
    }
}

/// Parses `config.json`.
pub(crate) fn parse(json: &Value) -> Result<Parsed, PretrainedProblem> {
    let map = json.as_object().ok_or_else(|| PretrainedProblem::File {
        file: "config.json".into(),
        message: "is not a JSON object".into(),
    })?;
    let model_type = map.get("model_type").and_then(Value::as_str).unwrap_or("");
    let mut o = Options {
        map,
        read: BTreeSet::new(),
    };
    let (architecture, mut config) = match model_type {
        "gpt2" => (Architecture::Gpt2, gpt2(&mut o)?),
        "llama" => (Architecture::Llama, llama(&mut o)?),
        other => return Err(PretrainedProblem::UnknownArchitecture(other.to_string())),
    };
    o.expect(
        "is_encoder_decoder",
        |v| v == &Value::Bool(false),
        "encoder-decoder checkpoints are not mapped",
    )?;
    let bos_token_id = o.token("bos_token_id");
    let eos_token_id = o.token("eos_token_id");
    let pad = o.token("pad_token_id");
    // The engine's pad id marks targets the loss ignores: the checkpoint's pad, else its end of
    // sequence, else 0.
    config.pad_id = [pad, eos_token_id]
        .into_iter()
        .flatten()
        .find(|&id| (id as usize) < config.vocab)
        .unwrap_or(0);
    o.finish()?;
    Ok(Parsed {
        architecture,
        config,
        bos_token_id,
        eos_token_id,
    })
}

fn decoder_only(
    vocab: usize,
    d_model: usize,
    heads: usize,
    d_ff: usize,
    layers: usize,
) -> TransformerConfig {
    TransformerConfig {
        vocab,
        d_model,
        heads,
        d_ff,
        encoder_layers: 0,
        decoder_layers: layers,
        pre_ln: true,
        output_bias: false,
        ..TransformerConfig::default()
    }
}

fn gpt2<'a>(o: &mut Options<'a>) -> Result<TransformerConfig, PretrainedProblem> {
    let d_model = o.required("n_embd")?;
    let positions = o.required("n_positions")?;
    if let Some(n_ctx) = o.usize("n_ctx")? {
        if n_ctx != positions {
            return Err(unsupported(
                "n_ctx",
                &Value::from(n_ctx),
                format!("must equal n_positions {positions}"),
            ));
        }
    }
    let d_ff = o.usize("n_inner")?.unwrap_or(4 * d_model);
    let mut c = decoder_only(
        o.required("vocab_size")?,
        d_model,
        o.required("n_head")?,
        d_ff,
        o.required("n_layer")?,
    );
    c.learned_positions = true;
    c.max_positions = Some(positions);
    c.norm_eps = o.f32("layer_norm_epsilon")?.unwrap_or(1e-5);
    if let Some(v) = o.get("activation_function") {
        c.activation = activation("activation_function", v)?;
    }
    c.tied_embeddings = o.bool("tie_word_embeddings", true)?;
    o.expect(
        "scale_attn_weights",
        |v| v == &Value::Bool(true),
        "scores are always scaled by 1/sqrt(head_dim)",
    )?;
    o.expect(
        "scale_attn_by_inverse_layer_idx",
        |v| v == &Value::Bool(false),
        "per-layer score scaling is not implemented",
    )?;
    o.expect(
        "add_cross_attention",
        |v| v == &Value::Bool(false),
        "GPT-2 with cross-attention is not mapped",
    )?;
    Ok(c)
}

fn llama<'a>(o: &mut Options<'a>) -> Result<TransformerConfig, PretrainedProblem> {
    let d_model = o.required("hidden_size")?;
    let heads = o.required("num_attention_heads")?;
    let mut c = decoder_only(
        o.required("vocab_size")?,
        d_model,
        heads,
        o.required("intermediate_size")?,
        o.required("num_hidden_layers")?,
    );
    c.norm = Norm::RmsNorm;
    c.norm_eps = o.f32("rms_norm_eps")?.unwrap_or(1e-6);
    c.gated_feed_forward = true;
    c.activation = match o.get("hidden_act") {
        Some(v) => activation("hidden_act", v)?,
        None => Activation::Silu,
    };
    c.kv_heads = o.usize("num_key_value_heads")?;
    c.tied_embeddings = o.bool("tie_word_embeddings", false)?;
    let attention_bias = o.bool("attention_bias", false)?;
    let mlp_bias = o.bool("mlp_bias", false)?;
    if attention_bias != mlp_bias {
        return Err(unsupported(
            "mlp_bias",
            &Value::Bool(mlp_bias),
            format!("must equal attention_bias ({attention_bias}): the engine has one bias setting for all projections"),
        ));
    }
    c.bias = attention_bias;
    if let Some(hd) = o.usize("head_dim")? {
        if heads == 0 || hd * heads != d_model {
            return Err(unsupported(
                "head_dim",
                &Value::from(hd),
                format!("must be hidden_size / num_attention_heads = {d_model} / {heads}"),
            ));
        }
    }
    // Rotary positions cover whatever the model is built for; max_position_embeddings bounds
    // nothing the engine computes (llama3 scaling reads its own original length).
    o.usize("max_position_embeddings")?;
    let (base, scaling) = rope(o)?;
    c.rope_base = Some(base);
    c.rope_scaling = scaling;
    Ok(c)
}

/// `rope_theta` and `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5).
fn rope<'a>(o: &mut Options<'a>) -> Result<(f32, Option<RopeScaling>), PretrainedProblem> {
    let theta = o.f32("rope_theta")?;
    let (key, params) = match (o.get("rope_parameters"), o.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, Some(s)) => ("rope_scaling", Some(s)),
        (None, None) => ("rope_scaling", None),
    };
    let Some(params) = params else {
        return Ok((theta.unwrap_or(10000.0), None));
    };
    let p = params
        .as_object()
        .ok_or_else(|| unsupported(key, params, "must be an object"))?;
    let field = |name: &str| p.get(name).and_then(Value::as_f64);
    let theta = field("rope_theta")
        .map(|x| x as f32)
        .or(theta)
        .unwrap_or(10000.0);
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let need = |name: &str| {
        field(name).ok_or_else(|| unsupported(key, params, format!("{kind} scaling needs {name}")))
    };
    let known: &[&str] = match kind {
        "default" => &["rope_type", "type", "rope_theta"],
        "linear" => &["rope_type", "type", "rope_theta", "factor"],
        "llama3" => &[
            "rope_type",
            "type",
            "rope_theta",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        other => {
            return Err(unsupported(
                key,
                params,
                format!(
                    "rope type {other:?} is not implemented; supported: default, linear, llama3"
                ),
            ))
        }
    };
    if let Some(extra) = p.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(unsupported(
            &format!("{key}.{extra}"),
            &p[extra],
            format!("is not part of {kind} rope scaling as the engine implements it"),
        ));
    }
    let scaling = match kind {
        "linear" => Some(RopeScaling::Linear {
            factor: need("factor")? as f32,
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: need("factor")? as f32,
            low_freq_factor: need("low_freq_factor")? as f32,
            high_freq_factor: need("high_freq_factor")? as f32,
            original_max_positions: need("original_max_position_embeddings")? as usize,
        }),
        _ => None,
    };
    Ok((theta, scaling))
}
