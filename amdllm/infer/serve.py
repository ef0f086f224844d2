"""`amdllm serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over the batching engine.

GET /v1/models, POST /v1/completions and /v1/chat/completions (`stream: true`: server-sent events in
OpenAI's chunk format), GET / (the chat page). Every error has OpenAI's shape and a 4xx status. The model
runs in the engine's worker thread; handlers only queue requests and await the events it posts, so the
event loop never blocks. `"return_token_ids": true` (`extra_body=`) adds the new token ids to a choice."""
# no `from __future__ import annotations`: FastAPI reads the handlers' annotations at runtime

import asyncio
import concurrent.futures
import hmac
import json
import logging
import threading
import time
from pathlib import Path

from amdllm.infer import http
from amdllm.infer.api import (MAX_BODY_BYTES, APIError, Parsed, ServerConfig, check_body, max_prompt_chars,
                              parse_chat, parse_completion)
from amdllm.infer.engine import Engine, Request, new_id, now
from amdllm.infer.generate import load_model
from amdllm.io.templates import TEMPLATE_FILE, use_chat_template
from amdllm.model.inputs import expect_model, expect_tokenizer

STATIC = Path(__file__).resolve().parent / "static"
log = logging.getLogger("amdllm.serve")


DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------
def create_app(engine: Engine, cfg: ServerConfig):
    # the [serve] extra: imported when an app is built, so the rest of amdllm works without it
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    # /openapi.json is served below, behind the API key like /v1 (it is the API's map)
    app = FastAPI(title="amdllm", docs_url=None, redoc_url=None, openapi_url=None)
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

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):  # a bug of ours: OpenAI's shape, and one log line
        log.error("%s %s: internal error: %s: %s", request.method, request.url.path, type(e).__name__, e)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", None, "internal_error",
                                     type="server_error").body(), status_code=500)

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
        check_body(body)
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

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: HTTPRequest):
        check_key(request)
        return app.openapi()

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        check_key(request)
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "amdllm"}]}

    # tokenizing runs on a worker thread, off the event loop: a long prompt never holds up other clients.
    # Chat templates render on their own thread: a template that loops until its bound (RENDER_STEPS)
    # delays other chats, never plain completions.
    parsers = {parse_completion: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="amdllm-tokenize"),
               parse_chat: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="amdllm-template")}
    char_limit = max_prompt_chars(engine.tokenizer, engine.S)

    async def parse(fn, body):
        return await asyncio.get_running_loop().run_in_executor(
            parsers[fn], lambda: fn(body, engine.tokenizer, cfg, engine.S, char_limit))

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
            text, watch = [], {"next": time.monotonic() + DISCONNECT_POLL_S}
            while True:
                kind, v = await next_event(request, events, watch)
                if kind == "gone":
                    return JSONResponse({}, status_code=499)  # nobody reads it; the row is freed below
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

    async def next_event(request: HTTPRequest, events: asyncio.Queue, watch: dict):
        """The engine's next event, or ("gone", None) once the client has disconnected: without a stream
        nothing is written until the end, so the connection is checked every DISCONNECT_POLL_S, whether
        tokens are flowing or not."""
        getter = asyncio.ensure_future(events.get())
        try:
            while True:
                wait = max(0.0, watch["next"] - time.monotonic())
                done, _ = await asyncio.wait({getter}, timeout=wait)
                if time.monotonic() >= watch["next"]:
                    watch["next"] = time.monotonic() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return "gone", None
                if done:
                    return getter.result()
        finally:
            getter.cancel()  # a no-op once it has its item

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


def build(model=None, tokenizer=None, *, model_dir=None, adapter=None, dtype="auto", max_batch=8,
          max_len=None, api_key=None, max_tokens_cap=512, model_name=None, warmup=True, allow_pickle=False,
          chat_template=None):
    """(app, engine): load the model from `model_dir` (with `adapter`) unless given, start the engine.
    chat_template: a name or Jinja file (amdllm.io.templates); by default the adapter's
    chat_template.jinja (the template it was trained with) if it has one, else the tokenizer's own."""
    if model is None:
        if model_dir is None:
            raise ValueError("pass a model (and its tokenizer) or model_dir")
        model, tokenizer, model_dir = load_model(model_dir, adapter, dtype, allow_pickle)
    expect_model(model, "build")
    expect_tokenizer(tokenizer, "build (a tokenizer is needed with an in-memory model)")
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
    return create_app(engine, ServerConfig(model_name, api_key, max_tokens_cap, model.cfg.vocab_size)), engine


def start_server(model=None, tokenizer=None, *, host: str = "127.0.0.1", port: int = 0, log_level="warning",
                 request_timeout: float | None = None, max_connections: int | None = None, **kw) -> ServerHandle:
    """Start the server in a background thread and return once it accepts connections. port 0 picks a
    free port. request_timeout / max_connections: the HTTP guards (amdllm.infer.http; defaults there).
    Other keyword arguments as `build` (model_dir=, adapter=, max_batch=, api_key=, ...)."""
    import uvicorn  # the [serve] extra, as above

    limits = {k: v for k, v in (("request_timeout", request_timeout), ("max_connections", max_connections))
              if v is not None}
    sock = http.listen_socket(host, port)
    try:
        app, engine = build(model, tokenizer, **kw)
    except BaseException:
        sock.close()
        raise
    server = uvicorn.Server(http.server_config(app, log_level=log_level, timeout_graceful_shutdown=5, **limits))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="amdllm-http", daemon=True)
    thread.start()
    while not server.started:  # uvicorn sets it once listening; a failed start ends the thread
        if not thread.is_alive():
            engine.stop()
            raise RuntimeError("the HTTP server failed to start (see the log above)")
        thread.join(0.05)
    return ServerHandle(server, thread, engine, http.socket_url(sock))
