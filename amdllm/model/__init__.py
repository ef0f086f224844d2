"""The Llama model: parameters with logical axes, the forward pass (textbook in `llama`, fast paths in
`fast`, run per layer on a CPU through `views`), its layers, LoRA factors (`lora`) and GPTQ-packed weights (`quantized`).

    from amdllm.model import Llama, forward, to_pure
    logits, _ = forward(model.cfg, *to_pure(model), tokens, run=model.run())

`forward` here is the fast one (`amdllm.model.fast.forward`): what training, evaluation and decoding
run. `amdllm.model.llama.forward` is the textbook one, which `model(tokens)` calls.
"""
from amdllm.model.attention import NEG_INF, attention, cached_attention  # noqa: F401
from amdllm.model.fast import FUSE_MIN_ROWS, causal_attention, forward  # noqa: F401
from amdllm.model.layers import (apply_rope, constrain, head, linear, lora_delta, rms_norm,  # noqa: F401
                                 rope_inv_freq, rope_tables, swiglu)
from amdllm.model.llama import (PROJECTIONS, TEXTBOOK, KVCache, Kernels, Layers, Llama, LoRA,  # noqa: F401
                                LoRAParam, Run, block, count_params, logit_tolerance, param_table, project,
                                to_pure)
from amdllm.model.loss import cross_entropy, token_nll  # noqa: F401
from amdllm.model.quantized import QuantLinear  # noqa: F401
from amdllm.model.views import init_cache, layer_views, split_cache  # noqa: F401
