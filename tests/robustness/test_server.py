"""Class "the server survives abuse": over HTTP against a running `start_server` (the code path of
`amdllm serve`), with the guards set short (2 s request timeout, 32 connections) so each case finishes in
seconds. Every case has its own timeout (socket, HTTP client, pytest) so a regression fails rather than
hangs, and each ends by checking that a good request still gets its answer."""
import concurrent.futures as cf
import json
import socket
import time

import httpx
import pytest

from tests.robustness.conftest import amdllm, one_line_error

TIMEOUT_S, MAX_CONN = 2.0, 32
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tiny):
    from amdllm.infer.serve import start_server
    h = start_server(model_dir=tiny["model"], max_batch=4, max_len=128, max_tokens_cap=100,
                     request_timeout=TIMEOUT_S, max_connections=MAX_CONN)
    host, port = h.url.split("//")[1].rsplit(":", 1)
    h.addr = (host, int(port))
    good(h)  # compiled once here, so every case below times serving, not compiling
    yield h
    h.stop()
    assert not h.thread.is_alive()


def good(h) -> None:
    r = httpx.post(h.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 4, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def error_of(r, status, code=None):
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert code is None or err["code"] == code, err


def raw(h, data: bytes, timeout=10.0) -> socket.socket:
    s = socket.create_connection(h.addr, timeout=timeout)
    if data:
        s.sendall(data)
    return s


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True when the server closes the connection (recv gives b"") within `seconds`."""
    s.settimeout(seconds)
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True
    finally:
        s.close()


def test_body_over_the_cap_is_413_plain_and_chunked(server):
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    error_of(httpx.post(server.url + "/v1/completions", content=big,
                        headers={"content-type": "application/json"}, timeout=30), 413, "request_too_large")

    def chunks():  # no content-length: the cap must hold while reading
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]
    error_of(httpx.post(server.url + "/v1/completions", content=chunks(),
                        headers={"content-type": "application/json"}, timeout=30), 413, "request_too_large")
    good(server)


def test_a_huge_prompt_does_not_freeze_other_clients(server):
    """A prompt longer in characters than the context can hold is refused before tokenizing; one that
    needs tokenizing runs off the event loop, so a /health probe is answered meanwhile."""
    huge = "the cat sat on the mat. " * 300_000  # 7.2 MB, under the body cap
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(httpx.post, server.url + "/v1/completions", json={"prompt": huge, "max_tokens": 2},
                        timeout=60)
        # answered while the huge request is in flight (the deadline is against a hang, not a timing)
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        error_of(fut.result(), 400, "context_length_exceeded")
    good(server)


def test_deeply_nested_json_is_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                   headers={"content-type": "application/json"}, timeout=30)
    error_of(r, 400, "invalid_json")
    good(server)


@pytest.mark.parametrize("field,value", [("stream", "false"), ("return_token_ids", "yes"), ("temperature", "nan"),
                                         ("temperature", float("nan")), ("max_tokens", -5), ("top_p", 7)])
def test_wrongly_typed_or_valued_fields_are_400(server, field, value):
    body = json.dumps({"prompt": "the cat", "max_tokens": 4, field: value}).encode()  # NaN written as NaN
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    error_of(r, 400)
    assert r.json()["error"]["param"] == field
    good(server)


def test_a_client_that_sends_nothing_or_trickles_is_closed(server):
    silent = raw(server, b"")
    partial = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"pro")
    # the server's own 2 s timeout closes them; the waits are generous deadlines, so load cannot fail them
    assert closed_within(silent, TIMEOUT_S + 30)
    assert closed_within(partial, TIMEOUT_S + 30)
    # after a whole request and its answer, the next request on the same connection trickles: closed too
    body = json.dumps({"prompt": "the cat", "max_tokens": 2, "temperature": 0}).encode()
    kept = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
    answer = b""
    while b'"usage"' not in answer:
        answer += kept.recv(65536)
    kept.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert closed_within(kept, TIMEOUT_S + 30)
    good(server)


def test_past_the_cap_silent_sockets_give_way_and_busy_ones_keep_their_place(server):
    """Idle sockets (connected, nothing sent) at the cap: a new client takes the oldest one's place and
    is answered at once, not after the idle ones time out. Connections that each have a request under
    way keep their place: a new one is closed on arrival."""
    held = [raw(server, b"") for _ in range(MAX_CONN + 20)]
    good(server)  # while all are held
    assert sum(closed_within(s, 0.2) for s in held[:20]) >= 15  # the oldest gave way
    for s in held:
        s.close()
    busy = [raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            for _ in range(MAX_CONN)]
    time.sleep(0.5)  # their bytes are in: each has a request under way
    late = raw(server, b"")
    assert closed_within(late, 1.0)
    for s in busy:
        s.close()
    time.sleep(0.3)
    good(server)


def test_a_non_streaming_client_that_disconnects_frees_its_row(server):
    engine = server.engine
    real = engine._decode

    def slow():  # 50 ms a step: 100 tokens take 5 s, far longer than the disconnect takes to notice
        time.sleep(0.05)
        return real()
    engine._decode = slow
    try:
        before = dict(engine.stats)
        body = json.dumps({"prompt": "the cat", "max_tokens": 100, "temperature": 1.0, "seed": 3,
                           "stop": ["NEVER"]}).encode()
        s = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)
        s.close()
        t0 = time.perf_counter()
        while engine.stats["cancelled"] == before["cancelled"] and time.perf_counter() - t0 < 60:
            time.sleep(0.05)
        assert engine.stats["cancelled"] == before["cancelled"] + 1
        # noticed within a few disconnect polls: counted in decode steps, which a loaded machine slows alike
        assert engine.stats["tokens"] - before["tokens"] < 60
    finally:
        engine._decode = real
    good(server)


def test_a_burst_of_200_clients_all_get_their_answer(server):
    def one(i):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": f"the cat {i % 7}", "max_tokens": 3,
                                                              "temperature": 0}, timeout=120)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    with cf.ThreadPoolExecutor(24) as ex:
        results = list(ex.map(one, range(200)))
    assert [s for s, _ in results] == [200] * 200
    by_prompt = {}
    for i, (_, text) in enumerate(results):  # greedy: the same prompt gets the same text, batched or not
        by_prompt.setdefault(i % 7, set()).add(text)
    assert all(len(v) == 1 for v in by_prompt.values()), by_prompt
    good(server)


def test_api_key_guards_the_api_and_its_map_not_the_probe(server):
    from fastapi.testclient import TestClient

    from amdllm.infer.api import ServerConfig
    from amdllm.infer.serve import create_app
    app = create_app(server.engine, ServerConfig("tiny", api_key="sekret", max_tokens_cap=8))
    with TestClient(app) as tc:
        for path in ("/openapi.json", "/v1/models"):
            assert tc.get(path).status_code == 401
            assert tc.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert tc.get(path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert tc.get("/health").status_code == 200 and tc.get("/").status_code == 200


def test_a_bad_port_fails_before_the_model_loads(tmp_path):
    p = amdllm("serve", "--model", tmp_path / "does-not-exist", "--port", "99999")
    one_line_error(p, "--port 99999")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        one_line_error(amdllm("serve", "--model", tmp_path / "does-not-exist", "--port", str(s.getsockname()[1])),
                       "cannot listen")
    finally:
        s.close()


@pytest.mark.parametrize("field,value", [("logprobs", True), ("logprobs", 2), ("echo", True), ("best_of", 3),
                                         ("logit_bias", {"5": 100}), ("presence_penalty", 0.5),
                                         ("frequency_penalty", -1), ("suffix", "the end"), ("top_logprobs", 3)])
def test_openai_fields_we_do_not_implement_are_400_naming_them(server, field, value):
    """Never answered as if they had not been asked (vLLM's rule); their neutral values are accepted."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 2, field: value},
                   timeout=30)
    error_of(r, 400, "unsupported_parameter")
    assert r.json()["error"]["param"] == field
    neutral = {"logprobs": None, "echo": False, "best_of": 1, "logit_bias": {}, "presence_penalty": 0.0,
               "frequency_penalty": 0, "suffix": None, "top_logprobs": 0}[field]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 2, field: neutral},
                   timeout=30)
    assert r.status_code == 200, r.text
    good(server)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "the \\ud800 cat", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udfff"}], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "the cat", "stop": ["\\ud800"], "max_tokens": 2}'),
])
def test_a_lone_surrogate_is_400_in_openai_shape(server, path, body):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    error_of(r, 400, "invalid_value")
    assert "lone surrogate" in r.json()["error"]["message"]
    good(server)


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(server):
    """top_p 1e-300 is 0 in float32: the nucleus is still the most likely token, so sampling at any
    temperature gives the greedy answer (it had given token 0, every time)."""
    ask = {"prompt": "the cat", "max_tokens": 8, "seed": 3}
    greedy = httpx.post(server.url + "/v1/completions", json={**ask, "temperature": 0}, timeout=60)
    tiny_p = httpx.post(server.url + "/v1/completions", json={**ask, "temperature": 1.5, "top_p": 1e-300},
                        timeout=60)
    assert greedy.status_code == tiny_p.status_code == 200, tiny_p.text
    assert tiny_p.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_a_chat_template_that_loops_does_not_hold_up_completions(tiny, tmp_path):
    """A template whose loops run to the render bound keeps its chat request busy for seconds. Plain
    completions, tokenized on another thread, are answered meanwhile (ordering, not a clock: the
    completion's answer comes while the chat is still unanswered), and the chat then gets a 400."""
    from amdllm.infer.serve import start_server
    looping = tmp_path / "loop.jinja"
    looping.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    h = start_server(model_dir=tiny["model"], max_batch=2, max_len=128, max_tokens_cap=16, chat_template=str(looping))
    try:
        good(h)
        with cf.ThreadPoolExecutor(1) as pool:
            chat = pool.submit(httpx.post, h.url + "/v1/chat/completions", timeout=120,
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            time.sleep(0.2)  # let the chat reach the template thread first
            good(h)
            assert not chat.done(), "the chat finished first: the bound no longer costs seconds"
            error_of(chat.result(timeout=120), 400)
    finally:
        h.stop()
