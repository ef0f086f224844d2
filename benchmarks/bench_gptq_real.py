"""GPTQ on a real model: amdllm against GPTQModel on SmolLM2-135M-Instruct, quality and time.

The model is the course's chat model (`amdllm.course.chat_model`, converted to float32). The text is
English prose with no download (`amdllm.course.english`): Python's standard-library docstrings, one
set of modules to calibrate on and another to score. Both tools quantize from the same
calibration windows (--samples windows of --seq-len tokens, drawn for each of --seeds as the call
`amdllm quantize --calib` makes, and handed to GPTQModel as token ids) with the same settings:
4-bit, symmetric, true-sequential, damp 0.01, calibration batch 8. For each group size it
compares:
  - "gar": no act-order, with the group-aware order (GPTQModel's `act_group_aware`; both default to it);
  - "natural": no act-order, columns in order;
  - "act-order": desc_act, columns by decreasing diag(H);
  - "gar-mse", "act-order-mse": "gar" and "act-order" with the reference quantizer's grid search on both
    sides (`amdllm quantize --mse`, GPTQModel's mse=2.4: each group's range shrunk to the least rounding
    error); the three above run without it (`--no-mse`, GPTQModel's default);
  - "defaults": each tool at its own defaults for the rest: amdllm's damp 0.01 and grid search against
    GPTQModel's damp 0.05 and none, both with the group-aware order (amdllm's side is "gar-mse" again).
Each side runs in its own process: `amdllm quantize`, the command a user runs, and GPTQModel 7.7
in its own interpreter (see bench_gptq.py). Both checkpoints are read by amdllm's loader and scored
by `amdllm eval`'s protocol (non-overlapping 256-token windows). Damage is perplexity minus
float32's. The draw of windows moves it more than the tools differ, so the target compares sums over
the seeds: amdllm's damage at most GPTQModel's, and its wall time at most GPTQModel's.
A group size that does not divide every projection's in_features (128 here: hidden 576) is reported
as not possible, since neither tool can form those groups.

    python benchmarks/bench_gptq_real.py [--out bench_results] [--samples 32] [--seq-len 256] [--seeds 0,1,2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gptq import find_gptqmodel_python, timed_child  # noqa: E402
from common import table, write_json  # noqa: E402

ORDERS = {"gar": ["--no-mse"], "natural": ["--no-act-group-aware", "--no-mse"], "act-order": ["--act-order", "--no-mse"],
          "gar-mse": ["--mse"], "act-order-mse": ["--act-order", "--mse"], "defaults": []}
GPTQMODEL_FLAGS = {"gar": ["--act-group-aware"], "natural": [], "act-order": ["--act-order"],
                   "defaults": ["--gptqmodel-defaults"], "gar-mse": ["--act-group-aware", "--mse", "2.4"],
                   "act-order-mse": ["--act-order", "--mse", "2.4"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seeds", default="0,1,2", help="calibration draws; both tools get the same windows for each")
    ap.add_argument("--group-sizes", default="64,128")
    ap.add_argument("--orders", default=",".join(ORDERS), help=f"some of {','.join(ORDERS)}")
    ap.add_argument("--gptqmodel-python", default=None, help="interpreter with gptqmodel installed")
    args = ap.parse_args()

    import numpy as np

    from amdllm.config import LlamaConfig
    from amdllm.course.chat_model import chat_model_dir
    from amdllm.course.english import calibration_text, evaluation_text
    from amdllm.infer.evaluate import evaluate_text
    from amdllm.infer.protocols import calib_windows
    from amdllm.io import checkpoint
    from amdllm.io.tokenizer import encoder, load_tokenizer
    from amdllm.quant.gptq import fit_group_size

    model_dir = chat_model_dir()
    cfg = LlamaConfig.from_json(model_dir)
    tok = load_tokenizer(model_dir)
    heldout = evaluation_text()
    gm_python = find_gptqmodel_python(args.gptqmodel_python)

    def ppl(path):
        return round(evaluate_text(checkpoint.load(path), tok, heldout, seq_len=256, progress=False)["perplexity"], 4)

    rows, notes, pairs = [{"model": "float32", "perplexity": ppl(model_dir)}], {}, {}
    base = rows[0]["perplexity"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        calib = tmp / "calib.txt"
        calib.write_text(calibration_text())
        for seed in map(int, args.seeds.split(",")):
            # the windows `amdllm quantize --calib calib.txt --seed S` draws, for GPTQModel as token ids
            windows, _ = calib_windows([calib.read_text()], encoder(model_dir), args.samples, args.seq_len, seed)
            np.save(tmp / "windows.npy", windows)
            common = ["--calib", str(calib), "--samples", str(args.samples), "--seq-len", str(args.seq_len),
                      "--seed", str(seed), "--json", "--overwrite"]
            for G in map(int, args.group_sizes.split(",")):
                if fit_group_size(cfg, G)[1]:
                    notes[f"g{G}"] = (f"not possible: {G} does not divide the in_features "
                                      f"{sorted({cfg.hidden_size, cfg.q_dim, cfg.intermediate_size})}")
                    continue
                out = tmp / f"rtn{G}"
                _, t = timed_child([sys.executable, "-m", "amdllm.cli", "quantize", "--model", str(model_dir),
                                    "--out", str(out), "--method", "rtn", "--group-size", str(G), *common,
                                    "--no-mse"])  # the plain rounding, the baseline every order is held to
                rows.append({"model": f"RTN g{G}", "seed": seed, "perplexity": ppl(out), "wall_s": t["wall_s"]})
                done = {}
                for order in args.orders.split(","):
                    if order == "defaults" and "gar-mse" in done:  # amdllm's defaults are the "gar-mse" run
                        ours = done["gar-mse"]
                    else:
                        out = tmp / f"amdllm-{order}{G}"
                        _, t = timed_child([sys.executable, "-m", "amdllm.cli", "quantize", "--model", str(model_dir),
                                            "--out", str(out), "--group-size", str(G), *common, *ORDERS[order]])
                        ours = done[order] = {"model": f"amdllm g{G} {order}", "seed": seed, "perplexity": ppl(out), **t}
                        rows.append(ours)
                        print(rows[-1], flush=True)
                    if gm_python is None:
                        continue
                    gm = tmp / f"gptqmodel-{order}{G}"
                    shutil.rmtree(gm, ignore_errors=True)
                    cmd = [gm_python, str(Path(__file__).resolve().parent / "bench_gptq.py"), "--group-size", str(G),
                           *GPTQMODEL_FLAGS[order], "--gptqmodel-side", str(model_dir), str(tmp / "windows.npy"), str(gm)]
                    text, t = timed_child(cmd, env={**os.environ, "GPTQMODEL_CPU_WORKERS": str(os.cpu_count() or 1)})
                    res = json.loads(text[text.rindex("GPTQMODEL_RESULT ") + 17:].splitlines()[0])
                    theirs = {"model": f"GPTQModel {res['version']} g{G} {order}", "seed": seed,
                              "perplexity": ppl(gm), **t}
                    rows.append(theirs)
                    print(rows[-1], flush=True)
                    pairs.setdefault(f"g{G} {order}", []).append((ours, theirs))
    # calibration windows move the damage more than the tools' differences do: compare the mean over seeds
    for key, ps in pairs.items():
        d_ours = [o["perplexity"] - base for o, _ in ps]
        d_theirs = [t["perplexity"] - base for _, t in ps]
        dmg = sum(d_ours) / max(sum(d_theirs), 1e-9)
        wall = sum(o["wall_s"] for o, _ in ps) / sum(t["wall_s"] for _, t in ps)
        notes[key] = {"seeds": len(ps), "damage_amdllm_over_gptqmodel": round(dmg, 3),
                      "per_seed": [round(a / max(b, 1e-9), 3) for a, b in zip(d_ours, d_theirs)],
                      "wall_amdllm_over_gptqmodel": round(wall, 3),
                      "damage <= GPTQModel's": dmg <= 1.0, "time <= GPTQModel's": wall <= 1.0}
    if gm_python is None:
        notes["gptqmodel"] = "not importable (bench_gptq.py says how to install it): amdllm's rows only"
    for r in rows:
        r["damage"] = round(r["perplexity"] - base, 4)
    shown = [{**r, "perplexity": f"{r['perplexity']:.3f}", "damage": f"{r['damage']:.3f}"} for r in rows]
    print(table(shown, ["model", "perplexity", "damage", "wall_s", "cpu_s"]))
    print(json.dumps(notes, indent=1))
    write_json({"rows": rows, "comparisons": notes, "settings": vars(args),
                "text": {"python": sys.version.split()[0], "calibration_chars": len(calibration_text()),
                         "evaluation_chars": len(heldout)}}, args.out, "gptq_real")


if __name__ == "__main__":
    main()
