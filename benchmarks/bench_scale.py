"""The 1B class on a laptop: every command on a Llama-3.2-1B-shaped checkpoint, beside its peer, each in
its own process, with wall time and peak resident memory.

The checkpoint is written here: random bf16 weights (normal, std 0.02) in the Llama 3.2 1B shape (1.24B
parameters, vocabulary 128256, tied embeddings, Llama 3 RoPE scaling), with the course tokenizer (its ids
use only the first rows of the vocabulary; tokenization is not what is measured). Then:

  eval bf16 / fp32    `amdllm eval --dtype D`        vs transformers, the same protocol (docs/cli.md)
  generate            `amdllm generate`, 64 tokens, at its default (--dtype auto) and in float32   vs
                      transformers' greedy `generate` in its faster dtype here (both are run); steady decode
                      rates, prefill excluded on both sides; --rounds interleaved rounds, each side's best
  quantize            `amdllm quantize` 4-bit g128, 16 x 256 calibration   vs GPTQModel (when installed)
  finetune            `amdllm finetune`, 4 steps, batch 1 x 256, r8, at its default (the checkpoint's bf16) and
                      in float32     vs peft + torch AdamW in its faster dtype here (both are run where the
                      CPU has bf16 instructions; float32 alone where it has not: PyTorch's bf16 is slow there)
  serve               `amdllm serve` (auto, float32) start, then warm chat requests of 1 and 33 tokens: the time
                      per decoded token is their difference over 32 (compare generate's)   (no peer)
  convert             `amdllm convert` to float16    vs transformers from_pretrained + save_pretrained
  convert 8B          `amdllm convert` of a Llama-3.1-8B-shaped bf16 checkpoint (16 GB, written here)

Each row is one child process (generate: one per round); the parent reads the child's wall time and peak RSS (its own
RUSAGE_CHILDREN, measured in a fresh wrapper process per row, so rows never mix). Nothing else should
run on the machine meanwhile. Not part of `make test` (about 40 minutes on 2 cores; the 8B rows need
32 GB of free disk).

    python benchmarks/bench_scale.py [--work build/scale] [--only eval,generate,...] [--skip-8b] [--keep]
                                     [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_json  # noqa: E402

LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  rope_theta=500000.0)
LLAMA31_8B = dict(LLAMA32_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  head_dim=128, tie_word_embeddings=False,
                  rope_scaling=dict(LLAMA32_1B["rope_scaling"], factor=8.0))
TINY = dict(LLAMA32_1B, vocab_size=1152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # --shape tiny: checks the script only
ROWS = ("eval", "generate", "quantize", "finetune", "serve", "convert", "convert8b")
PROMPT = "Once upon a time, there was a little red fox who"
EVAL_CHARS = 5200  # ~1,150 course-tokenizer tokens of the held-out stories


# ------------------------------------------------------------------------------------------------
# The checkpoints
# ------------------------------------------------------------------------------------------------
def write_checkpoint(out: Path, shape: dict, seed: int = 0, max_shard_size="2GB") -> int:
    """A random bf16 Llama checkpoint of `shape`, streamed tensor by tensor; returns its weight bytes."""
    import ml_dtypes

    from amdllm.config import LlamaConfig
    from amdllm.io.checkpoint import hf_tensor_specs
    from amdllm.io.safetensors import write_sharded
    from amdllm.io.tokenizer import load_tokenizer

    tok = load_tokenizer(REPO / "data" / "tokenizer")
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "torch_dtype": "bfloat16",
           "dtype": "bfloat16", "initializer_range": 0.02, "attention_bias": False, "mlp_bias": False,
           **shape}
    cfg = LlamaConfig.from_dict(raw)
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def fetch(i, shp, norm):
        def f():
            if norm:
                return np.ones(shp, bf16)
            return (np.random.default_rng([seed, i]).standard_normal(shp, np.float32) * 0.02).astype(bf16)
        return f

    specs = hf_tensor_specs(cfg)
    entries = [(n, s[3], bf16, fetch(i, s[3], n.endswith("norm.weight"))) for i, (n, s) in enumerate(specs.items())]
    out.mkdir(parents=True, exist_ok=True)
    write_sharded(out, entries, max_shard_size, desc=f"writing {out.name}")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(REPO / "data" / "tokenizer" / f, out / f)
    return sum(int(np.prod(e[1], dtype=np.int64)) * 2 for e in entries)


# ------------------------------------------------------------------------------------------------
# One measured child process
# ------------------------------------------------------------------------------------------------
MEASURE = r"""
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
js = [line for line in p.stdout.splitlines() if line.startswith("{")]
print(json.dumps({"rc": p.returncode, "wall_s": round(wall, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
                  "peak_rss_gb": round(ru.ru_maxrss * 1024 / 1e9, 2), "stdout": p.stdout[-4000:],
                  "stderr": p.stderr[-3000:], "json": js[-1] if js else ""}))
"""


WARM_LIMIT = 8e9  # checkpoints up to this size are read into the page cache before each measured process


def warm_page_cache(argv: list[str]) -> None:
    """Read every checkpoint directory named in argv (its *.safetensors) through the page cache, untimed.
    Why: on the VMs of BENCHMARKS.md the kernel's memory reclaim (DAMON, `kdamond`) drops file pages that
    sat idle for a few minutes, so whichever side ran first read the 2.5 GB checkpoint from disk (amdllm's
    eval: 23.6 s in the bench against 12.8 s from a warm cache) and the next found it cached. Each side now
    starts from a warm cache, as a user's second command does."""
    for a in argv:
        files = sorted(Path(a).glob("*.safetensors")) if Path(a).is_dir() else []
        if files and sum(f.stat().st_size for f in files) <= WARM_LIMIT:
            for f in files:
                with open(f, "rb") as fh:
                    while fh.read(64 << 20):
                        pass


def measured(argv: list[str], env: dict | None = None) -> dict:
    """Run argv in its own process (through a fresh wrapper): {rc, wall_s, cpu_s, peak_rss_gb, stdout, stderr}.
    env: variables to set over this process's (a value of None removes the variable). The checkpoints argv
    names are read into the page cache first (untimed)."""
    warm_page_cache(argv)
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    p = subprocess.run([sys.executable, "-c", MEASURE, *argv], capture_output=True, text=True, env=env)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["rc"] != 0:
        print(f"  FAILED ({r['rc']}): {' '.join(argv[:6])} ...\n{r['stderr'][-1500:]}", file=sys.stderr)
    return r


def median_step(p: dict) -> float:
    """The median of the 5 steps a finetune process (peft's `--peer` side) timed."""
    return sorted(last_json(p).get("step_seconds", [1e9]))[2]


def amdllm(*args) -> list[str]:
    return [sys.executable, "-m", "amdllm.cli", *args]


def last_json(measured_run: dict) -> dict:
    """The last JSON line a `measured` process printed, whole ({} if none): `stdout` keeps only its tail, and
    `amdllm finetune --json` over per-layer views lists every layer's frozen weights (16 KB at the 1B shape)."""
    return json.loads(measured_run["json"]) if measured_run.get("json") else {}


# ------------------------------------------------------------------------------------------------
# Peers (each runs as `python bench_scale.py --peer NAME ...` in its own process)
# ------------------------------------------------------------------------------------------------
def peer_eval(model: str, text: str, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(os.cpu_count())
    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    ids = AutoTokenizer.from_pretrained(model)(Path(text).read_text()[:EVAL_CHARS])["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids), 256):
            w = ids[s:s + 256]
            if len(w) < 2:
                continue
            logits = m(input_ids=torch.tensor([w])).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(w[1:]), reduction="sum").item()
            count += len(w) - 1
    return {"nll": total / count, "tokens": count}


def peer_generate(model: str, dtype: str = "bfloat16") -> dict:
    """transformers' greedy generate of 64 tokens: tokens_per_second over the whole call (prefill included)
    and steady_tokens_per_second from the third new token on (amdllm's definition, `Decoder`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.t = []

        def put(self, value):  # first call: the prompt; then one call per new token
            self.t.append(time.perf_counter())

        def end(self):
            pass

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]])
    m.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)  # warm-up, as amdllm compiles first
    clock = Clock()
    t0 = time.perf_counter()
    out = m.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, streamer=clock)
    t = clock.t[1:]  # new tokens' times
    return {"tokens_per_second": 64 / (time.perf_counter() - t0), "new_tokens": int(out.shape[1] - ids.shape[1]),
            "steady_tokens_per_second": (len(t) - 3) / (t[-1] - t[2]), "dtype": dtype}


def peer_finetune(model: str, data: str, dtype: str = "float32") -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"]))
    tok = AutoTokenizer.from_pretrained(model)
    text = " ".join(json.loads(line)["text"] for line in open(data))
    ids = tok(text)["input_ids"][:257]
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=2e-4)
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(m(input_ids=x).logits[0], y[0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {"step_seconds": times, "loss": float(loss)}


def peer_convert(model: str, out: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(model, dtype=torch.float16).save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return {}


def cpu_flags() -> list[str]:
    try:
        return next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        return []


def bf16_instructions() -> list[str]:
    """The bf16 instructions this CPU lists: PyTorch's bf16 is fast only with them."""
    return [f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags()]


def machine() -> dict:
    """What the figures depend on: the CPU's model, cores and bf16 instructions (`bf16_instructions`)."""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None)
    except OSError:
        model = None
    return {"cpu": model, "cores": os.cpu_count(), "bf16_instructions": bf16_instructions(),
            "avx512f": "avx512f" in cpu_flags(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)}


def peer_main(argv) -> int:
    name, *rest = argv
    fn = {"eval": peer_eval, "generate": peer_generate, "finetune": peer_finetune, "convert": peer_convert}[name]
    print(json.dumps(fn(*rest)))
    return 0


def serve_once(model: str, dtype: str = "bfloat16") -> dict:
    """`amdllm serve` started; one chat request of 33 tokens (compiling), then three pairs of warm requests
    of 1 and 33 tokens; stopped: run as its own measured process. s_per_decoded_token: the median over the
    pairs of their time difference over 32 tokens, the server's decode step as a client sees it, HTTP
    included and the prompt's prefill excluded (compare generate's 1 / tokens_per_second)."""
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen(amdllm("serve", "--model", model, "--port", str(port), "--dtype", dtype),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read()[-2000:])
            try:
                served = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=2).read())["data"][0]["id"]
                break
            except OSError:
                time.sleep(1)
        ready = time.perf_counter() - t0

        def ask(n):
            body = json.dumps({"model": served, "messages": [{"role": "user", "content": "Tell me a story."}],
                               "max_tokens": n, "temperature": 0}).encode()
            req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            t1 = time.perf_counter()
            answer = json.loads(urllib.request.urlopen(req, timeout=600).read())
            return time.perf_counter() - t1, answer["usage"]["completion_tokens"]
        first = ask(33)  # compiles the prompt's prefill and the steps
        ones, longs = [], []
        for _ in range(3):
            ones.append(ask(1))
            longs.append(ask(33))
        per_token = sorted((tl - t1) / (nl - n1) for (t1, n1), (tl, nl) in zip(ones, longs))
        return {"ready_s": round(ready, 1), "first_request_s": round(first[0], 2),
                "one_token_s": [round(t, 3) for t, _ in ones], "33_tokens_s": [round(t, 3) for t, _ in longs],
                "completion_tokens": longs[-1][1], "s_per_decoded_token": round(per_token[1], 4),
                "s_per_token_prefill_included": round(sorted(t for t, _ in longs)[1] / longs[-1][1], 4)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="build/scale", help="where the checkpoints and outputs go")
    p.add_argument("--only", default=",".join(ROWS), help=f"rows to run, of {','.join(ROWS)}")
    p.add_argument("--skip-8b", action="store_true", help="leave out the 8B-shaped convert row")
    p.add_argument("--shape", choices=("1b", "tiny"), default="1b", help="tiny: a seconds-long run of the script")
    p.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    p.add_argument("--gptqmodel-python", default=os.environ.get("AMDLLM_GPTQMODEL_PYTHON"),
                   help="interpreter with gptqmodel (default $AMDLLM_GPTQMODEL_PYTHON; the row is skipped without)")
    p.add_argument("--out", default="bench_results", help="directory for scale.json")
    p.add_argument("--rounds", type=int, default=2, help="generate: interleaved rounds of each side (best taken)")
    a = p.parse_args(argv)
    only = set(a.only.split(",")) - ({"convert8b"} if a.skip_8b else set())
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ck = work / ("llama-3.2-1b-shape" if a.shape == "1b" else "tiny-shape")
    t0 = time.perf_counter()
    if not (ck / "config.json").is_file():
        nbytes = write_checkpoint(ck, LLAMA32_1B if a.shape == "1b" else TINY)
    else:
        nbytes = sum(f.stat().st_size for f in ck.glob("*.safetensors"))
    print(f"checkpoint {ck}: {nbytes / 1e9:.2f} GB bf16 (written in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    text = work / "heldout.txt"
    text.write_text((REPO / "data" / "corpus_heldout.txt").read_text()[:EVAL_CHARS])
    data = work / "train.jsonl"
    lines = (REPO / "data" / "corpus_train.txt").read_text().splitlines()[:40]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    me = [sys.executable, str(Path(__file__).resolve()), "--peer"]
    rows = []

    def row(op, ours, peer=None, peer_name="", note="", ours_bytes=nbytes):
        r = {"operation": op, "amdllm_s": ours["wall_s"], "amdllm_rss_gb": ours["peak_rss_gb"],
             "amdllm_rss_vs_checkpoint": round(ours["peak_rss_gb"] * 1e9 / ours_bytes, 2) if ours_bytes else None,
             "peer": peer_name, "peer_s": peer["wall_s"] if peer else None,
             "peer_rss_gb": peer["peak_rss_gb"] if peer else None, "note": note,
             "ok": ours["rc"] == 0 and (peer is None or peer["rc"] == 0)}
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)

    if "eval" in only:
        for dt in ("bfloat16", "float32"):
            ours = measured(amdllm("eval", "--model", str(ck), "--text", str(text), "--dtype", dt, "--json"))
            peer = measured(me + ["eval", str(ck), str(text), dt])
            o, t = last_json(ours), last_json(peer)
            row(f"eval {dt} ({o.get('tokens')} tokens)", ours, peer, "transformers",
                f"nll {o.get('nll', float('nan')):.5f} vs {t.get('nll', float('nan')):.5f}",
                ours_bytes=nbytes * (2 if dt == "float32" else 1))
    gen_rate, gen_dtype = {}, {}  # amdllm generate's steady tokens/s and chosen dtype per --dtype, for serve
    if "generate" in only:
        # the VM's memory bandwidth drifts by 10-25% over minutes and decoding is bound by it, so the sides
        # run interleaved, a.rounds times each, and each side's best round is compared (every round's rate
        # is in the note); RSS is the largest of its rounds
        runs = {}  # (side, dtype) -> [measured process]; transformers' faster dtype depends on the CPU
        for _ in range(a.rounds):
            for pdt in ("bfloat16", "float32"):
                runs.setdefault(("peer", pdt), []).append(measured(me + ["generate", str(ck), pdt]))
            for dt in ("auto", "float32"):  # auto: amdllm's default (it says what it chose)
                runs.setdefault(("ours", dt), []).append(measured(amdllm(
                    "generate", "--model", str(ck), "--prompt", PROMPT, "--max-new-tokens", "64", "--dtype", dt,
                    "--json")))

        def result(p):
            o = last_json(p)
            return o[0] if isinstance(o, list) and o else o

        def best_of(key, field):  # -> (the best round's process, its JSON, every round's rate)
            done = [(p, result(p)) for p in runs[key]]
            rates = [o.get(field, 0) for _, o in done]
            p, o = done[rates.index(max(rates))]
            return {**p, "peak_rss_gb": max(q["peak_rss_gb"] for q, _ in done)}, o, rates

        peers = {k: best_of(("peer", k), "steady_tokens_per_second") for k in ("bfloat16", "float32")}
        rate = {d: peers[d][1].get("steady_tokens_per_second", 0) for d in peers}
        best = max(rate, key=rate.get)
        peer, t, peer_rates = peers[best]
        for dt in ("auto", "float32"):
            ours, o, our_rates = best_of(("ours", dt), "tokens_per_second")
            gen_rate[dt], gen_dtype[dt] = o.get("tokens_per_second", 0), o.get("dtype")
            row(f"generate 64 tokens --dtype {dt} ({o.get('dtype')}; transformers {best}, its faster)", ours, peer,
                "transformers",
                f"steady {gen_rate[dt]:.2f} vs {rate[best]:.2f} tok/s, best of {a.rounds} interleaved rounds "
                f"({gen_rate[dt] / max(rate[best], 1e-9):.2f}x; rounds: amdllm "
                f"{', '.join(f'{r:.2f}' for r in our_rates)}, transformers {best} "
                f"{', '.join(f'{r:.2f}' for r in peer_rates)}; transformers "
                + ", ".join(f"{k} {v:.2f}" for k, v in rate.items())
                + "; its whole call, prefill included: "
                f"{t.get('tokens_per_second', 0):.2f})",
                ours_bytes=nbytes * (2 if o.get("dtype") == "float32" else 1))
    if "quantize" in only:
        q = work / "gptq4"
        shutil.rmtree(q, ignore_errors=True)
        g = 128 if a.shape == "1b" else 64  # the tiny shape's narrowest projection has 64 inputs
        ours = measured(amdllm("quantize", "--model", str(ck), "--out", str(q), "--bits", "4", "--group-size", str(g),
                               "--samples", "16", "--seq-len", "256", "--calib", str(REPO / "data" / "corpus_train.txt"),
                               "--json"))
        peer = None
        if a.gptqmodel_python:
            from amdllm.io.tokenizer import encode_fast
            from amdllm.quant.calibrate import calibration_windows
            win = work / "windows.npy"
            np.save(win, np.asarray(calibration_windows(encode_fast(ck, (REPO / "data" / "corpus_train.txt").read_text()),
                                                        16, 256, 0)))
            code = ("import shutil, sys; sys.path.insert(0, %r); import bench_gptq; shutil.rmtree(%r, ignore_errors=True); "
                    "bench_gptq.gptqmodel_side(%r, %r, %r, %d, False)"
                    % (str(Path(__file__).resolve().parent), str(work / "gptq4-gm"), str(ck), str(win),
                       str(work / "gptq4-gm"), g))
            peer = measured([a.gptqmodel_python, "-c", code], env={"GPTQMODEL_CPU_WORKERS": str(os.cpu_count())})
        o = last_json(ours)
        on_disk = sum(f.stat().st_size for f in q.glob("*.safetensors"))
        row(f"quantize 4-bit g{g}, 16x256", ours, peer, "GPTQModel" if peer else "GPTQModel not installed",
            f"bf16 checkpoint; GPTQModel loads it as float32 like the course bench; model_bytes "
            f"{o.get('model_bytes')} vs {on_disk} on disk")
    if "finetune" in only:
        f = work / "lora"
        shutil.rmtree(f, ignore_errors=True)
        # peft in bf16 only where the CPU has bf16 instructions: without them PyTorch's bf16 matmuls run
        # several times slower than its float32 (AMD EPYC, AVX2: a [256, 2048] x [2048, 8192] product 400 ms
        # against 61; run 3 had not finished 4 steps in 1117 s), so float32 is its faster dtype there
        pdts = ("bfloat16", "float32") if bf16_instructions() else ("float32",)
        peers = {pdt: measured(me + ["finetune", str(ck), str(data), pdt]) for pdt in pdts}
        med = {d: median_step(p) for d, p in peers.items()}
        peer_dt = min(med, key=med.get)  # peft's faster dtype on this CPU
        peft_steps = ", ".join(f"{'bf16' if d == 'bfloat16' else d} {med[d]:.2f} s ({peers[d]['peak_rss_gb']} GB)"
                               for d in pdts) + ("" if len(pdts) > 1 else "; bf16 not run: no bf16 instructions")
        peer = peers[peer_dt]
        for dt in ("auto", "float32"):  # auto: the checkpoint's bfloat16 (the default)
            shutil.rmtree(f, ignore_errors=True)
            ours = measured(amdllm("finetune", "--model", str(ck), "--data", str(data), "--out", str(f), "--steps",
                                   "4", "--batch-size", "1", "--seq-len", "256", "--rank", "8", "--dtype", dt,
                                   "--no-progress", "--json"))
            o = last_json(ours)
            tok_s = o.get("tokens_per_second", 0)
            row(f"finetune 4 steps, 1x256, r8, --dtype {dt} (peft {peer_dt}, its faster)", ours, peer, "peft",
                f"{tok_s:.2f} vs {256 / med[peer_dt]:.2f} tok/s ({tok_s * med[peer_dt] / 256:.2f}x; peft's median "
                f"step: {peft_steps})")
    if "serve" in only:
        for dt in ("auto", "float32"):  # auto: amdllm serve's default, as generate's
            ours = measured([sys.executable, str(Path(__file__).resolve()), "--serve-once", str(ck), dt])
            o = last_json(ours)
            vs = (f"; {o['s_per_decoded_token'] * gen_rate[dt]:.2f}x generate's {1 / gen_rate[dt]:.4f} s a token"
                  if o.get("s_per_decoded_token") and gen_rate.get(dt) else "")
            wide = gen_dtype.get(dt, dt) == "float32"  # what generate's --dtype chose; serve chooses alike
            row(f"serve --dtype {dt}: start, warm requests of 1 and 33 tokens", ours, None, "none",
                json.dumps(o) + vs, ours_bytes=nbytes * (2 if wide else 1))
    if "convert" in only:
        c, tc = work / "converted", work / "converted-hf"
        for d in (c, tc):
            shutil.rmtree(d, ignore_errors=True)
        ours = measured(amdllm("convert", "--model", str(ck), "--out", str(c), "--dtype", "float16", "--json"))
        peer = measured(me + ["convert", str(ck), str(tc)])
        row("convert bf16 -> float16", ours, peer, "transformers from/save_pretrained")
    if "convert8b" in only:
        big = work / "llama-3.1-8b-shape"
        if not (big / "config.json").is_file():
            t1 = time.perf_counter()
            big_bytes = write_checkpoint(big, LLAMA31_8B, max_shard_size="5GB")
            print(f"8B checkpoint: {big_bytes / 1e9:.1f} GB in {time.perf_counter() - t1:.0f} s", file=sys.stderr)
        big_bytes = sum(f.stat().st_size for f in big.glob("*.safetensors"))
        c8 = work / "converted-8b"
        shutil.rmtree(c8, ignore_errors=True)
        ours = measured(amdllm("convert", "--model", str(big), "--out", str(c8), "--json"))
        row("convert 8B-shaped bf16 (16 GB)", ours, None, "none", "target: peak RSS <= 3 GB", ours_bytes=big_bytes)
        shutil.rmtree(c8, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(big, ignore_errors=True)

    print(table(rows, ["operation", "amdllm_s", "amdllm_rss_gb", "amdllm_rss_vs_checkpoint", "peer", "peer_s",
                       "peer_rss_gb", "note"]))
    write_json({"checkpoint_bytes": nbytes, "machine": machine(), "rows": rows}, a.out, "scale")
    if not a.keep:
        for d in ("converted", "converted-hf", "gptq4", "gptq4-gm", "lora"):
            shutil.rmtree(work / d, ignore_errors=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        raise SystemExit(peer_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-once":
        print(json.dumps(serve_once(*sys.argv[2:4])))
        raise SystemExit(0)
    raise SystemExit(main())
