"""Solutions to the exercises of 05_inference_and_serving.ipynb. Run: python notebooks/solutions/05_inference_and_serving.py"""
import json
import time
import urllib.request

from amdllm.io import checkpoint
from amdllm import course
from amdllm.infer.generate import generate
from amdllm.infer.serve import start_server
from amdllm.io.tokenizer import load_tokenizer

model_dir = course.default_model_dir()
model, tok = checkpoint.load(model_dir), load_tokenizer(model_dir)

# 1. Sampling: the seed makes them differ; top_p=0.01 keeps only the most likely token = greedy.
for seed in (0, 1, 2):
    print("1.", repr(generate(model, tok, "The fox", 24, temperature=0.8, top_p=0.9, seed=seed)[0]["text"]))
greedy = generate(model, tok, "The fox", 24)[0]["text"]
assert generate(model, tok, "The fox", 24, temperature=0.8, top_p=0.01, seed=5)[0]["text"] == greedy

# 2. Batching: decode steps cost about the same for 1 or 8 rows (weights are read once per step).
for n in (1, 8):
    prompts = ["Once upon a time"] * n
    generate(model, tok, prompts, 32)  # compile for this batch size
    t = time.perf_counter()
    res = generate(model, tok, prompts, 32)
    print(f"2. {n} prompt(s): {sum(r['new_tokens'] for r in res) / (time.perf_counter() - t):.0f} tokens/s in total")

# 3. Raw HTTP streaming (server-sent events), no SDK.
with start_server(model, tok, max_batch=2) as server:
    body = json.dumps({"model": "amdllm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                       "stream": True}).encode()
    req = urllib.request.Request(server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line:
                print("3.", line[:100])
