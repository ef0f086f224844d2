"""The OpenAI API's requests as plain data: a JSON body -> a validated `Parsed` (token ids and sampling
settings), or an `APIError` in OpenAI's shape {"error": {"message", "type", "param", "code"}} naming the
parameter at fault. No HTTP here: `amdllm.infer.serve` calls these on a worker thread, and tests can
call them directly."""
from dataclasses import dataclass

from amdllm.io.templates import TemplateError, render_chat


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


# OpenAI fields this server does not implement -> the values that ask for nothing (answered 400 otherwise,
# naming the field, as vLLM does for what it lacks: a request is never answered as if it had not asked)
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "response_format": (None, {"type": "text"})}


def _same(v, n) -> bool:
    """v is the neutral value n: false is not 0, and 0.0 is 0."""
    if v is None or n is None or isinstance(n, bool) or isinstance(v, bool):
        return v is n
    return v == n if not isinstance(n, (int, float)) else isinstance(v, (int, float)) and v == n


def check_body(body: dict) -> None:
    """What every request is refused for, before its fields are read: a field this server does not
    implement, set to ask for something; a string UTF-8 cannot hold (JSON's lone "\\ud800")."""
    for name, neutral in UNSUPPORTED.items():
        v = body.get(name)
        if not any(_same(v, n) for n in neutral):
            raise APIError(400, f"'{name}' is not supported by this server (got {v!r}); leave it out", name,
                           "unsupported_parameter")

    def walk(v, where):
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"'{where}' holds a lone surrogate (U+{ord(v[e.start]):04X}) at character "
                                    f"{e.start + 1}, not text", where, "invalid_value") from None
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k, where)
                walk(x, f"{where}.{k}" if where else str(k))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{where}.[{i}]")
    walk(body, "")


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
    vocab_size: int | None = None  # the model's: a prompt id at or beyond it is refused, not clamped


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
        if cfg.vocab_size is not None and max(prompt_ids) >= cfg.vocab_size:
            raise APIError(400, f"the prompt holds token id {max(prompt_ids)}, outside the model's vocabulary "
                                f"[0, {cfg.vocab_size}) (its tokenizer has more tokens than the model)", param,
                           "invalid_value")
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
