"""GPTQ, amdllm vs GPTQModel: quantize time and perplexity on the embedded default model (+ optional grid).

Both sides quantize the same float32 checkpoint (the course default model) with the same calibration
windows (--samples windows of --seq-len tokens of the course training corpus, seed 0: `amdllm quantize`
draws them with the call made here, whose result is written to a .npy file for GPTQModel) and the same
GPTQ settings: 4-bit, group 128, symmetric, true-sequential, damp 0.01, no act-order, and the
group-aware order ("act_group_aware", on by default in both) off on both sides, so the toy compares the
textbook algorithm; calibration batch 8. The real model's comparison, with it on, is bench_gptq_real.py.
Each side runs in its own process, one after the other, timed from the parent (wall and CPU seconds of
the child) and from inside (load -> calibrate -> quantize -> pack -> save, no imports/start-up).
amdllm's side is the `amdllm quantize` command a user runs (it also computes its per-layer GPTQ-vs-RTN
report, GPTQModel does its own logging). Both checkpoints are then loaded by `amdllm.io.checkpoint.load`
and scored by the same protocol: `amdllm eval`'s (docs/cli.md) (held-out course text, tokenized whole,
non-overlapping 256-token windows).

GPTQModel runs in the interpreter --gptqmodel-python (default $AMDLLM_GPTQMODEL_PYTHON, else
.venv/gptqmodel-env/bin/python if it exists, else this one if it can import gptqmodel). `make bench`
installs it into its own environment layered on .venv (see the Makefile: GPTQModel 7.7.0 declares
torch>=2.14.1, which pip cannot install next to the pinned torch 2.13.0, but it runs on 2.13.0), with
GPTQMODEL_CPU_WORKERS set to the core count.

--grid adds the older table: bfloat16, RTN through the CLI, per-channel and 3-bit GPTQ/RTN in memory, and
decode tokens/s of float32 vs int4 (several more minutes).

    python benchmarks/bench_gptq.py [--out bench_results] [--samples 64] [--seq-len 256] [--grid]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import find_gptqmodel_python as common_find_gptqmodel_python  # noqa: E402
from common import table, write_json  # noqa: E402

PPL_TARGET = 1.02   # amdllm's perplexity may be at most 2% above GPTQModel's
TIME_TARGET = 1.0   # amdllm's quantize time at most GPTQModel's


def gptqmodel_side(model_dir: str, windows_npy: str, out: str, group_size: int, act_order: bool,
                   act_group_aware: bool = False, own_defaults: bool = False, mse: float = 0.0) -> None:
    """Runs in the GPTQModel interpreter: load, quantize, save; prints one JSON line with the seconds."""
    import numpy as np
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel import __version__ as version

    windows = np.load(windows_npy)
    calib = [{"input_ids": w.tolist(), "attention_mask": [1] * len(w)} for w in windows]
    t0 = time.perf_counter()
    # offload_to_disk (on by default, for models larger than memory) only adds disk writes for a 14 MB model
    if own_defaults:  # GPTQModel's own choices for the rest (damp 0.05, act_group_aware on)
        qc = QuantizeConfig(bits=4, group_size=group_size, sym=True, desc_act=False, offload_to_disk=False)
    else:
        qc = QuantizeConfig(bits=4, group_size=group_size, sym=True, desc_act=act_order,
                            act_group_aware=act_group_aware and not act_order,
                            damp_percent=0.01, true_sequential=True, offload_to_disk=False, mse=mse)
    # dtype float32 like amdllm's side (GPTQModel's "auto" loads bfloat16 on a CPU)
    model = GPTQModel.load(model_dir, qc, device="cpu", dtype=torch.float32)
    t1 = time.perf_counter()
    model.quantize(calib, batch_size=8)
    model.save(out)
    t2 = time.perf_counter()
    print("GPTQMODEL_RESULT " + json.dumps({"seconds": round(t2 - t0, 2), "load_s": round(t1 - t0, 2),
                                             "version": version, "torch": torch.__version__}), flush=True)


def timed_child(cmd: list[str], env: dict | None = None, log: Path | None = None) -> tuple[str, dict]:
    """Run cmd to completion -> (stdout, {wall_s, cpu_s}); cpu_s is the child's user+system time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]}... exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.stdout, {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def find_gptqmodel_python(arg: str | None) -> str | None:
    """The interpreter to run GPTQModel in (common.find_gptqmodel_python: the argument, else
    $AMDLLM_GPTQMODEL_PYTHON, else .venv/gptqmodel-env, else this one); None if not asked for and none has it."""
    python, why, explicit = common_find_gptqmodel_python(arg)
    if python is None and explicit:  # asked for explicitly (make bench sets it): an error, not a skip
        sys.exit(f"GPTQModel interpreter: {why}")
    return python


