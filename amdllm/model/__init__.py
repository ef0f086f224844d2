"""The Llama model: parameters with logical axes, the forward pass, LoRA factors, GPTQ-packed weights.

    from amdllm.model import Llama, forward, to_pure
"""
from amdllm.model.attention import NEG_INF, attention, cached_attention, causal_attention  # noqa: F401
from amdllm.model.llama import (FUSE_MIN_ROWS, FUSED, PROJECTIONS, KVCache, Layers, Llama,  # noqa: F401
                                LoRAParam, apply_rope, constrain, count_params, cross_entropy, decoder_layer,
                                forward, fuse_kernels, init_cache, linear, logit_tolerance, lora_delta,
                                param_table, rms_norm, rope_inv_freq, split_cache, swiglu, swiglu2, to_pure,
                                token_nll)
from amdllm.model.quantized import QuantLinear  # noqa: F401
