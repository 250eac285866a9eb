#!/usr/bin/env python3
"""Hugging Face reference fixtures for `crates/serve/tests/serving/hf_checkpoints.rs`.

Creates small randomly initialised GPT-2 and LLaMA models with `transformers`, saves each with
`save_pretrained` (config.json, safetensors, sharded for one of them) beside a small byte-level BPE
tokenizer, and records what `transformers` computes: the logits for fixed token ids and a greedy
continuation of a tokenized prompt. The reference is the saved directory loaded back with
`from_pretrained(dtype=float32)`, as a user would load it: the weights are those of the file (f32,
bf16 or f16 converted to f32, as the engine converts them), and buffers such as LLaMA's rotary
frequencies are computed afresh in f32 (a model cast to f16 and back keeps f16-rounded frequencies,
which moves its logits by up to 5e-3).

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors
    /tmp/hf/bin/python scripts/hf_fixtures.py            # writes crates/serve/tests/fixtures/hf/
    /tmp/hf/bin/python scripts/hf_fixtures.py --check DIR NAME
        # loads a model the engine saved (DIR) with transformers and compares its logits with
        # fixture NAME's model after the same fine-tuning (see crates/serve/tests/serving/hf_checkpoints.rs)
    /tmp/hf/bin/python scripts/hf_fixtures.py --smollm-shaped DIR
        # a random model of SmolLM-135M's configuration (135M parameters, bf16) for benchmarks
"""

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file, load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "serve", "tests", "fixtures", "hf")
VOCAB = 300
PROMPT = "the quick brown fox"
NEW_TOKENS = 12

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "attention is all you need, said the transformer to the recurrent network",
    "a small model runs on any gpu through wgpu and webgpu",
    "flash attention tiles the scores so they never leave the chip",
    "the cat sat on the mat and the dog sat on the log",
    "keys and values are cached so each new token costs one row of attention",
] * 4


def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


def fixtures():
    """(name, model class, config, storage dtype, max shard size)."""
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return [
        (
            "gpt2-tied",
            GPT2LMHeadModel,
            GPT2Config(n_positions=64, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
                       **common),
            torch.float16,
            None,
        ),
        (
            "llama-gqa",
            LlamaForCausalLM,
            LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                         "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32},
                        **common),
            torch.bfloat16,
            "60KB",
        ),
        (
            "llama-tied",
            LlamaForCausalLM,
            LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.2,
                        rope_parameters={"rope_type": "linear", "rope_theta": 500.0,
                                         "factor": 2.0},
                        **common),
            torch.float32,
            None,
        ),
    ]


def reference(model, tok, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 16), generator=g)
    with torch.no_grad():
        logits = model(ids).logits.float()
        prompt = tok(PROMPT, return_tensors="pt").input_ids
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    # The smallest gap between the best and second-best logit along the greedy path: a greedy
    # comparison is only meaningful where it is far above the engine's error.
    margin = min(float(torch.topk(l[0], 2).values[0] - torch.topk(l[0], 2).values[1])
                 for l in out.logits)
    new = out.sequences[0, prompt.shape[1]:].tolist()
    return ids, logits, prompt[0].tolist(), new, margin


def make():
    tok = tokenizer()
    for seed, (name, cls, config, dtype, shard) in enumerate(fixtures()):
        torch.manual_seed(1000 + seed)
        model = cls(config).eval()
        model = model.to(dtype)
        out = os.path.join(ROOT, name)
        shutil.rmtree(out, ignore_errors=True)
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(out, **kwargs)
        tok.save_pretrained(out)
        for extra in ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json"):
            path = os.path.join(out, extra)
            if os.path.exists(path) and extra != "tokenizer_config.json":
                os.remove(path)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ids, logits, prompt_ids, greedy, margin = reference(model, tok, seed)
        save_file({"input_ids": ids.to(torch.int32).contiguous(),
                   "logits": logits.contiguous()},
                  os.path.join(out, "expected.safetensors"))
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"prompt": PROMPT, "prompt_ids": prompt_ids, "greedy": greedy,
                       "greedy_min_margin": margin, "dtype": str(dtype).replace("torch.", ""),
                       "transformers": __import__("transformers").__version__,
                       "torch": torch.__version__}, f, indent=1)
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        print(f"{name}: {size / 1024:.0f} KB, greedy {greedy}, min margin {margin:.3f}")


def check(saved, name):
    """Loads `saved` (written by the engine) and compares its logits with `crates/serve/tests/fixtures/hf/NAME`'s
    expected ids run through it, printing the worst difference against the engine's own logits
    (`engine_logits.safetensors` in `saved`)."""
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    engine = load_file(os.path.join(saved, "engine_logits.safetensors"))
    with torch.no_grad():
        logits = model(engine["input_ids"].long()).logits
    err = (logits - engine["logits"]).abs().max().item()
    print(f"{name}: transformers loads the engine's save; max |logit difference| {err:.3e}")
    return err


def smollm_shaped(out):
    """SmolLM-135M's configuration with random weights: a real-sized model without a download."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", nargs=2, metavar=("DIR", "NAME"))
    ap.add_argument("--smollm-shaped", metavar="DIR")
    a = ap.parse_args()
    if a.smollm_shaped:
        sys.exit(smollm_shaped(a.smollm_shaped))
    if a.check:
        sys.exit(0 if check(*a.check) < 1e-3 else 1)
    make()
