"""Serving under load: the same bounded load against `amdllm serve` one-at-a-time (--max-batch 1) and batched.

C concurrent clients (threads sharing one `openai` client) send R greedy completion requests in total, each
with a timeout; the run stops by itself. Every answer is checked against `amdllm.infer.generate` on the same
prompt (none may get another's output). Reported per side: wall time, requests/s, generated tokens/s,
latency p50/p95/max, the mean and largest batch the engine decoded (from the server's /health), failures.
Each side is the real `amdllm serve` in its own process (clients in the server's process would compete
with it for the GIL), on loopback, started and stopped (SIGTERM) by this script.

    python benchmarks/bench_serve.py [--model DIR] [--clients 16] [--requests 200] [--max-tokens 32]
                                     [--max-batch 16] [--out bench_results]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import table, write_json  # noqa: E402


def distinct_prompts(text: str, n: int, words: int = 6) -> list[str]:
    """The first `words` words of distinct sentences of the held-out text."""
    seen, out = set(), []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        p = " ".join(sentence.split()[:words])
        if len(p.split()) == words and p not in seen:
            seen.add(p)
            out.append(p)
        if len(out) == n:
            break
    if len(out) < n:
        raise ValueError(f"the text has only {len(out)} distinct {words}-word sentence starts, {n} needed")
    return out


def run_load(url: str, jobs: list[str], clients: int, max_tokens: int, timeout: float) -> dict:
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", timeout=timeout, max_retries=0)
    model = client.models.list().data[0].id

    def one(prompt):
        t0 = time.perf_counter()
        try:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True})
            return prompt, r.choices[0].model_extra["token_ids"], time.perf_counter() - t0, None
        except Exception as e:  # counted and reported, never hidden
            return prompt, None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as ex:
        results = list(ex.map(one, jobs, timeout=timeout * len(jobs)))
    return {"wall": time.perf_counter() - t0, "results": results}


def serve_process(model_dir, max_batch: int, log_path: Path):
    """Start `amdllm serve` on a free loopback port; return (process, url) once /v1/models answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "amdllm.cli", "serve", "--model", str(model_dir), "--port",
                             str(port), "--max-batch", str(max_batch)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"amdllm serve did not start; see {log_path}") from None
            time.sleep(0.5)


def health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())


def summarize(load: dict, refs: dict, before: dict, after: dict) -> dict:
    res = load["results"]
    ok = [r for r in res if r[3] is None]
    wrong = [r[0] for r in ok if r[1] != refs[r[0]]]
    lat = sorted(r[2] for r in ok)
    tokens = sum(len(r[1]) for r in ok)
    hist = {int(k): v - before["batch_hist"].get(k, 0) for k, v in after["batch_hist"].items()}
    steps = sum(hist.values())
    return {"requests": len(res), "failed": len(res) - len(ok), "wrong_output": len(wrong),
            "errors": sorted({r[3] for r in res if r[3]})[:5], "wall_s": load["wall"],
            "requests_per_s": len(ok) / load["wall"], "tokens_per_s": tokens / load["wall"],
            "generated_tokens": tokens,
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p95_s": lat[int(0.95 * (len(lat) - 1))] if lat else None,
            "latency_max_s": lat[-1] if lat else None,
            "decode_steps": steps, "mean_batch": sum(k * v for k, v in hist.items()) / steps if steps else 0.0,
            "max_batch_seen": max((k for k, v in hist.items() if v), default=0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=40, help="distinct prompts, cycled over the requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16, help="engine batch of the batched side")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    args = ap.parse_args(argv)

    from amdllm.course import default_model_dir, heldout_text_path
    from amdllm.infer.generate import generate, load_model

    model, tok, model_dir = load_model(args.model or default_model_dir())
    prompts = distinct_prompts(Path(heldout_text_path()).read_text(), args.prompts)
    # references: generate's greedy tokens, in batches (batched generate equals one prompt at a time)
    refs = {}
    for i in range(0, len(prompts), 8):
        for p, r in zip(prompts[i:i + 8], generate(model, tok, prompts[i:i + 8], args.max_tokens)):
            refs[p] = r["token_ids"]
    jobs = [prompts[i % len(prompts)] for i in range(args.requests)]

    sides = {}
    for name, batch in (("one_at_a_time", 1), ("batched", args.max_batch)):
        proc, url = serve_process(model_dir, batch, Path(f"/tmp/bench_serve_{name}.log"))
        try:
            run_load(url, prompts[:2], 2, args.max_tokens, args.timeout)  # compile the prefill bucket
            before = health(url)
            load = run_load(url, jobs, args.clients, args.max_tokens, args.timeout)
            sides[name] = summarize(load, refs, before, health(url))
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"{name}: {sides[name]['wall_s']:.1f} s", file=sys.stderr)
    speedup = sides["batched"]["tokens_per_s"] / sides["one_at_a_time"]["tokens_per_s"]
    rows = [{"side": k, **{c: v[c] for c in ("requests", "failed", "wrong_output", "wall_s", "requests_per_s",
                                             "tokens_per_s", "latency_p50_s", "latency_p95_s", "mean_batch",
                                             "max_batch_seen")}} for k, v in sides.items()]
    print(table(rows, list(rows[0])))
    print(f"batched / one-at-a-time throughput: {speedup:.2f}x")
    result = {"model": str(model_dir), "clients": args.clients, "requests": args.requests,
              "distinct_prompts": len(prompts), "max_tokens": args.max_tokens, "max_batch": args.max_batch,
              "sides": sides, "throughput_ratio": speedup}
    write_json(result, args.out, "serve")
    ok = all(s["failed"] == 0 and s["wrong_output"] == 0 for s in sides.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
