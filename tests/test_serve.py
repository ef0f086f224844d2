"""`amdllm serve` against the official `openai` client on loopback, on a tiny random checkpoint.

One server (module fixture) is started with `start_server(model_dir=...)`, i.e. through the real
loaders (checkpoint.load + load_tokenizer), with a small cache (64 slots, 4 rows) so that a short load
test exercises every path of the batching engine: rows joining and leaving, and cache shifts.
References: `amdllm.infer.generate.generate` (the CLI's generation) and transformers' greedy `generate`.
"""
import concurrent.futures as cf
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.tiny import make_hf_checkpoint

MAX_LEN, MAX_BATCH, CAP = 64, 4, 32
TEXT = ("the cat sat on the mat. the dog ran to the park. a bird sang in the tree. "
        "tom had three apples and ann had two pears. the red fox met the blue owl. "
        "### System:\nbe brief\n\n### User:\nwhere is the cat?\n\n### Assistant:\nin the park.\n\n") * 20
PROMPTS = ["the cat", "a bird sang", "the dog ran to", "the park", "tom had", "ann", "the red fox",
           "blue owl met", "three apples", "in the tree"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from amdllm.io import tokenizer as T
    from amdllm.io.checkpoint import load
    from amdllm.infer.serve import start_server

    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "text.txt").write_text(TEXT)
    tok = T.train_bpe([tmp / "text.txt"], vocab_size=300)  # BOS 0, EOS 1, PAD 2
    ckpt, hf_model = make_hf_checkpoint(tmp, name="tiny-chat", vocab_size=320, bos_token_id=0, eos_token_id=1,
                                        pad_token_id=2, max_position_embeddings=MAX_LEN)
    T.save_for_transformers(tok, ckpt)
    handle = start_server(model_dir=ckpt, max_batch=MAX_BATCH, max_len=MAX_LEN, max_tokens_cap=CAP)
    # generous timeouts: a first request per prompt length compiles, and CI machines are shared
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    yield {"h": handle, "client": client, "model": load(ckpt), "tok": T.load_tokenizer(ckpt), "hf": hf_model,
           "dir": ckpt}
    handle.stop()
    assert not handle.thread.is_alive()


def reference(served, prompts, n, **kw):
    """`generate` one prompt at a time (batch 1 compiles once; batched equality is generate's own test)."""
    from amdllm.infer.generate import generate
    return [generate(served["model"], served["tok"], p, n, **kw)[0] for p in prompts]


def complete(client, prompt, n, **kw):
    return client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"return_token_ids": True}, **kw)


def test_models_and_greedy_completion_equal_generate_and_transformers(served):
    import torch
    c = served["client"]
    assert [m.id for m in c.models.list().data] == ["tiny-chat"]
    refs = reference(served, PROMPTS[:3], 12)
    for prompt, ref in zip(PROMPTS[:3], refs):
        r = complete(c, prompt, 12)
        ch = r.choices[0]
        assert ch.model_extra["token_ids"] == ref["token_ids"]
        assert ch.text == ref["text"]
        assert r.usage.prompt_tokens == ref["prompt_tokens"] == len(served["tok"](prompt)["input_ids"])
        assert r.usage.completion_tokens == len(ref["token_ids"])
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert ch.finish_reason == ("stop" if ref["token_ids"][-1] == 1 else "length")
        # the ecosystem's greedy decoding on the same weights
        ids = torch.tensor([served["tok"](prompt)["input_ids"]])
        with torch.no_grad():
            hf = served["hf"].generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=2)
        assert hf[0, ids.shape[1]:].tolist() == ref["token_ids"]