def code_agreement(dir_a: Path, dir_b: Path, bits: int = 4) -> dict:
    """How alike two GPTQ checkpoints are: share of identical codes, largest relative scale difference."""
    import numpy as np

    from amdllm.io.gptq_format import read_checkpoint_tensors
    from amdllm.model.quantized import unpack_rows
    a, b = read_checkpoint_tensors(dir_a), read_checkpoint_tensors(dir_b)
    same = far = total = 0
    scale_rel = 0.0
    for name in (k for k in a if k.endswith(".qweight")):
        ca, cb = np.asarray(unpack_rows(a[name], bits)), np.asarray(unpack_rows(b[name], bits))
        same, total = same + int((ca == cb).sum()), total + ca.size
        far += int((np.abs(ca - cb) > 1).sum())
        sa, sb = (x[name.replace("qweight", "scales")].astype(np.float32) for x in (a, b))
        scale_rel = max(scale_rel, float(np.max(np.abs(sa - sb) / np.maximum(np.abs(sb), 1e-12))))
    return {"identical_codes": round(same / total, 5), "codes_off_by_more_than_1": round(far / total, 5),
            "max_scale_rel_diff": round(scale_rel, 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--gptqmodel-python", default=None, help="interpreter with gptqmodel installed")
    ap.add_argument("--require-gptqmodel", action="store_true", help="fail (not skip) if it is missing")
    ap.add_argument("--grid", action="store_true", help="also the per-channel/3-bit/RTN table and decode")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--act-group-aware", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gptqmodel-defaults", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mse", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--gptqmodel-side", nargs=3, metavar=("MODEL", "WINDOWS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gptqmodel_side:
        return gptqmodel_side(*args.gptqmodel_side, args.group_size, args.act_order, args.act_group_aware,
                              args.gptqmodel_defaults, args.mse)

    import numpy as np

    from amdllm.io import checkpoint
    from amdllm import course, quant as gptq
    from amdllm.config import get_preset
    from amdllm.infer.evaluate import evaluate_text
    from amdllm.quant.calibrate import devices_needed
    from amdllm.io.tokenizer import load_tokenizer

    model_dir = course.default_model_dir()
    tok = load_tokenizer(model_dir)
    heldout = course.heldout_text_path().read_text()
    calib_file = course.data_dir() / "corpus_train.txt"
    # the same call `amdllm quantize` makes with --samples/--seq-len/--seed 0 on this file
    windows = gptq.calibration_windows(tok(calib_file.read_text())["input_ids"], args.samples, args.seq_len, 0)
    gm_python = find_gptqmodel_python(args.gptqmodel_python)
    if gm_python is None and args.require_gptqmodel:
        sys.exit("gptqmodel is not importable (pass --gptqmodel-python or set AMDLLM_GPTQMODEL_PYTHON; "
                 "`make bench` installs it)")

    def ppl(model):
        return evaluate_text(model, tok, heldout, seq_len=256, progress=False)["perplexity"]

    setting = f"4-bit g{args.group_size}"
    rows, extra = [], {"settings_note": "sym, true-sequential, damp 0.01, calibration batch 8, "
                                        f"{'act-order' if args.act_order else 'no act-order'}"}
    fp32 = checkpoint.load(model_dir)
    rows.append({"model": "float32", "perplexity": ppl(fp32), "bytes": gptq.model_bytes(fp32)})
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        np.save(tmp / "windows.npy", windows)
        # 1. amdllm: the CLI end to end (load, calibrate, solve, pack, save), as a user runs it
        methods = ("gptq", "rtn") if args.grid else ("gptq",)
        for method in methods:
            cmd = [sys.executable, "-m", "amdllm.cli", "quantize", "--model", str(model_dir), "--out",
                   str(tmp / method), "--method", method, "--samples", str(args.samples), "--seq-len",
                   str(args.seq_len), "--group-size", str(args.group_size), "--compare-rtn", "--json",
                   "--no-act-group-aware", "--no-mse"]  # GPTQModel's side runs without them too (above)
            out, t = timed_child(cmd + (["--act-order"] if args.act_order else []))
            res = json.loads(out)
            q = checkpoint.load(tmp / method)
            rows.append({"model": f"amdllm {method.upper()} {setting}", "perplexity": ppl(q),
                         "bytes": gptq.model_bytes(q), "wall_s": t["wall_s"], "cpu_s": t["cpu_s"],
                         "inproc_s": res["seconds"]})
            print(rows[-1], flush=True)
            if method == "gptq":
                report = json.loads((tmp / "gptq" / "gptq_report.json").read_text())
                quant_dir_model = q

        # 2. GPTQModel on the same windows, in its own interpreter
        if gm_python is None:
            extra["gptqmodel"] = ("not importable: pass --gptqmodel-python or set AMDLLM_GPTQMODEL_PYTHON "
                                  "(`make bench` installs GPTQModel 7.7.0); comparison skipped")
        else:
            workers = os.environ.get("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))
            gm_dir = tmp / "gptqmodel"
            cmd = [gm_python, str(Path(__file__).resolve()), "--group-size", str(args.group_size),
                   "--gptqmodel-side", str(model_dir), str(tmp / "windows.npy"), str(gm_dir)]
            out, t = timed_child(cmd + (["--act-order"] if args.act_order else []),
                                 env={**os.environ, "GPTQMODEL_CPU_WORKERS": workers},
                                 log=Path(args.out) / "gptqmodel.log" if args.out else None)
            # progress bars may share the line: take what follows the marker
            res = json.loads(out[out.rindex("GPTQMODEL_RESULT ") + 17:].splitlines()[0])
            q = checkpoint.load(gm_dir)   # GPTQModel's checkpoint, read by amdllm
            rows.append({"model": f"GPTQModel {res['version']} GPTQ {setting}", "perplexity": ppl(q),
                         "bytes": gptq.model_bytes(q), "wall_s": t["wall_s"], "cpu_s": t["cpu_s"],
                         "inproc_s": res["seconds"]})
            print(rows[-1], flush=True)
            extra["checkpoint_agreement"] = code_agreement(tmp / "gptq", gm_dir)
            extra["gptqmodel"] = {"version": res["version"], "torch": res["torch"],
                                  "cpu_workers": workers, "python": gm_python}
            ours, theirs = rows[1], rows[-1]
            extra["ratios_amdllm_over_gptqmodel"] = {
                "wall_time": round(ours["wall_s"] / theirs["wall_s"], 3),
                "cpu_time": round(ours["cpu_s"] / theirs["cpu_s"], 3),
                "inproc_time": round(ours["inproc_s"] / theirs["inproc_s"], 3),
                "perplexity": round(ours["perplexity"] / theirs["perplexity"], 5)}
            r = extra["ratios_amdllm_over_gptqmodel"]
            extra["targets"] = {"time <= GPTQModel's (wall)": r["wall_time"] <= TIME_TARGET,
                                f"perplexity <= {PPL_TARGET}x GPTQModel's": r["perplexity"] <= PPL_TARGET}

    if args.grid:
        grid(args, rows, extra, model_dir, windows, ppl, fp32, quant_dir_model, tok)

    # on paper: the Vicuna write-up's 13B and Llama 3.1 405B on 192 GB MI300X
    paper = {}
    for name in ("vicuna-13b", "llama-2-13b", "llama-3.1-405b"):
        cfg = get_preset(name)
        fp, q4 = gptq.paper_bytes(cfg, bits=16), gptq.paper_bytes(cfg, bits=4, group_size=128)
        paper[name] = {"fp16_gb": round(fp["total_gb"], 2), "gptq4_g128_gb": round(q4["total_gb"], 2),
                       "mi300x_fp16": devices_needed(fp["total_bytes"]),
                       "mi300x_gptq4": devices_needed(q4["total_bytes"])}

    worst = max(report, key=lambda r: r["gptq_err"] / max(r["rtn_err"], 1e-30))
    extra["layers_gptq_better"] = f"{sum(r['gptq_err'] < r['rtn_err'] for r in report)}/{len(report)}"
    extra["worst_layer_ratio"] = {k: worst[k] for k in ("layer", "proj", "gptq_err", "rtn_err")}
    extra["load_average"] = os.getloadavg()
    base = rows[0]["perplexity"]  # float32; the gaps are small, so 3 significant digits would hide them
    shown = [{**r, "perplexity": f"{r['perplexity']:.5f}",
              "vs_fp32": f"{100 * (r['perplexity'] / base - 1):+.3f}%"} for r in rows]
    print(table(shown, ["model", "perplexity", "vs_fp32", "bytes", "wall_s", "cpu_s", "inproc_s"]))
    print(json.dumps({"paper": paper, **extra}, indent=1))
    write_json({"rows": rows, "paper": paper, "settings": vars(args), **extra}, args.out, "gptq")


def grid(args, rows, extra, model_dir, windows, ppl, fp32, quant_dir_model, tok) -> None:
    """bfloat16, per-channel and 3-bit rows (in memory; 3-bit is not packable), decode tokens/s."""
    import jax.numpy as jnp

    from amdllm.io import checkpoint
    from amdllm import quant as gptq
    from amdllm.infer.generate import Decoder

    bf16 = checkpoint.load(model_dir, dtype=jnp.bfloat16)
    rows.insert(1, {"model": "bfloat16", "perplexity": ppl(bf16), "bytes": gptq.model_bytes(bf16)})
    for bits, G in ((4, -1), (3, 128), (3, -1)):
        for method in ("rtn", "gptq"):
            spec = gptq.QuantSpec(bits=bits, group_size=G, act_order=args.act_order)
            t0 = time.perf_counter()
            m, _ = gptq.quantize_model(checkpoint.load(model_dir), windows, spec, method=method, progress=False)
            rows.append({"model": f"amdllm {method.upper()} {bits}-bit "
                                  f"{'per-channel' if G == -1 else f'g{G}'} (in memory)",
                         "perplexity": ppl(m), "bytes": gptq.model_bytes(m) if bits != 3 else None,
                         "inproc_s": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)
    # decode tokens/s, float32 vs int4 (packed weights dequantized inside the jitted step)
    prompt = [tok("Once upon a time")["input_ids"]]
    for name, m in (("float32", fp32), ("gptq int4 g128", quant_dir_model)):
        d = Decoder(m, eos_ids=())
        for _ in range(2):  # the first run compiles
            for _ in d.stream(prompt, args.new_tokens):
                pass
        extra[f"decode_tokens_per_s_{name}"] = round(d.tokens_per_second(), 1)


if __name__ == "__main__":
    main()
