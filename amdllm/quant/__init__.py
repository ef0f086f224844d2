"""Post-training quantization: the GPTQ solver and RTN (`gptq`), calibration through the model
(`calibrate`), and the names a user needs from the packed format and the checkpoint I/O.

    from amdllm import quant
    model, report = quant.quantize_model(model, windows, quant.QuantSpec(bits=4, group_size=128))
    quant.save_quantized(model, "out", quant.quant_config_dict(4, 128, True, False), tokenizer_from=src)
"""
from amdllm.io.gptq_format import (QuantFormatError, load_quantized, quant_config_dict,  # noqa: F401
                                   read_quant_config, save_quantized)
from amdllm.model.quantized import (QuantLinear, dequantize, pack_cols, pack_rows,  # noqa: F401
                                    quantized_matmul, unpack_cols, unpack_rows)
from amdllm.quant.calibrate import (calibration_windows, devices_needed, model_bytes,  # noqa: F401
                                    paper_bytes, quantize_model)
from amdllm.quant.gptq import (GROUP_SIZES, SOLVER_BITS, GPTQError, QuantResult, QuantSpec,  # noqa: F401
                               errors_kwargs, rtn_error, fake_quant, find_params, fit_group_size,
                               gar_applies, gptq_quantize, group_aware_order, hessian_inverse, in_features,
                               quantize_codes, reconstruction_error, rtn_quantize)
