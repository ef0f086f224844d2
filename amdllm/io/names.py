"""Hugging Face's names for a Llama checkpoint's tensors and files, and ours: one table, used by every
reader and writer (dense checkpoints, GPTQ checkpoints, PEFT adapters)."""
from __future__ import annotations

# (our parameter, HF tensor name ({i} = layer index), HF stores it transposed?)
NAME_TABLE: tuple[tuple[str, str, bool], ...] = (
    ("embed_tokens",                   "model.embed_tokens.weight",                         False),  # [V, D]
    ("layers/q_proj",                  "model.layers.{i}.self_attn.q_proj.weight",          True),   # [H*hd, D]
    ("layers/k_proj",                  "model.layers.{i}.self_attn.k_proj.weight",          True),   # [Hkv*hd, D]
    ("layers/v_proj",                  "model.layers.{i}.self_attn.v_proj.weight",          True),   # [Hkv*hd, D]
    ("layers/o_proj",                  "model.layers.{i}.self_attn.o_proj.weight",          True),   # [D, H*hd]
    ("layers/gate_proj",               "model.layers.{i}.mlp.gate_proj.weight",             True),   # [F, D]
    ("layers/up_proj",                 "model.layers.{i}.mlp.up_proj.weight",               True),   # [F, D]
    ("layers/down_proj",               "model.layers.{i}.mlp.down_proj.weight",             True),   # [D, F]
    ("layers/input_layernorm",         "model.layers.{i}.input_layernorm.weight",           False),  # [D]
    ("layers/post_attention_layernorm", "model.layers.{i}.post_attention_layernorm.weight", False),  # [D]
    ("norm",                           "model.norm.weight",                                 False),  # [D]
    ("lm_head",                        "lm_head.weight",                                    True),   # [V, D]
)
# Buffers some (older) checkpoints carry that hold no learned weights: skipped silently.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# The module that holds each projection inside a decoder layer (transformers' and PEFT's paths).
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Files a checkpoint directory carries besides its weights; copied along whenever we write one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")


def hf_proj(i: int, proj: str) -> str:
    """'model.layers.{i}.self_attn.q_proj' (no suffix): the module path of a projection in layer i."""
    return f"model.layers.{i}.{HF_PARENT[proj]}.{proj}"

