"""`amdllm serve`: the OpenAI-compatible HTTP server in the foreground (amdllm.infer.serve)."""
from __future__ import annotations

import sys

from amdllm.cli.common import add_pickle_arg, count, model_dir, number
from amdllm.infer.generate import DTYPE_CHOICES
from amdllm.infer.http import listen_socket, server_config, socket_url
from amdllm.infer.serve import build


def add_cli(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument("--model", default=None, help="HF checkpoint directory, full or GPTQ (default: the embedded model)")
    p.add_argument("--adapter", default=None, help="PEFT LoRA adapter directory to apply")
    add_pickle_arg(p)
    p.add_argument("--chat-template", default=None, help="llama3, llama2, vicuna or a Jinja file (default: "
                   "the adapter's chat_template.jinja, else the tokenizer's own, else a built-in format)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and "
                   "/openapi.json (/health and the chat page / stay open: they show no data)")
    p.add_argument("--max-batch", type=count(), default=8, help="requests decoded together (cache rows)")
    p.add_argument("--max-tokens-cap", type=count(), default=512, help="largest max_tokens a request may ask for")
    p.add_argument("--max-context", type=count(2), default=None,
                   help="cache length per request (default: the model's context, at most 4096)")
    p.add_argument("--model-name", default=None, help="the id in /v1/models (default: the directory name)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    p.add_argument("--request-timeout", type=number(0, above=True), default=None,
                   help="seconds a client has to send a whole request, from its first byte (default 30); "
                        "a connection that sends nothing or trickles is closed")
    p.add_argument("--max-connections", type=count(), default=None,
                   help="open connections at most (default 512); more are closed at once")
    p.set_defaults(func=run)


def run(args) -> int:
    import uvicorn  # the HTTP stack is imported by the command that serves, not by every command

    sock = listen_socket(args.host, args.port)  # first: a bad --port costs no model load
    try:
        app, engine = build(model_dir=model_dir(args.model), adapter=args.adapter, dtype=args.dtype,
                            max_batch=args.max_batch, max_len=args.max_context, api_key=args.api_key,
                            max_tokens_cap=args.max_tokens_cap, model_name=args.model_name,
                            allow_pickle=args.allow_pickle, chat_template=args.chat_template)
    except BaseException:
        sock.close()
        raise
    name = app.state.config.model_name
    print(f"amdllm serve: '{name}' on {socket_url(sock)} (chat page at /, OpenAI API at /v1, "
          f"batch {engine.B}, context {engine.S}); Ctrl-C stops", file=sys.stderr)
    try:
        limits = {k: v for k, v in (("request_timeout", args.request_timeout),
                                    ("max_connections", args.max_connections)) if v is not None}
        uvicorn.Server(server_config(app, **limits)).run(sockets=[sock])
    finally:
        engine.stop()
    return 0