def test_chat_streaming_matches_non_streaming(served):
    c = served["client"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "where is the cat?"}]
    full = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    # the prompt is the course's chat template (the tokenizer has none), tokenized with its BOS once
    tok = served["tok"]
    expect = tok("### System:\nbe brief\n\n### User:\nwhere is the cat?\n\n### Assistant:\n")["input_ids"]
    assert full.usage.prompt_tokens == len(expect)
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_stream_is_sse_ending_with_done(served):
    prompt, ref = next((p, r) for p, r in zip(PROMPTS, reference(served, PROMPTS, 8)) if 1 not in r["token_ids"])
    with httpx.stream("POST", served["h"].url + "/v1/completions", timeout=300,
                      json={"model": "tiny-chat", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == ref["text"]
    assert len(chunks) >= 4  # streamed token by token, not in one piece
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_cut_the_text(served):
    c = served["client"]
    ref = reference(served, [PROMPTS[4]], 16)[0]["text"]
    k = len(ref) // 2
    stop = ref[k:k + 2]
    cut = ref[:ref.find(stop)]
    r = c.completions.create(model="tiny-chat", prompt=PROMPTS[4], max_tokens=16, temperature=0,
                             stop=[stop, "never-there"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    s = c.completions.create(model="tiny-chat", prompt=PROMPTS[4], max_tokens=16, temperature=0, stop=stop,
                             stream=True)
    assert "".join(ch.choices[0].text for ch in s) == cut


def test_seeded_sampling_reproduces_generate(served):
    c = served["client"]
    ref = reference(served, [PROMPTS[5]], 10, temperature=0.9, top_p=0.9, seed=7)[0]
    a = c.completions.create(model="tiny-chat", prompt=PROMPTS[5], max_tokens=10, temperature=0.9, top_p=0.9,
                             seed=7, extra_body={"return_token_ids": True})
    assert a.choices[0].model_extra["token_ids"] == ref["token_ids"]
    others = {tuple(c.completions.create(model="tiny-chat", prompt=PROMPTS[5], max_tokens=10, temperature=0.9,
                                         seed=s, extra_body={"return_token_ids": True}).choices[0]
                    .model_extra["token_ids"]) for s in (1, 2, 3)}
    assert len(others) > 1  # the seed matters


def test_each_bad_request_gets_its_4xx_and_the_server_keeps_serving(served):
    c, url = served["client"], served["h"].url
    good = reference(served, [PROMPTS[0]], 4)[0]["token_ids"]
    long_prompt = " ".join(["the cat sat on the mat."] * 40)

    def expect(fn, exc, status, param=None, code=None):
        with pytest.raises(exc) as e:
            fn()
        assert e.value.status_code == status
        err = e.value.body if isinstance(e.value.body, dict) and "message" in e.value.body else e.value.body["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"]
        assert (param is None or err["param"] == param) and (code is None or err["code"] == code)
        assert complete(c, PROMPTS[0], 4).choices[0].model_extra["token_ids"] == good  # still serving

    expect(lambda: c.completions.create(model="nope", prompt="the", max_tokens=4), openai.NotFoundError, 404,
           "model", "model_not_found")
    expect(lambda: complete(c, long_prompt, 4), openai.BadRequestError, 400, "prompt", "context_length_exceeded")
    expect(lambda: complete(c, "the cat", 40), openai.BadRequestError, 400, "max_tokens")  # above the cap 32
    fits = next(p for p in (" ".join(["the cat sat"] * k) for k in range(5, 40))
                if 40 < len(served["tok"](p)["input_ids"]) < MAX_LEN)
    expect(lambda: complete(c, fits, 30), openai.BadRequestError, 400, "max_tokens",
           "context_length_exceeded")  # fits alone, not with 30 new tokens in 64
    expect(lambda: c.completions.create(model="tiny-chat", prompt="the", temperature=-1), openai.BadRequestError,
           400, "temperature")
    expect(lambda: c.completions.create(model="tiny-chat", prompt="the", n=2), openai.BadRequestError, 400, "n")
    expect(lambda: c.chat.completions.create(model="tiny-chat", messages=[]), openai.BadRequestError, 400,
           "messages")
    expect(lambda: c.completions.create(model="tiny-chat", prompt="the", stop=7), openai.BadRequestError, 400,
           "stop")
    expect(lambda: c.completions.create(model="tiny-chat", prompt="the", max_tokens=4, extra_body={"stream": "false"}),
           openai.BadRequestError, 400, "stream", "invalid_type")  # a string is not a boolean (it streamed)
    # bad JSON and a wrong route cannot be sent by the client library: raw HTTP
    # over the characters any prompt of 64 tokens can have: refused before it is tokenized
    chars = " ".join(["the cat sat on the mat."] * 2000)
    expect(lambda: complete(c, chars, 4), openai.BadRequestError, 400, "prompt", "context_length_exceeded")
    for path, data, status in [("/v1/completions", b'{"prompt": "the", ', 400),
                               ("/v1/completions", b'["a list"]', 400), ("/v1/nothing", b"{}", 404),
                               ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),  # nested too deep
                               ("/v1/completions", b'{"prompt": "' + b"a" * (9 << 20) + b'"}', 413)]:
        r = httpx.post(url + path, content=data, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert complete(c, PROMPTS[0], 4).choices[0].model_extra["token_ids"] == good


def test_api_key_when_set(served):
    from fastapi.testclient import TestClient

    from amdllm.infer.api import ServerConfig
    from amdllm.infer.serve import create_app
    app = create_app(served["h"].engine, ServerConfig("tiny-chat", api_key="sekret", max_tokens_cap=CAP))
    with TestClient(app) as tc:
        body = {"model": "tiny-chat", "prompt": "the cat", "max_tokens": 3, "temperature": 0}
        r = tc.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = tc.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert tc.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = tc.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert tc.get("/").status_code == 200  # the page itself is public; it asks for the key


def test_bounded_load_all_succeed_nobody_gets_anothers_output(served):
    """8 concurrent clients, 40 requests, distinct prompts with known greedy outputs and varied lengths."""
    c, eng = served["client"], served["h"].engine
    refs = {p: r["token_ids"] for p, r in zip(PROMPTS, reference(served, PROMPTS, 12))}
    before = {k: v.copy() if hasattr(v, "copy") else v for k, v in eng.stats.items()}
    jobs = [(PROMPTS[i % len(PROMPTS)], 4 + (i * 5) % 9) for i in range(40)]

    def one(job):
        prompt, n = job
        r = complete(c, prompt, n, timeout=120)
        return job, r.choices[0].model_extra["token_ids"]

    with cf.ThreadPoolExecutor(8) as ex:  # a deadline against a hang, not a timing
        results = list(ex.map(one, jobs, timeout=600))
    assert len(results) == 40
    for (prompt, n), ids in results:
        ref = refs[prompt][:n]
        assert ids == ref, f"{prompt!r}: got {ids}, expected {ref}"
    assert eng.stats["max_batch_seen"] > 1 and max(eng.stats["batch_hist"]) == eng.stats["max_batch_seen"]
    assert eng.stats["requests"] - before["requests"] == 40
    assert eng.stats["max_batch_seen"] <= MAX_BATCH


def test_chat_page_is_served(served):
    r = httpx.get(served["h"].url + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text and "getReader" in r.text and "stream: true" in r.text


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def chat_page_in_chromium(url: str, question: str, profile, screenshot=None, timeout: float = 120.0) -> str:
    """Open the chat page in headless Chromium, send `question` (the page's ?q=), wait for the streamed
    reply to finish (its meta line appears) and return the reply text; optionally save a PNG screenshot.
    Driven over the DevTools protocol (websocket-client), so it waits for the stream, not a fixed time."""
    import base64
    import urllib.parse

    import websocket
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
                             "--remote-allow-origins=*", f"--user-data-dir={profile}", "--window-size=900,640",
                             "about:blank"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + timeout
        for line in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
            if "DevTools listening on" in line:
                port = line.split("ws://", 1)[1].split("/", 1)[0]
                break
        pages = [t for t in httpx.get(f"http://{port}/json/list", timeout=30).json() if t["type"] == "page"]
        ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True)
        ids = iter(range(1, 10**6))

        def cdp(method, **params):
            n = next(ids)
            ws.send(json.dumps({"id": n, "method": method, "params": params}))
            while True:
                msg = json.loads(ws.recv())
                if msg.get("id") == n:
                    assert "error" not in msg, msg
                    return msg["result"]

        cdp("Page.navigate", url=url + "/?q=" + urllib.parse.quote(question))
        probe = ("(() => { const m = document.querySelector('.assistant .meta, .error');"
                 " return m ? document.querySelector('.assistant .text, .error .text').textContent : null })()")
        while True:
            reply = cdp("Runtime.evaluate", expression=probe, returnByValue=True)["result"].get("value")
            if reply is not None or time.time() > deadline:
                break
            time.sleep(0.2)
        if screenshot is not None:
            Path(screenshot).write_bytes(base64.b64decode(cdp("Page.captureScreenshot", format="png")["data"]))
        ws.close()
        return reply
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (.ci/run installs Debian's with "
                                              "apt-get install chromium); docs/chat_page.png shows the page")
def test_chat_page_answers_in_headless_chromium(served, tmp_path):
    """The page lists the model, sends the question with fetch + ReadableStream, renders the streamed reply."""
    pytest.importorskip("websocket", reason="opt-in: needs websocket-client to drive Chromium")
    question = "where is the cat?"
    expected = served["client"].chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": question}], temperature=0).choices[0].message.content
    reply = chat_page_in_chromium(served["h"].url, question, tmp_path / "profile", tmp_path / "page.png")
    assert reply == expected
    assert (tmp_path / "page.png").read_bytes()[:4] == b"\x89PNG"


def test_engine_joins_running_batch_and_shifts_the_cache(served):
    """Requests join a running batch at chosen steps (submitted from the worker's own callbacks, so the
    schedule is deterministic) until the 64-slot cache must be shifted left; outputs stay exact."""
    from amdllm.infer.engine import Request
    eng = served["h"].engine
    refs = [(p, r) for p, r in zip(PROMPTS, reference(served, PROMPTS, 30)) if 1 not in r["token_ids"]]
    assert len(refs) >= 3, "the tiny model should not emit EOS that often"
    (px, rx), (py, ry), (pz, rz) = refs[:3]
    tok = served["tok"]
    results, done = {}, {}
    before = {k: v.copy() if hasattr(v, "copy") else v for k, v in eng.stats.items()}

    def make(name, prompt, n, then=None, at=0):
        seen = []
        done[name] = __import__("threading").Event()

        def emit(kind, v):
            if kind == "delta":
                seen.extend(v["token_ids"])
                if then is not None and len(seen) >= at and not then.submitted:
                    then.submitted = True
                    eng.submit(then)  # from the worker thread: joins at the very next step
            else:
                results[name] = v
                done[name].set()
        r = Request(list(tok(prompt)["input_ids"]), n, emit, temperature=0.0)
        r.submitted = False
        return r

    # X (12 tokens) fills slots from 16; Y joins after X's 8th token (slot 23, prompt from slot 7); Z joins
    # after Y's 16th token (slot 38), X long gone: 38 + 29 > 64 slots, so the cache shifts left by 7.
    # (A token whose text is held back is reported late; the plan has room for 4 such tokens.)
    z = make("z", pz, 30)
    y = make("y", py, 30, then=z, at=16)
    x = make("x", px, 12, then=y, at=8)
    eng.submit(x)
    for name in "xyz":
        assert done[name].wait(120), name
    assert results["x"]["token_ids"] == rx["token_ids"][:12]
    assert results["y"]["token_ids"] == ry["token_ids"]
    assert results["z"]["token_ids"] == rz["token_ids"]
    assert eng.stats["shifts"] == before["shifts"] + 1
    # steps run only the active rows, rounded up to a power of two: X alone ran 1 row, X and Y 2; when X
    # finished, Y's cache row moved into X's place (the active rows stay first)
    assert eng.stats["step_rows"][1] > before["step_rows"][1] and eng.stats["step_rows"][2] > before["step_rows"][2]
    assert eng.stats["moves"] > before["moves"]
    # with the CPU backend the engine decodes per-layer weight views with a per-layer cache
    # (amdllm.backends.prepare): the joins and the shift above ran on that layout; else on the stacked one
    from amdllm import backends
    assert eng.per_layer == (backends.active() is not None) == isinstance(eng.cache.k, tuple)


def test_serves_gptq_checkpoint_with_lora_adapter(served, tmp_path):
    """`--model GPTQ_DIR --adapter DIR`: 4-bit projections plus LoRA, loaded from disk by the server's own
    loader; greedy output equals `generate` on the same model, and the adapter changes it."""
    from amdllm.io.checkpoint import load
    from amdllm.infer.generate import generate, load_model
    from amdllm.quant import QuantSpec
    from amdllm.quant.calibrate import quantize_model
    from amdllm.io.gptq_format import quant_config_dict, save_quantized
    from amdllm.infer.serve import start_server

    spec = QuantSpec(bits=4, group_size=32)
    qmodel, _ = quantize_model(load(served["dir"]), None, spec, method="rtn", progress=False)
    gdir = save_quantized(qmodel, tmp_path / "gptq", quant_config_dict(4, 32, True, False),
                          tokenizer_from=served["dir"])
    # a PEFT-format adapter written directly (as PEFT would): r=4 on q_proj and v_proj, both factors random
    from safetensors.numpy import save_file
    adir = tmp_path / "adapter"
    adir.mkdir()
    rng = np.random.default_rng(1)
    tensors = {f"base_model.model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight":
               (0.3 * rng.standard_normal((4, 64) if ab == "A" else (shape, 4))).astype(np.float32)
               for i in range(2) for p, shape in (("q_proj", 64), ("v_proj", 32)) for ab in "AB"}
    save_file(tensors, str(adir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (adir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none"}))

    model, tok, _ = load_model(gdir, adir)
    from amdllm.model.quantized import QuantLinear
    assert isinstance(model.layers.q_proj, QuantLinear) and model.lora_scale == 2.0  # really 4-bit + LoRA
    prompt = PROMPTS[6]
    ref = generate(model, tok, prompt, 10)[0]["token_ids"]
    base = reference(served, [prompt], 10)[0]["token_ids"]
    assert ref != base  # the quantized, adapted model is another model
    with start_server(model_dir=gdir, adapter=adir, max_batch=2, max_len=32) as h:  # returns once compiled
        c = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", timeout=300, max_retries=0)
        assert c.models.list().data[0].id == "gptq+adapter"
        r = c.completions.create(model="gptq+adapter", prompt=prompt, max_tokens=10, temperature=0,
                                 extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == ref


def test_engine_cache_grows_for_a_long_request_and_shrinks_when_idle(served, monkeypatch):
    """The cache holds what the rows in flight need (a power of two from MIN_CACHE_SLOTS): a long request
    grows it by a copy, the next request after idling finds it small again, and tokens stay exact."""
    from amdllm.infer import engine as E
    monkeypatch.setattr(E, "MIN_CACHE_SLOTS", 16)
    eng, tok = served["h"].engine, served["tok"]
    prompts = PROMPTS[:3]
    refs = reference(served, prompts, 30)

    def run(prompt, n):
        seen, out, done = [], {}, __import__("threading").Event()

        def emit(kind, v):
            seen.append(eng.cache.valid.shape[1])  # the worker's own thread: no race with the cache
            if kind != "delta":
                out.update(v)
                done.set()
        eng.submit(E.Request(list(tok(prompt)["input_ids"]), n, emit, temperature=0.0))
        assert done.wait(120)
        return out["token_ids"], max(seen)

    short, n_short = run(prompts[0], 4)     # prompt bucket 16 + 3 more slots: one block of 32
    long, n_long = run(prompts[1], 30)      # 16 + 29 slots: the 64 of max_len
    again, n_again = run(prompts[2], 4)     # idle in between: back to 32
    assert (n_short, n_long, n_again) == (32, 64, 32)
    assert short == refs[0]["token_ids"][:4] and long == refs[1]["token_ids"]
    assert again == refs[2]["token_ids"][:4]
