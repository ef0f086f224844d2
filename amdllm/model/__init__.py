"""The Llama model: the textbook forward (`llama`), its layers, the plain-JAX fast paths (`fast`), narrow
weights on a CPU (`narrow`), LoRA factors (`lora`) and GPTQ-packed weights (`quantized`).

    from amdllm.model import Llama, forward, to_pure
    logits, _ = forward(model.cfg, *to_pure(model), tokens, run=model.run())

`forward` here is `amdllm.model.fast.forward`, the textbook block with the fast kernels swapped in.
"""
from amdllm.model.attention import NEG_INF, attention, cached_attention  # noqa: F401
from amdllm.model.fast import FUSE_MIN_ROWS, causal_attention, forward, init_cache, split_cache  # noqa: F401
from amdllm.model.layers import (apply_rope, constrain, head, linear, lora_delta, rms_norm,  # noqa: F401
                                 rope_inv_freq, rope_tables, swiglu)
from amdllm.model.llama import (PROJECTIONS, TEXTBOOK, KVCache, Kernels, Layers, Llama, LoRA,  # noqa: F401
                                LoRAParam, Run, block, count_params, logit_tolerance, param_table, project,
                                to_pure)
from amdllm.model.loss import cross_entropy, token_nll  # noqa: F401
from amdllm.model.quantized import QuantLinear  # noqa: F401
