"""`amdllm quantize`: GPTQ or RTN into a GPTQ checkpoint directory (amdllm.quant)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp

from amdllm import course
from amdllm.cli.common import check_context, emit
from amdllm.cli.common import model_dir as resolve_model_dir
from amdllm.cli.datasets import read_dataset
from amdllm.config import LlamaConfig
from amdllm.files import atomic_write_text, check_output_dir, read_text, staged_dir
from amdllm.infer.protocols import calib_windows
from amdllm.io.checkpoint import load, stored_dtype
from amdllm.io.gptq_format import quant_config_dict, save_quantized
from amdllm.io.tokenizer import encoder
from amdllm.quant.calibrate import model_bytes, quantize_model
from amdllm.quant.gptq import MSE_NORM, QuantSpec, check_group_size, gar_applies


def run(args) -> int:
    res = run_quantize(args)
    emit(res, args.json, f"wrote {res['out']} ({res['method']} {res['bits']}-bit g{res['group_size']}, "
                         f"{res['format']}) in {res['seconds']} s")
    return 0


def run_quantize(args) -> dict:
    model_dir = resolve_model_dir(args.model)
    check_output_dir(args.out, [("--model", model_dir), ("--calib", args.calib), ("--dataset", args.dataset)],
                     command="quantize", overwrite=args.overwrite)
    cfg = LlamaConfig.from_json(model_dir)  # what the text and the weights must fit
    args.seq_len = check_context(args.seq_len, cfg, model_dir)
    spec = QuantSpec(bits=args.bits, group_size=args.group_size, sym=args.sym, act_order=args.act_order,
                     static_groups=args.static_groups, act_group_aware=args.act_group_aware,
                     percdamp=args.damp, mse=args.mse,
                     true_sequential=not args.no_true_sequential)
    if args.bits == 3:
        raise ValueError("--bits 3 runs in memory (amdllm.quant.quantize_model) but the packed format "
                         "supports 2, 4 and 8 bits only")
    windows, calib_report = None, {}
    if args.method == "gptq":  # the calibration text is read and cut before the weights load
        dataset = read_dataset(args, ("train",))
        if dataset is not None:
            texts, rule, calib_report = dataset
        else:
            calib = Path(args.calib) if args.calib else course.data_dir() / "corpus_train.txt"
            if not calib.is_file():
                raise FileNotFoundError(f"--calib {calib}: file not found")
            if args.calib is None and args.model is not None:  # as eval: a user's model on our stories
                print(f"amdllm quantize: no --calib given: calibrating on the course's stories ({calib}); "
                      "pass --calib FILE with text like your model's own use", file=sys.stderr)
            texts, rule, calib_report = [read_text(calib)], "wikitext2", {"calib": str(calib)}
        windows, report = calib_windows(texts, encoder(model_dir), args.samples, args.seq_len, args.seed,
                                        args.protocol, rule)
        calib_report.update(report)
    check_group_size(cfg, spec.group_size, model_dir)  # before the weights load
    t0 = time.perf_counter()
    # a bfloat16 checkpoint is held as bfloat16 (each layer is widened to float32 when it is quantized)
    model = load(model_dir, dtype=jnp.bfloat16 if stored_dtype(Path(model_dir)) == "bfloat16" else jnp.float32,
                 allow_pickle=args.allow_pickle)
    model, rows = quantize_model(model, windows, spec, method=args.method, progress=not args.json,
                                 compare_rtn=args.compare_rtn)
    qc = quant_config_dict(spec.bits, spec.group_size, spec.sym, spec.act_order,
                           static_groups=spec.static_groups, damp_percent=spec.percdamp,
                           true_sequential=spec.true_sequential, act_group_aware=gar_applies(spec),
                           mse=MSE_NORM if spec.mse else 0.0)
    with staged_dir(args.out) as staging:  # appears whole; an earlier result (--overwrite) goes only then
        save_quantized(model, staging, qc, tokenizer_from=model_dir)
        if rows:
            atomic_write_text(staging / "gptq_report.json", json.dumps(rows, indent=1))
    return {"out": str(args.out), "method": args.method, "bits": spec.bits, "group_size": spec.group_size,
            "sym": spec.sym, "act_order": spec.act_order, "act_group_aware": gar_applies(spec), "mse": spec.mse,
            "format": qc["checkpoint_format"],
            "seconds": round(time.perf_counter() - t0, 3), "model_bytes": model_bytes(model),
            "gptq_err": sum(r["gptq_err"] for r in rows) if rows else None,
            "rtn_err": sum(r["rtn_err"] for r in rows) if rows and args.compare_rtn else None,
            "calibration": calib_report or None}
