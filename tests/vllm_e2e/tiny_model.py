"""A tiny Llama checkpoint with random O(1) weights (dummy weights give flat logits), and a
word-level tokenizer over its 256-token vocabulary for the HTTP server (``vllm serve``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def make_tiny_llama(directory: Path, seed: int = 1234, num_kv_heads: int = 1,
                    **overrides) -> Path:
    """Write config.json + model.safetensors (fixed seed) into ``directory``; returns it.

    num_kv_heads: 1 (4 query heads share it; what vLLM's DCP rules need at tp=2) or 2 (GQA
    groups of 2 query heads). ``overrides`` replace other CONFIG entries (e.g.
    ``num_hidden_layers=4, hidden_size=256``; the TTFT benchmark builds a wider model this way).
    """
    from safetensors.torch import save_file

    config = {**CONFIG, "num_key_value_heads": num_kv_heads, **overrides}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, dim = (config["num_attention_heads"], config["num_key_value_heads"],
                            config["head_dim"])

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).contiguous()

    weights = {"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": rand(vocab, hidden, scale=0.5)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(heads * dim, hidden, scale=0.6),
            p + "self_attn.k_proj.weight": rand(kv_heads * dim, hidden, scale=0.6),
            p + "self_attn.v_proj.weight": rand(kv_heads * dim, hidden, scale=0.3),
            p + "self_attn.o_proj.weight": rand(hidden, heads * dim, scale=0.1),
            p + "mlp.gate_proj.weight": rand(inter, hidden, scale=0.1),
            p + "mlp.up_proj.weight": rand(inter, hidden, scale=0.1),
            p + "mlp.down_proj.weight": rand(hidden, inter, scale=0.1),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    save_file(weights, str(directory / "model.safetensors"))
    return directory


SPECIAL_TOKENS = {"<unk>": 0, "<s>": 1, "</s>": 2}  # ids match CONFIG's bos/eos


def token_text(token_id: int) -> str:
    """The tokenizer's word for ``token_id``: ``t<id>`` (``<unk>``/``<s>``/``</s>`` for 0-2)."""
    names = {v: k for k, v in SPECIAL_TOKENS.items()}
    return names.get(token_id, f"t{token_id}")


def write_word_tokenizer(directory: Path, vocab_size: int = CONFIG["vocab_size"]) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (a whitespace word-level tokenizer,
    one word ``t<id>`` per token id, no BOS added) into ``directory``; returns it.

    This is all vLLM's HTTP server needs to run without ``--skip-tokenizer-init``: text
    prompts, detokenized output and logprobs keyed by token text. Built by the ``tokenizers``
    library (a vLLM dependency), so no binary file is checked in.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token_text(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": CONFIG["max_position_embeddings"]}, indent=1))
    return directory
