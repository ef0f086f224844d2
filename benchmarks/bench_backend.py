"""The CPU backend on and off (AMDLLM_BACKEND), each command in its own process, alternating, in one run.

Rows, on a Llama-3.2-1B-shaped checkpoint (random bf16 weights, written by bench_scale.py's writer):
  eval       `amdllm eval --json` (--dtype auto), ~1,150 tokens of the held-out course text
  generate   `amdllm generate --json`, 64 new tokens (--dtype auto: bf16 with the row kernel, else float32)
  generate_float32   the same with --dtype float32 (the per-layer views alone, without the row kernel)
  generate_small     the same, 128 tokens, on the course's default model (XLA:CPU's options for a small model)
  finetune   `amdllm finetune --json`, 4 steps of 1 x 256, rank 8 (--dtype auto)
  serve      `amdllm serve` (--dtype auto): start, warm chat requests of 1 and 33 tokens (bench_scale.serve_once)
  course     `python -m amdllm.course.notebooks run` of the six lessons on the default model
Each side's figure is the best of --rounds rounds (its peak memory the largest); the ratio is on / off.

    python benchmarks/bench_backend.py [--work build/scale] [--only eval,generate,finetune,serve,course]
                                       [--rounds 2] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import (EVAL_CHARS, LLAMA32_1B, PROMPT, REPO, amdllm, last_json, machine, measured,  # noqa: E402
                         write_checkpoint)
from common import table, write_json  # noqa: E402

ROWS = ("eval", "generate", "generate_float32", "generate_small", "finetune", "serve", "course")
SIDES = ("on", "off")


def commands(ck: Path, work: Path) -> dict:
    """row -> (argv, the figure of merit from the process and its JSON: higher is better, its unit)."""
    text, data = work / "heldout.txt", work / "train.jsonl"
    return {
        "eval": (amdllm("eval", "--model", str(ck), "--text", str(text), "--json"),
                 lambda p, o: o.get("tokens", 0) / p["wall_s"], "tokens/s of the whole command"),
        "generate": (amdllm("generate", "--model", str(ck), "--prompt", PROMPT, "--max-new-tokens", "64", "--json"),
                     lambda p, o: o.get("tokens_per_second", 0), "steady decode tokens/s"),
        "generate_float32": (amdllm("generate", "--model", str(ck), "--prompt", PROMPT, "--max-new-tokens", "64",
                                    "--dtype", "float32", "--json"),
                             lambda p, o: o.get("tokens_per_second", 0), "steady decode tokens/s"),
        "generate_small": (amdllm("generate", "--prompt", PROMPT, "--max-new-tokens", "128", "--json"),
                           lambda p, o: o.get("tokens_per_second", 0), "steady decode tokens/s"),
        "finetune": (amdllm("finetune", "--model", str(ck), "--data", str(data), "--out", str(work / "lora"),
                            "--steps", "4", "--batch-size", "1", "--seq-len", "256", "--rank", "8",
                            "--no-progress", "--json"),
                     lambda p, o: o.get("tokens_per_second", 0), "training tokens/s (median step)"),
        "serve": ([sys.executable, str(REPO / "benchmarks" / "bench_scale.py"), "--serve-once", str(ck), "auto"],
                  lambda p, o: 1 / o["s_per_decoded_token"] if o.get("s_per_decoded_token") else 0,
                  "decoded tokens/s seen by a client"),
        "course": ([sys.executable, "-m", "amdllm.course.notebooks", "run", "--out", str(work / "course")],
                   lambda p, o: 1 / p["wall_s"], "1 / wall seconds"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="build/scale")
    p.add_argument("--only", default=",".join(ROWS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="backend_cpu", help="the JSON file's name in --out")
    a = p.parse_args(argv)
    only = [r for r in ROWS if r in a.only.split(",")]
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ck = work / "llama-3.2-1b-shape"
    if not (ck / "config.json").is_file():
        write_checkpoint(ck, LLAMA32_1B)
    nbytes = sum(f.stat().st_size for f in ck.glob("*.safetensors"))
    (work / "heldout.txt").write_text((REPO / "data" / "corpus_heldout.txt").read_text()[:EVAL_CHARS])
    lines = (REPO / "data" / "corpus_train.txt").read_text().splitlines()[:40]
    (work / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    cmds = commands(ck, work)
    runs = {(r, s): [] for r in only for s in SIDES}
    for i in range(a.rounds):
        for r in only:
            for s in SIDES:
                for d in ("course", "lora"):  # each run starts from nothing
                    shutil.rmtree(work / d, ignore_errors=True)
                proc = measured(cmds[r][0], env={"AMDLLM_BACKEND": s})
                o = last_json(proc)
                o = o[0] if isinstance(o, list) and o else o
                runs[r, s].append({**{k: proc[k] for k in ("rc", "wall_s", "cpu_s", "peak_rss_gb")},
                                   "figure": cmds[r][1](proc, o) if proc["rc"] == 0 else 0, "json": o,
                                   "stderr_tail": proc["stderr"][-600:] if proc["rc"] else ""})
                print(f"round {i + 1} {r} backend {s}: {json.dumps({k: v for k, v in runs[r, s][-1].items() if k != 'json'})}",
                      file=sys.stderr, flush=True)
    rows = []
    for r in only:
        best = {s: max(runs[r, s], key=lambda x: x["figure"]) for s in SIDES}
        rss = {s: max(x["peak_rss_gb"] for x in runs[r, s]) for s in SIDES}
        on, off = best["on"]["figure"], best["off"]["figure"]
        rows.append({"row": r, "unit": cmds[r][2], "on": round(on, 3), "off": round(off, 3),
                     "on_over_off": round(on / off, 2) if off else None,
                     "on_wall_s": best["on"]["wall_s"], "off_wall_s": best["off"]["wall_s"],
                     "on_peak_rss_gb": rss["on"], "off_peak_rss_gb": rss["off"],
                     "on_dtype": best["on"]["json"].get("dtype"), "off_dtype": best["off"]["json"].get("dtype"),
                     "ok": all(x["rc"] == 0 for s in SIDES for x in runs[r, s])})
    print(table(rows, ["row", "unit", "on", "off", "on_over_off", "on_wall_s", "off_wall_s", "on_peak_rss_gb",
                       "off_peak_rss_gb", "on_dtype", "off_dtype"]))
    write_json({"checkpoint_bytes": nbytes, "cpu": machine(), "rounds": a.rounds, "rows": rows,
                "runs": {f"{r} {s}": v for (r, s), v in runs.items()}}, a.out, a.name)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
