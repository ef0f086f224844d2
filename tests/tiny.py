"""Tiny random Llama checkpoints built locally with `transformers` (no network), shared by the tests.

    from tests.tiny import tiny_hf_config, make_hf_checkpoint
    ckpt_dir, hf_model = make_hf_checkpoint(tmp_path, num_key_value_heads=1)

Weights are random but *not* transformers' default init: norms are perturbed away from 1 and the
projections use a larger std, so logits are O(1) and a mis-loaded or mis-transposed tensor shows up
as a large difference instead of hiding below the tolerance.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def tiny_hf_config(**overrides):
    """A transformers LlamaConfig with tiny shapes (GQA 4q/2kv heads, hidden 64, 2 layers, vocab 128).

    `rope_scaling={...}` / `rope_theta=` are accepted in either transformers spelling; `head_dim=` works.
    """
    from transformers import LlamaConfig
    kw = {**TINY, **overrides}
    rs = kw.pop("rope_scaling", None)
    theta = kw.pop("rope_theta")
    # transformers 5 keeps rope settings in `rope_parameters`; passing it directly avoids deprecation paths
    kw["rope_parameters"] = {**(rs or {"rope_type": "default"}), "rope_theta": theta}
    kw.setdefault("attn_implementation", "eager")
    return LlamaConfig(**kw)


def make_hf_model(seed: int = 0, std: float = 0.08, **overrides):
    """A random transformers LlamaForCausalLM (float32, eval mode) with a fixed torch seed."""
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_hf_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    return model.eval()


def make_hf_checkpoint(tmp_path, *, dtype: str = "float32", max_shard_size=None, name: str = "hf",
                       seed: int = 0, **overrides):
    """Build a random tiny LlamaForCausalLM and `save_pretrained` it (safetensors) under tmp_path/name.

    dtype: "float32" | "bfloat16" | "float16" (the stored dtype). max_shard_size: e.g. "20KB" for shards.
    Returns (checkpoint_dir, hf_model) — hf_model is float32 with exactly the saved values (rounded
    to `dtype` first, so comparisons against it are fair).
    """
    import torch
    model = make_hf_model(seed=seed, **overrides)
    tdtype = getattr(torch, dtype)
    with torch.no_grad():  # round the reference's *parameters* to what is stored; buffers (RoPE
        for p in model.parameters():  # inv_freq) stay float32, as from_pretrained would compute them
            p.copy_(p.to(tdtype).to(torch.float32))
    out = Path(tmp_path) / name
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    copy.deepcopy(model).to(tdtype).save_pretrained(out, **kw)
    return out, model


def hf_logits(hf_model, tokens, attention_mask=None) -> np.ndarray:
    """float32 numpy logits [B, T, V] from a transformers model for int tokens [B, T]."""
    import torch
    with torch.no_grad():
        t = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        am = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
        return hf_model(input_ids=t, attention_mask=am).logits.float().numpy()


def random_tokens(batch: int, length: int, vocab: int = TINY["vocab_size"], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=(batch, length)).astype(np.int32)
