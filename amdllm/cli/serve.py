"""`amdllm serve`: the OpenAI-compatible HTTP server in the foreground (amdllm.infer.serve)."""
from __future__ import annotations

import sys

from amdllm.cli.common import model_dir
from amdllm.infer.http import listen_socket, server_config, socket_url
from amdllm.infer.serve import build


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
