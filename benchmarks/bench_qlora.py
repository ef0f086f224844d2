"""QLoRA (LoRA on a frozen GPTQ 4-bit base): peft + GPTQModel read our adapter alike, and a QLoRA step vs a LoRA step.

1. peft + GPTQModel (the ecosystem row). `amdllm quantize` makes the course default model a GPTQ
   checkpoint (4-bit g128, sym, no act-order, 16 x 256 calibration windows), `amdllm finetune --model
   GPTQ_DIR` trains a QLoRA adapter on it (Alpaca rows of the course task), and the held-out course text's
   perplexity with that adapter is measured twice: by `amdllm eval --model GPTQ_DIR --adapter ADAPTER
   --dtype float32`, and in GPTQModel's interpreter by transformers' `AutoModelForCausalLM.from_pretrained`
   (GPTQModel's `gptq_torch` kernel, float32, on the CPU) + `peft.PeftModel.from_pretrained`, with the
   protocol of `amdllm eval` (docs/cli.md) written again here on transformers' own tokenizer. Both sides
   also measure the base alone (peft's `disable_adapter`). The row gives both perplexities, their relative
   difference, and how many GPTQ linears peft wrapped with LoRA. Without a GPTQModel interpreter (or
   without optimum in it: transformers' GPTQ loader and peft's `dispatch_gptq` both require it) the row
   says so instead of failing. tests/test_qlora_peft.py asserts the same comparison (<= 1e-3 relative).

2. QLoRA step vs LoRA step, on the bench_lora.py shape (hidden 512, 8 layers, vocab 8192, random
   weights; written by transformers at float32 with the course tokenizer), quantized 4-bit g128 by
   `amdllm quantize --method rtn`. `amdllm finetune --json` runs on the float32 checkpoint (LoRA) and on the
   GPTQ one (QLoRA), each in its own process, one after the other, alternating for --rounds rounds, with
   the same data and options (rank 8, all seven projections, batch 8 x 256, float32, --steps steps).
   Per run: tokens/s from the median step time of metrics.jsonl (steps 2.., the first includes the first
   batch transfer; compilation happens before step 1), XLA's memory per device for the compiled step and
   the frozen weights' bytes (the `memory` of finetune's JSON), peak RSS, wall seconds of the process.
   Reports each side's median and spread over rounds and the ratio QLoRA / LoRA (median, and per round).

    python benchmarks/bench_qlora.py [--out bench_results] [--json] [--rounds 3] [--steps 10] [--skip-peft]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import find_gptqmodel_python, summarize, table, write_json  # noqa: E402


def add_lora_shape_args(p) -> None:
    """The model and run shape (a 31M Llama, batch 8 x 256, rank 8 on all projections)."""
    for flag, default in (("--hidden", 512), ("--layers", 8), ("--heads", 8), ("--kv-heads", 2), ("--mlp", 1408),
                          ("--vocab", 8192), ("--batch", 8), ("--seq", 256), ("--rank", 8)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")

REPO = Path(__file__).resolve().parents[1]
PPL_TOLERANCE = 1e-3   # |ours / peft's - 1| on the held-out text (the test's bound too)
PEFT_BACKEND = "gptq_torch"  # GPTQModel's plain PyTorch kernel: dequantize, then a float matmul
PEFT_NEEDS = ("gptqmodel", "optimum", "peft", "transformers")
QLORA_STEPS, QLORA_LR = 12, 6e-3  # part 1's adapter: moves the held-out perplexity by ~25% (a real difference)


# ---- 1. peft + GPTQModel ----------------------------------------------------------------------------------
def peft_side(gptq_dir: str, adapter_dir: str, text_file: str, seq_len: int, batch_size: int,
              backend: str = PEFT_BACKEND) -> None:
    """Runs in the GPTQModel interpreter: transformers loads the GPTQ checkpoint (GPTQModel's kernels) on the
    CPU in float32, peft applies the adapter; perplexity of text_file by `amdllm eval`'s protocol, with the
    adapter and without. Prints one line, PEFT_RESULT {json}."""
    # GPTQModel's torch kernel wraps its dequantize in torch.compile (inductor: a C++ compile per shape, tens
    # of seconds on 2 cores); eager computes the same thing (measured: identical perplexities)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    t0 = time.perf_counter()
    import peft  # GPTQModel's interpreter only (optional, heavy): peft, torch, transformers, gptqmodel, optimum
    import torch
    import transformers
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from peft import PeftModel
    from peft.tuners.lora.gptq import GPTQLoraLinear
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig
    from importlib.metadata import version

    t1 = time.perf_counter()
    qc = json.loads((Path(gptq_dir) / "config.json").read_text())["quantization_config"]
    # backend is a loading attribute: it overrides the checkpoint's quantization_config. "auto" picks, on a
    # CPU with AVX512, TorchCpuAvx512Linear: a C++ extension compiled at first use (99 s on 2 cores, then
    # cached in ~/.cache/gptqmodel), the same perplexities here once built (measured)
    model = AutoModelForCausalLM.from_pretrained(gptq_dir, device_map="cpu", dtype=torch.float32,
                                                 quantization_config=GPTQConfig(bits=qc["bits"], backend=backend))
    model.eval()
    quant = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, BaseQuantLinear)}
    pm = PeftModel.from_pretrained(model, adapter_dir)
    pm.eval()
    wrapped = [n for n, m in pm.named_modules() if isinstance(m, GPTQLoraLinear)]
    lora_b = [p for n, p in pm.named_parameters() if "lora_B" in n]
    t2 = time.perf_counter()

    # `amdllm eval`'s protocol (amdllm/infer/evaluate.py): the text tokenized whole, consecutive windows of
    # seq_len tokens, the last kept if it has >= 2; each predicts its tokens 1..n-1; perplexity = exp(mean NLL)
    ids = AutoTokenizer.from_pretrained(gptq_dir)(Path(text_file).read_text(encoding="utf-8"))["input_ids"]
    wins = [w for w in (ids[i:i + seq_len] for i in range(0, len(ids), seq_len)) if len(w) >= 2]
    full = [w for w in wins if len(w) == seq_len]
    batches = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + \
              [[w] for w in wins if len(w) != seq_len]  # the short last window alone: no padding anywhere

    def perplexity() -> dict:
        total, count = 0.0, 0
        with torch.inference_mode():
            for b in batches:
                x = torch.tensor(b, dtype=torch.long)
                logits = pm(input_ids=x).logits.float()
                nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                        x[:, 1:].reshape(-1), reduction="sum")
                total += float(nll)  # accumulated in float64 on the host, like amdllm's side
                count += x[:, 1:].numel()
        return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}

    with_adapter = perplexity()
    with pm.disable_adapter():
        base = perplexity()
    t3 = time.perf_counter()
    res = {"loader": "transformers.AutoModelForCausalLM.from_pretrained(device_map='cpu', dtype=float32) + "
                     "peft.PeftModel.from_pretrained",
           "backend": backend, "kernels": sorted(set(quant.values())), "quant_linears": len(quant),
           "lora_wrapped": len(wrapped), "lora_wrapper": GPTQLoraLinear.__name__,
           "lora_B_max_abs": max(float(p.abs().max()) for p in lora_b) if lora_b else None,
           "adapter": with_adapter, "base": base, "text_tokens": len(ids), "windows": len(wins),
           "seconds": {"import": round(t1 - t0, 2), "load": round(t2 - t1, 2), "eval": round(t3 - t2, 2)},
           "versions": {"gptqmodel": version("gptqmodel"), "optimum": version("optimum"), "peft": peft.__version__,
                        "transformers": transformers.__version__, "torch": torch.__version__}}
    print("PEFT_RESULT " + json.dumps(res), flush=True)


def peft_reference(python: str, gptq_dir, adapter_dir, text_file, seq_len: int = 256, batch_size: int = 8,
                   backend: str = PEFT_BACKEND, timeout: float = 600) -> dict:
    """peft_side in `python` (GPTQModel's interpreter, common.find_gptqmodel_python) -> its result dict."""
    cmd = [python, str(Path(__file__).resolve()), "--peft-side", str(gptq_dir), str(adapter_dir), str(text_file),
           "--seq-len", str(seq_len), "--batch-size", str(batch_size), "--peft-backend", backend]
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0 or "PEFT_RESULT " not in proc.stdout:
        raise RuntimeError(f"peft + GPTQModel side ({python}) exited with {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    # GPTQModel's logging may share the line: take what follows the marker
    return json.loads(proc.stdout[proc.stdout.rindex("PEFT_RESULT ") + 12:].splitlines()[0])


def amdllm_cli(args: list[str], timeout: float = 900) -> tuple[dict, dict]:
    """`amdllm ARGS --json` in its own process -> (its JSON, {"wall_s"})."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "amdllm.cli", *args, "--json"], capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"amdllm {' '.join(args[:1])} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line), {"wall_s": round(wall, 1), "stderr": proc.stderr}


def rel(a: float, b: float) -> float:
    return abs(a / b - 1.0)


def peft_row(tmp: Path, a) -> dict:
    """Part 1: quantize, QLoRA-train, then our perplexity vs peft-on-GPTQModel's of the same adapter."""
    from amdllm import course

    python, why, explicit = find_gptqmodel_python(a.gptqmodel_python, need=PEFT_NEEDS)
    if python is None and explicit and a.require_gptqmodel:
        sys.exit(f"GPTQModel interpreter: {why}")
    gptq, adapter, text = tmp / "gptq", tmp / "qlora", course.heldout_text_path()
    q, tq = amdllm_cli(["quantize", "--out", str(gptq), "--bits", "4", "--group-size", "128",
                        "--samples", "16"])
    f, tf = amdllm_cli(["finetune", "--model", str(gptq), "--data", str(course.task_paths()[0]),
                        "--out", str(adapter), "--steps", str(a.qlora_steps), "--lr", str(a.qlora_lr),
                        "--no-progress"])
    evals = ["eval", "--model", str(gptq), "--dtype", "float32", "--text", str(text)]
    ours, _ = amdllm_cli(evals + ["--adapter", str(adapter)])
    ours_base, _ = amdllm_cli(evals)
    row = {"gptq": {k: q[k] for k in ("method", "bits", "group_size", "sym", "act_order", "format")},
           "qlora": {"steps": f["steps"], "lr": a.qlora_lr, "final_loss": f["final_loss"]},
           "amdllm": {"adapter": {k: ours[k] for k in ("perplexity", "nll", "tokens")},
                      "base": {k: ours_base[k] for k in ("perplexity", "nll", "tokens")}},
           "adapter_effect_rel": rel(ours["perplexity"], ours_base["perplexity"]),
           "text": str(text), "seq_len": ours["window_tokens"], "windows": ours["windows"],
           "seconds": {"quantize": tq["wall_s"], "finetune": tf["wall_s"]}}
    if python is None:
        row["peft"] = f"not run: no GPTQModel interpreter with {', '.join(PEFT_NEEDS)}: {why}"
        return row
    t0 = time.perf_counter()
    ref = peft_reference(python, gptq, adapter, text, seq_len=ours["window_tokens"], backend=a.peft_backend)
    row["seconds"]["peft_side"] = round(time.perf_counter() - t0, 1)
    row["peft"] = {**ref, "python": python}
    row["rel_diff_adapter"] = rel(ours["perplexity"], ref["adapter"]["perplexity"])
    row["rel_diff_base"] = rel(ours_base["perplexity"], ref["base"]["perplexity"])
    row["same_tokens"] = ours["tokens"] == ref["adapter"]["tokens"]
    row["within_tolerance"] = row["rel_diff_adapter"] <= PPL_TOLERANCE and row["same_tokens"]
    return row


# ---- 2. QLoRA step vs LoRA step ----------------------------------------------------------------------------
def random_checkpoint(out: Path, a) -> Path:
    """The bench_lora.py shape with random weights, saved by transformers at float32 with the course
    tokenizer (its 1,152 ids fit the 8,192-token vocabulary)."""
    import torch
    from transformers import LlamaForCausalLM

    from amdllm import course
    from amdllm.io.tokenizer import WRITTEN_FILES
    from bench_lora import hf_config

    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(a)).to(torch.float32).save_pretrained(out)
    for name in WRITTEN_FILES:
        shutil.copy(course.data_dir() / "tokenizer" / name, out / name)
    return out


def finetune_run(model: Path, out: Path, a) -> dict:
    """One `amdllm finetune` process on `model`; step time from its metrics.jsonl."""
    from amdllm import course

    shutil.rmtree(out, ignore_errors=True)
    res, t = amdllm_cli(["finetune", "--model", str(model), "--data", str(course.task_paths()[0]), "--out", str(out),
                         "--steps", str(a.steps), "--rank", str(a.rank), "--targets", a.targets,
                         "--batch-size", str(a.batch), "--seq-len", str(a.seq), "--dtype", "float32",
                         "--lr", "1e-4", "--no-progress"])
    steps = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    secs = [s["step_seconds"] for s in steps if "step_seconds" in s][1:]  # the first: the batch's first transfer
    m = res["memory"]
    return {"step_seconds": statistics.median(secs), "step_seconds_all": [round(s, 4) for s in secs],
            "tokens_per_second": a.batch * a.seq / statistics.median(secs),
            "xla_bytes_per_device": m["xla_bytes_per_device"], "plan_bytes_per_device": m["plan_bytes_per_device"],
            "frozen_weights_bytes": m["weights_bytes_this_process"], "peak_rss_bytes": m["peak_rss_bytes"],
            "final_loss": res["final_loss"], "wall_s": t["wall_s"]}


def step_rows(tmp: Path, a) -> dict:
    """Part 2: the float32 checkpoint (LoRA) and its RTN 4-bit g128 (QLoRA), alternating processes."""
    fp = random_checkpoint(tmp / "fp", a)
    q, tq = amdllm_cli(["quantize", "--model", str(fp), "--out", str(tmp / "rtn"), "--method", "rtn",
                        "--bits", "4", "--group-size", "128"])
    sides = {"lora": fp, "qlora": tmp / "rtn"}
    runs = {k: [] for k in sides}
    for r in range(a.rounds):
        for name, model in sides.items():
            runs[name].append(finetune_run(model, tmp / f"run_{name}", a))
            print(f"round {r + 1}/{a.rounds} {name}: {runs[name][-1]['tokens_per_second']:,.0f} tokens/s, "
                  f"XLA {runs[name][-1]['xla_bytes_per_device'] / 1e9:.3f} GB", file=sys.stderr, flush=True)
    out = {"shape": {"hidden": a.hidden, "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads,
                     "mlp": a.mlp, "vocab": a.vocab},
           "options": {"rank": a.rank, "targets": a.targets, "batch": a.batch, "seq_len": a.seq, "steps": a.steps,
                       "dtype": "float32", "rounds": a.rounds, "quantize": "rtn 4-bit g128 sym"},
           "quantize_wall_s": tq["wall_s"]}
    for name, rs in runs.items():
        out[name] = {"tokens_per_second": summarize([r["tokens_per_second"] for r in rs]),
                     "xla_bytes_per_device": rs[-1]["xla_bytes_per_device"],
                     "plan_bytes_per_device": rs[-1]["plan_bytes_per_device"],
                     "frozen_weights_bytes": rs[-1]["frozen_weights_bytes"],
                     "peak_rss_bytes": summarize([r["peak_rss_bytes"] for r in rs]),
                     "runs": rs}
    per_round = [q["tokens_per_second"] / l["tokens_per_second"] for l, q in zip(runs["lora"], runs["qlora"])]
    lo, ql = out["lora"], out["qlora"]
    out["ratio_qlora_over_lora"] = {
        "tokens_per_second": ql["tokens_per_second"]["median"] / lo["tokens_per_second"]["median"],
        "tokens_per_second_per_round": per_round,
        "xla_bytes_per_device": ql["xla_bytes_per_device"] / lo["xla_bytes_per_device"],
        "frozen_weights_bytes": ql["frozen_weights_bytes"] / lo["frozen_weights_bytes"]}
    return out


def print_tables(res: dict) -> None:
    if "peft_gptqmodel" in res:
        r = res["peft_gptqmodel"]
        theirs = r["peft"] if isinstance(r["peft"], dict) else {}
        rows = [{"perplexity": f"GPTQ {'+ QLoRA adapter' if what == 'adapter' else 'alone'}",
                 "amdllm": r["amdllm"][what]["perplexity"],
                 "peft+GPTQModel": theirs.get(what, {}).get("perplexity", "n/a"),
                 "rel_diff": f"{r[f'rel_diff_{what}']:.2e}" if f"rel_diff_{what}" in r else "n/a"}
                for what in ("adapter", "base")]
        print(table(rows, ["perplexity", "amdllm", "peft+GPTQModel", "rel_diff"]))
    if "step" in res:
        s, ratio = res["step"], res["step"]["ratio_qlora_over_lora"]
        rows = [{"step": "tokens/s (median)", "lora": s["lora"]["tokens_per_second"]["median"],
                 "qlora": s["qlora"]["tokens_per_second"]["median"], "qlora/lora": ratio["tokens_per_second"]}]
        rows += [{"step": k.replace("_", " "), "lora": s["lora"][k], "qlora": s["qlora"][k], "qlora/lora": ratio[k]}
                 for k in ("xla_bytes_per_device", "frozen_weights_bytes")]
        print(table(rows, ["step", "lora", "qlora", "qlora/lora"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write OUT/qlora.json")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--skip-peft", action="store_true", help="part 2 only")
    p.add_argument("--skip-steps", action="store_true", help="part 1 only")
    p.add_argument("--gptqmodel-python", default=None, help="interpreter with gptqmodel, optimum and peft "
                   "(default: common.find_gptqmodel_python's search)")
    p.add_argument("--require-gptqmodel", action="store_true", help="fail (not skip) if it is missing")
    p.add_argument("--peft-backend", default=PEFT_BACKEND, help="GPTQModel kernel for the peft side")
    p.add_argument("--qlora-steps", type=int, default=QLORA_STEPS, help="part 1's finetune steps")
    p.add_argument("--qlora-lr", type=float, default=QLORA_LR, help="part 1's learning rate")
    add_lora_shape_args(p)
    p.add_argument("--steps", type=int, default=10, help="finetune steps per run (part 2)")
    p.add_argument("--rounds", type=int, default=3, help="LoRA, QLoRA process pairs (part 2)")
    p.add_argument("--peft-side", nargs=3, metavar=("GPTQ", "ADAPTER", "TEXT"), help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=8, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.peft_side:
        peft_side(*a.peft_side, a.seq_len, a.batch_size, a.peft_backend)
        return 0

    res = {"glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""), "cpu_count": os.cpu_count(),
           "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not a.skip_peft:
            res["peft_gptqmodel"] = peft_row(tmp / "peft", a)
            print(json.dumps(res["peft_gptqmodel"]), file=sys.stderr, flush=True)
        if not a.skip_steps:
            res["step"] = step_rows(tmp / "step", a)
    res["load_average_after"] = os.getloadavg()
    if a.json:
        print(json.dumps(res))
    else:
        print(json.dumps(res, indent=1))
    if not a.json:
        print_tables(res)
    write_json(res, a.out, "qlora")
    return 0


if __name__ == "__main__":
    sys.exit(main())
