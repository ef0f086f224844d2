"""`amdllm serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over the batching engine.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream: true` gives
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`), GET / (the chat page).
Every error has OpenAI's shape {"error": {"message", "type", "param", "code"}} and a 4xx status, so
the official clients raise their usual exceptions; the server keeps serving after any of them.
The model runs in the engine's worker thread (amdllm/infer/engine.py); handlers only queue requests and await
events that the worker posts with `loop.call_soon_threadsafe`, so the event loop never blocks.
Extension: `"return_token_ids": true` (OpenAI clients: `extra_body=`) adds the new token ids to a choice.
"""
# no `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime

import asyncio
import concurrent.futures
import hmac
import json
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from amdllm.infer.engine import Engine, Request, new_id, now
from amdllm.infer.generate import load_model
from amdllm.io.templates import TEMPLATE_FILE, TemplateError, render_chat, use_chat_template

STATIC = Path(__file__).resolve().parent / "static"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------------------------
# Request parsing: plain functions from a JSON dict to engine inputs (errors name the parameter)
# ------------------------------------------------------------------------------------------------
def _number(body: dict, name: str, default, lo: float, hi: float, kind=float):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", name,
                       "invalid_type")
    if not lo <= v <= hi:
        raise APIError(400, f"'{name}' must be between {lo} and {hi}, got {v}", name, "invalid_value")
    return kind(v)


def _flag(body: dict, name: str) -> bool:
    """A boolean field: true, false or absent/null (a string such as "false" is refused, not truthy)."""
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {v!r}", name, "invalid_type")
    return v


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"'stop' must be a string or a list of up to 4 strings, got {body['stop']!r}",
                       "stop", "invalid_type")
    return [s for s in stop if s]


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages",
                       "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise APIError(400, f"messages[{i}] needs a 'role' of system, user, assistant or developer",
                           f"messages.[{i}].role", "invalid_value")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages.[{i}].content", "invalid_type")
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", f"messages.[{i}].content",
                           "invalid_type")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_tokens_cap: int = 512


class Parsed:
    """A validated request: token ids and sampling settings."""

    def __init__(self, body: dict, prompt_ids: list[int], cfg: ServerConfig, context: int, chat: bool):
        self.stream = _flag(body, "stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise APIError(400, f"'stream_options' must be an object, got {so!r}", "stream_options", "invalid_type")
        self.include_usage = _flag(so, "include_usage")
        self.return_ids = _flag(body, "return_token_ids")
        P = len(prompt_ids)
        param = "messages" if chat else "prompt"
        if P == 0:
            raise APIError(400, "the prompt is empty (it has no tokens)", param, "invalid_value")
        if P >= context:
            raise APIError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                                f"{P} tokens: nothing is left to generate. Shorten the prompt.", param,
                           "context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        room = context - P
        if body.get(name) is None:  # OpenAI: 16 for completions, "as much as fits" for chat
            self.max_tokens = min(16 if not chat else cfg.max_tokens_cap, room, cfg.max_tokens_cap)
        else:
            self.max_tokens = _number(body, name, None, 1, 1 << 31, int)
            if self.max_tokens > cfg.max_tokens_cap:
                raise APIError(400, f"'{name}' is {self.max_tokens}, above this server's cap of "
                                    f"{cfg.max_tokens_cap} (amdllm serve --max-tokens-cap)", name,
                               "invalid_value")
            if P + self.max_tokens > context:
                raise APIError(400, f"This model's maximum context length is {context} tokens. However, you "
                                    f"requested {P + self.max_tokens} tokens ({P} in the prompt, "
                                    f"{self.max_tokens} for the completion). Reduce the prompt or "
                                    f"'{name}'.", name, "context_length_exceeded")
        self.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        self.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if self.top_p == 0.0:
            self.top_p = 1e-9  # keeps only the most likely token
        seed = body.get("seed")
        self.seed = None if seed is None else _number(body, "seed", 0, -(1 << 63), (1 << 63) - 1, int) % (1 << 31)
        if _number(body, "n", 1, 1, 1 << 31, int) != 1:
            raise APIError(400, "only n=1 is supported", "n", "invalid_value")
        self.stop = _stops(body)
        self.prompt_ids = prompt_ids


MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt is ~0.5 MB of text


def max_prompt_chars(tokenizer, context: int) -> int:
    """A bound on a prompt's characters above which it cannot fit `context` tokens: no token stands for
    more characters than its longest vocabulary string (a byte-level or SentencePiece string has at least
    one character per character it decodes to). Checked before tokenizing, which is the slow part."""
    return context * max(len(t) for t in tokenizer.get_vocab())


def _check_chars(n: int, limit: int, param: str) -> None:
    if n > limit:
        raise APIError(400, f"The prompt has {n:,} characters, more than any prompt of this model's context "
                            f"can hold ({limit:,}). Shorten the prompt.", param, "context_length_exceeded")


def parse_completion(body: dict, tokenizer, cfg: ServerConfig, context: int, char_limit: int) -> Parsed:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check_chars(len(prompt), char_limit, "prompt")
        ids = list(tokenizer(prompt)["input_ids"])  # exactly as `amdllm generate` tokenizes
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        V = len(tokenizer)
        if any(not 0 <= t < V for t in prompt):
            raise APIError(400, f"'prompt' token ids must be in [0, {V})", "prompt", "invalid_value")
        ids = list(prompt)
    else:
        raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                       "prompt", "invalid_type")
    return Parsed(body, ids, cfg, context, chat=False)


