"""GPTQ on the embedded default model: `amdllm quantize` timing, perplexity table, bytes, decode speed.

Perplexity protocol: DESIGN.md's `amdllm eval` (held-out course text, tokenized whole, non-overlapping
256-token windows). Calibration: the course training corpus, --samples windows of --seq-len tokens,
seed 0. GPTQ settings: symmetric, true-sequential, damp 0.01, block 128 (act-order when --act-order).
3-bit rows use the in-memory quantized weights (the packed format is 2/4/8-bit only).
GPTQModel is compared only when `gptqmodel` is importable (it is not installed in the course image).

    python benchmarks/bench_gptq.py [--out bench_results] [--samples 128] [--seq-len 256]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()

    import jax.numpy as jnp
    import numpy as np

    from amdllm import checkpoint, course, gptq
    from amdllm.config import get_preset
    from amdllm.evaluate import evaluate_text
    from amdllm.generate import Decoder
    from amdllm.gptq_calib import devices_needed
    from amdllm.tokenizer import load_tokenizer

    model_dir = course.default_model_dir()
    tok = load_tokenizer(model_dir)
    heldout = course.heldout_text_path().read_text()
    calib_file = course.data_dir() / "corpus_train.txt"
    windows = gptq.calibration_windows(tok(calib_file.read_text())["input_ids"], args.samples, args.seq_len, 0)

    def ppl(model):
        return evaluate_text(model, tok, heldout, seq_len=256, progress=False)["perplexity"]

    rows, extra = [], {}
    # 1. the CLI end to end (load, calibrate, solve, pack, save), as a user runs it
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("gptq", "rtn"):
            cmd = [sys.executable, "-m", "amdllm.cli", "quantize", "--model", str(model_dir), "--out",
                   f"{tmp}/{method}", "--method", method, "--samples", str(args.samples), "--seq-len",
                   str(args.seq_len), "--json"] + (["--act-order"] if args.act_order else [])
            t0 = time.perf_counter()
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            extra[f"cli_{method}_seconds"] = round(time.perf_counter() - t0, 1)
            q = checkpoint.load(f"{tmp}/{method}")
            rows.append({"model": f"{method.upper()} 4-bit g128 (CLI, from disk)", "perplexity": ppl(q),
                         "bytes": gptq.model_bytes(q), "quantize_s": extra[f"cli_{method}_seconds"]})
            if method == "gptq":
                extra["gptq_vs_rtn_layer_error"] = {"gptq": res["gptq_err"], "rtn": res["rtn_err"]}
                report = json.loads(Path(f"{tmp}/gptq/gptq_report.json").read_text())
                quant_dir_model = q

    # 2. float references and the in-memory grid (per-channel, 3-bit)
    fp32 = checkpoint.load(model_dir)
    rows.insert(0, {"model": "float32", "perplexity": ppl(fp32), "bytes": gptq.model_bytes(fp32)})
    bf16 = checkpoint.load(model_dir, dtype=jnp.bfloat16)
    rows.insert(1, {"model": "bfloat16", "perplexity": ppl(bf16), "bytes": gptq.model_bytes(bf16)})
    for bits, G in ((4, -1), (3, 128), (3, -1)):
        for method in ("rtn", "gptq"):
            spec = gptq.QuantSpec(bits=bits, group_size=G, act_order=args.act_order)
            t0 = time.perf_counter()
            m, _ = gptq.quantize_model(checkpoint.load(model_dir), windows, spec, method=method, progress=False)
            rows.append({"model": f"{method.upper()} {bits}-bit {'per-channel' if G == -1 else f'g{G}'}",
                         "perplexity": ppl(m), "bytes": gptq.model_bytes(m) if bits != 3 else None,
                         "quantize_s": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)

    # 3. decode tokens/s, float32 vs int4 (packed weights dequantized inside the jitted step)
    prompt = [tok("Once upon a time")["input_ids"]]
    for name, m in (("float32", fp32), ("gptq int4 g128", quant_dir_model)):
        d = Decoder(m, eos_ids=())
        for _ in range(2):  # the first run compiles
            for _ in d.stream(prompt, args.new_tokens):
                pass
        extra[f"decode_tokens_per_s_{name}"] = round(d.tokens_per_second(), 1)

    # 4. on paper: the Vicuna write-up's 13B and Llama 3.1 405B on 192 GB MI300X
    paper = {}
    for name in ("vicuna-13b", "llama-2-13b", "llama-3.1-405b"):
        cfg = get_preset(name)
        fp, q4 = gptq.paper_bytes(cfg, bits=16), gptq.paper_bytes(cfg, bits=4, group_size=128)
        paper[name] = {"fp16_gb": round(fp["total_gb"], 2), "gptq4_g128_gb": round(q4["total_gb"], 2),
                       "mi300x_fp16": devices_needed(fp["total_bytes"]),
                       "mi300x_gptq4": devices_needed(q4["total_bytes"])}

    try:
        import gptqmodel  # noqa: F401
        extra["gptqmodel"] = "installed but the comparison is not implemented in this script"
    except ImportError:
        extra["gptqmodel"] = "not installed (heavy CUDA-pinned dependencies); comparison skipped"

    worst = max(report, key=lambda r: r["gptq_err"] / max(r["rtn_err"], 1e-30))
    extra["layers_gptq_better"] = f"{sum(r['gptq_err'] < r['rtn_err'] for r in report)}/{len(report)}"
    extra["worst_layer_ratio"] = {k: worst[k] for k in ("layer", "proj", "gptq_err", "rtn_err")}
    print(table(rows, ["model", "perplexity", "bytes", "quantize_s"]))
    print(json.dumps({"paper": paper, **extra}, indent=1))
    write_json({"rows": rows, "paper": paper, "settings": vars(args), **extra}, args.out, "gptq")


if __name__ == "__main__":
    main()
