//! Where each of the engine's parameters comes from in a Hugging Face checkpoint: the tensors (one,
//! or several stacked by rows: LLaMA's q/k/v and gate/up projections) and whether they are stored
//! transposed (GPT-2's `Conv1D` weights are `[in, out]`).

use crate::model::pretrained::config::Architecture;

/// The checkpoint tensors of one engine parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    /// Checkpoint names, stacked by rows in this order.
    pub tensors: Vec<String>,
    /// The checkpoint stores the (single) tensor as `[in, out]`.
    pub transposed: bool,
}

fn one(name: String, transposed: bool) -> Option<Source> {
    Some(Source {
        tensors: vec![name],
        transposed,
    })
}

fn stacked(names: Vec<String>) -> Option<Source> {
    Some(Source {
        tensors: names,
        transposed: false,
    })
}

/// The source of engine parameter `ours`; `prefix` is the checkpoint's body prefix (`transformer.`
/// or empty for GPT-2, `model.` for LLaMA).
pub(crate) fn source(arch: Architecture, prefix: &str, ours: &str) -> Option<Source> {
    let p = prefix;
    match (arch, ours) {
        (_, "out.weight") => one("lm_head.weight".into(), false),
        (Architecture::Gpt2, "tgt.embed") => one(format!("{p}wte.weight"), false),
        (Architecture::Gpt2, "tgt.pos") => one(format!("{p}wpe.weight"), false),
        (Architecture::Gpt2, "dec.norm.gamma") => one(format!("{p}ln_f.weight"), false),
        (Architecture::Gpt2, "dec.norm.beta") => one(format!("{p}ln_f.bias"), false),
        (Architecture::Llama, "tgt.embed") => one(format!("{p}embed_tokens.weight"), false),
        (Architecture::Llama, "dec.norm.gamma") => one(format!("{p}norm.weight"), false),
        _ => {
            let rest = ours.strip_prefix("dec.")?;
            let (layer, part) = rest.split_once('.')?;
            let layer: usize = layer.parse().ok()?;
            let (module, param) = part.rsplit_once('.')?;
            match arch {
                Architecture::Gpt2 => gpt2_layer(p, layer, module, param),
                Architecture::Llama => llama_layer(p, layer, module, param),
            }
        }
    }
}

fn gpt2_layer(p: &str, i: usize, module: &str, param: &str) -> Option<Source> {
    let hf = match module {
        "ln1" => "ln_1",
        "ln2" => "ln_2",
        "self_attn.qkv" => "attn.c_attn",
        "self_attn.out" => "attn.c_proj",
        "ff.in" => "mlp.c_fc",
        "ff.out" => "mlp.c_proj",
        _ => return None,
    };
    let (hf_param, transposed) = match (module, param) {
        ("ln1" | "ln2", "gamma") => ("weight", false),
        ("ln1" | "ln2", "beta") => ("bias", false),
        ("ln1" | "ln2", _) => return None,
        (_, "weight") => ("weight", true),
        (_, "bias") => ("bias", false),
        _ => return None,
    };
    one(format!("{p}h.{i}.{hf}.{hf_param}"), transposed)
}

fn llama_layer(p: &str, i: usize, module: &str, param: &str) -> Option<Source> {
    let base = format!("{p}layers.{i}");
    let hf_param = match param {
        "gamma" | "weight" => "weight",
        "bias" => "bias",
        _ => return None,
    };
    match (module, param) {
        ("ln1", "gamma") => one(format!("{base}.input_layernorm.weight"), false),
        ("ln2", "gamma") => one(format!("{base}.post_attention_layernorm.weight"), false),
        ("self_attn.qkv", "weight" | "bias") => stacked(
            ["q_proj", "k_proj", "v_proj"]
                .map(|m| format!("{base}.self_attn.{m}.{hf_param}"))
                .to_vec(),
        ),
        ("self_attn.out", "weight" | "bias") => {
            one(format!("{base}.self_attn.o_proj.{hf_param}"), false)
        }
        ("ff.in", "weight" | "bias") => stacked(
            ["gate_proj", "up_proj"]
                .map(|m| format!("{base}.mlp.{m}.{hf_param}"))
                .to_vec(),
        ),
        ("ff.out", "weight" | "bias") => one(format!("{base}.mlp.down_proj.{hf_param}"), false),
        _ => None,
    }
}

/// Checkpoint tensors that are not parameters: buffers older `transformers` versions saved (GPT-2's
/// causal mask, LLaMA's rotary frequencies, which the engine computes itself), and the output head
/// of a tied model (`transformers` ties it to the embedding whatever the file holds).
pub(crate) fn ignored(name: &str, tied: bool) -> bool {
    (tied && name == "lm_head.weight")
        || name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with(".rotary_emb.inv_freq")
}