def parse_chat(body: dict, tokenizer, cfg: ServerConfig, context: int, char_limit: int) -> Parsed:
    try:
        text, stops = render_chat(tokenizer, _messages(body))
    except TemplateError as e:  # e.g. a template that demands alternating roles
        raise APIError(400, str(e), "messages", "invalid_value") from None
    _check_chars(len(text), char_limit, "messages")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the text holds BOS already
    p = Parsed(body, ids, cfg, context, chat=True)
    p.stop += [s for s in stops if s not in p.stop]
    return p


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------
def create_app(engine: Engine, cfg: ServerConfig):
    # the [serve] extra: imported when an app is built, so the rest of amdllm works without it
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="amdllm", docs_url=None, redoc_url=None)
    app.state.engine, app.state.config = engine, cfg

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # unknown routes and methods, in OpenAI's shape too
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, str(e.detail), None, code).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e):
        return JSONResponse(APIError(400, str(e), None, "invalid_request").body(), status_code=400)

    def check_key(request: HTTPRequest):
        if cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth:
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
                           None, "missing_api_key")
        if not hmac.compare_digest(auth.encode(), f"Bearer {cfg.api_key}".encode()):  # constant time
            raise APIError(401, "Incorrect API key provided.", None, "invalid_api_key")

    async def read_body(request: HTTPRequest) -> dict:
        check_key(request)
        too_big = APIError(413, f"The request body is larger than {MAX_BODY_BYTES:,} bytes", None,
                           "request_too_large")
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise too_big
        raw = bytearray()
        async for chunk in request.stream():  # chunked bodies too: never more than the cap in memory
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise too_big
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"The request body is not valid JSON: {e}", None, "invalid_json") from None
        except RecursionError:
            raise APIError(400, "The request body is not valid JSON: nested too deeply", None,
                           "invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object", None, "invalid_json")
        model = body.get("model", cfg.model_name)
        if model != cfg.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{cfg.model_name}' "
                                f"(GET /v1/models).", "model", "model_not_found")
        return body

    @app.get("/")
    async def index():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/health")
    async def health():
        s = engine.stats
        return {"status": "ok", "requests": s["requests"], "decode_steps": s["decode_steps"],
                "max_batch_seen": s["max_batch_seen"], "tokens": s["tokens"], "shifts": s["shifts"],
                "batch_hist": {str(k): v for k, v in sorted(s["batch_hist"].items())}}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        check_key(request)
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "amdllm"}]}

    # templating and tokenizing run on one worker thread, off the event loop: a long prompt never holds
    # up other clients (they were frozen 26 s by one 10 MB prompt)
    parser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="amdllm-tokenize")
    char_limit = max_prompt_chars(engine.tokenizer, engine.S)

    async def parse(fn, body):
        return await asyncio.get_running_loop().run_in_executor(
            parser, lambda: fn(body, engine.tokenizer, cfg, engine.S, char_limit))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await read_body(request)
        return await run(request, await parse(parse_completion, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await read_body(request)
        return await run(request, await parse(parse_chat, body), chat=True)

    async def run(request: HTTPRequest, p: Parsed, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(p.prompt_ids, p.max_tokens, lambda k, v: loop.call_soon_threadsafe(events.put_nowait, (k, v)),
                      temperature=p.temperature, top_p=p.top_p, seed=p.seed, stop=p.stop)
        engine.submit(req)
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": cfg.model_name, "system_fingerprint": None}
        if p.stream:
            return StreamingResponse(sse(req, events, head, p, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text = []
            while True:
                kind, v = await events.get()
                if kind == "delta":
                    text.append(v["text"])
                elif kind == "error":
                    raise APIError(500, v, None, "generation_failed", type="server_error")
                else:
                    break
        finally:
            req.cancelled.set()  # a client that went away frees its batch row
        choice = {"index": 0, "finish_reason": v["finish_reason"], "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        if p.return_ids:
            choice["token_ids"] = v["token_ids"]
        return {**head, "choices": [choice], "usage": usage(v)}

    async def sse(req, events, head, p: Parsed, chat: bool):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(delta: str | None, finish=None, role=False, ids=None):
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            if ids is not None and p.return_ids:
                c["token_ids"] = ids
            obj = {**head, "choices": [c]}
            if p.include_usage:
                obj["usage"] = None
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                kind, v = await events.get()
                if kind == "delta":
                    yield chunk(v["text"], ids=v["token_ids"])
                elif kind == "error":  # headers are gone: report it in-band, as OpenAI does
                    yield f"data: {json.dumps(APIError(500, v, None, 'generation_failed', 'server_error').body())}\n\n"
                    break
                else:
                    yield chunk(None if chat else "", finish=v["finish_reason"], ids=[])
                    if p.include_usage:
                        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(v)})}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            req.cancelled.set()

    return app


def usage(v: dict) -> dict:
    return {"prompt_tokens": v["prompt_tokens"], "completion_tokens": v["completion_tokens"],
            "total_tokens": v["prompt_tokens"] + v["completion_tokens"]}


# ------------------------------------------------------------------------------------------------
# Running it: in the background (tests, notebooks) or in the foreground (the CLI)
# ------------------------------------------------------------------------------------------------
class ServerHandle:
    """A running server: `.url` (http://host:port), `.engine`, `.stop()` (also a context manager)."""

    def __init__(self, server, thread, engine, url):
        self.server, self.thread, self.engine, self.url = server, thread, engine, url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.engine.stop(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def build(model=None, tokenizer=None, *, model_dir=None, adapter=None, dtype="float32", max_batch=8,
          max_len=None, api_key=None, max_tokens_cap=512, model_name=None, warmup=True, allow_pickle=False,
          chat_template=None):
    """(app, engine): load the model from `model_dir` (with `adapter`) unless given, start the engine.
    chat_template: a name or Jinja file (amdllm.io.templates); by default the adapter's
    chat_template.jinja (the template it was trained with) if it has one, else the tokenizer's own."""
    if model is None:
        if model_dir is None:
            raise ValueError("pass a model (and its tokenizer) or model_dir")
        model, tokenizer, model_dir = load_model(model_dir, adapter, dtype, allow_pickle)
    if tokenizer is None:
        raise ValueError("a tokenizer is needed with an in-memory model")
    if chat_template is None and adapter is not None and (Path(adapter) / TEMPLATE_FILE).is_file():
        chat_template = str(Path(adapter) / TEMPLATE_FILE)
    use_chat_template(tokenizer, chat_template)
    if model_name is None:
        model_name = Path(model_dir).name if model_dir is not None else "amdllm"
        if adapter is not None:
            model_name += "+" + Path(adapter).name
    # a cache row per batch slot: cap the default length so a 128k-context config does not allocate it all
    engine = Engine(model, tokenizer, max_batch=max_batch, max_len=max_len or min(4096, model.cfg.max_position_embeddings))
    if max_tokens_cap < 1:
        raise ValueError(f"--max-tokens-cap must be >= 1, got {max_tokens_cap}")
    if warmup:
        engine.warmup()
    return create_app(engine, ServerConfig(model_name, api_key, max_tokens_cap)), engine


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (the command binds it before loading the model: a wrong --port or
    one in use is reported at once, not after the load)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: expected 0 to 65535")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def start_server(model=None, tokenizer=None, *, host: str = "127.0.0.1", port: int = 0, log_level="warning",
                 **kw) -> ServerHandle:
    """Start the server in a background thread and return once it accepts connections. port 0 picks a
    free port. Keyword arguments as `build` (model_dir=, adapter=, max_batch=, api_key=, ...)."""
    import uvicorn  # the [serve] extra, as above

    app, engine = build(model, tokenizer, **kw)
    sock = listen_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="amdllm-http", daemon=True)
    thread.start()
    while not server.started:  # uvicorn sets it once listening; a failed start ends the thread
        if not thread.is_alive():
            engine.stop()
            raise RuntimeError("the HTTP server failed to start (see the log above)")
        thread.join(0.05)
    return ServerHandle(server, thread, engine, socket_url(sock))
