"""Prompt templates: how instruction rows and chat messages become text, for training and serving alike.

A chat template (Jinja, as transformers runs it) is the tokenizer's own, or `--chat-template`: a name in
`NAMED_TEMPLATES` (llama3, llama2, vicuna) or a file. Without one, built-in formats: Llama 3's headers
where the tokenizer has them, else "### User:" blocks and the Alpaca layout. A piece is (text, trained):
training puts the loss on the assistant's replies; with a chat template the pieces join to exactly
`tokenizer.apply_chat_template(messages, tokenize=False)`."""
from __future__ import annotations

import sys
from pathlib import Path

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from amdllm.files import read_text

LLAMA3_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
PLAIN_STOPS = ("\n### ",)  # a base model in the plain format would go on to write the next turn
TEMPLATE_FILE = "chat_template.jinja"  # beside an adapter: the template it was trained with

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant "
                 "gives helpful, detailed, and polite answers to the user's questions.")
NAMED_TEMPLATES = {
    # Llama 3 / 3.1 instruct, without the tool-calling and date lines
    "llama3": ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
               "\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    # Llama 2 chat: [INST] ... [/INST] reply </s>, the system prompt inside the first user turn
    "llama2": ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system = "
               "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system = false %}"
               "{% endif %}{% for m in loop_messages %}{% if loop.index0 == 0 and system != false %}{% set content "
               "= '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + m['content'] %}{% else %}{% set content = "
               "m['content'] %}{% endif %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + content | trim"
               " + ' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ ' ' + content | trim + ' ' + eos_token }}"
               "{% endif %}{% endfor %}"),
    # FastChat's vicuna_v1.1: "{system} USER: {u} ASSISTANT: {a}</s>USER: ..."
    "vicuna": ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
               "{% set loop_messages = messages[1:] %}{% else %}{% set system = \"" + VICUNA_SYSTEM + "\" %}"
               "{% set loop_messages = messages %}{% endif %}{{ system + ' ' }}{% for m in loop_messages %}"
               "{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}{% elif m['role'] == 'assistant' %}"
               "{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"),
}


class TemplateError(ValueError):
    """A chat template that cannot be found or used; the message names it and what was expected."""


def chat_template_text(spec: str) -> str:
    """--chat-template NAME|FILE -> the Jinja text."""
    if spec in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise TemplateError(f"--chat-template {spec}: neither a template name ({', '.join(NAMED_TEMPLATES)}) "
                            "nor a Jinja file")
    text = read_text(path, TemplateError)
    if not text.strip():
        raise TemplateError(f"--chat-template {spec}: the file is empty (expected a Jinja chat template)")
    return text


def check_parses(text: str, where: str) -> None:
    """A template that does not parse is refused when it is given, not at the first request."""
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as e:
        raise TemplateError(f"{where}: line {e.lineno}: the chat template does not parse ({e.message})") from None


def use_chat_template(tokenizer, spec: str | None):
    """Give `tokenizer` the template `spec` (name or file); None keeps its own. Returns the tokenizer.
    Either way the template is checked to parse; errors in rendering name where it came from."""
    if spec is not None:
        tokenizer.chat_template = chat_template_text(spec)
    where = (f"--chat-template {spec}" if spec is not None and spec not in NAMED_TEMPLATES else
             f"the {spec} template" if spec is not None else "the tokenizer's chat template")
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        check_parses(tokenizer.chat_template, where)
    tokenizer.amdllm_template_source = where  # named by errors in rendering (not saved with the tokenizer)
    return tokenizer


def is_llama3_chat(tokenizer) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in LLAMA3_SPECIALS)


RENDER_STEPS = 5_000_000  # Python steps one render may take: a loop without bound is stopped, on any machine


class _TooLong(Exception):
    pass


def _bounded(fn):
    """fn() with at most RENDER_STEPS traced steps (calls and lines; Jinja templates compile to Python), in
    the calling thread: a count, not a clock, so a loaded machine changes nothing."""
    left = [RENDER_STEPS]

    def tracer(frame, event, arg):
        left[0] -= 1
        if left[0] < 0:
            raise _TooLong
        return tracer
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(old)


def _apply(tokenizer, messages: list[dict], generation: bool) -> str:
    where = getattr(tokenizer, "amdllm_template_source", "the tokenizer's chat template")
    try:
        return _bounded(lambda: tokenizer.apply_chat_template(messages, tokenize=False,
                                                              add_generation_prompt=generation))
    except _TooLong:
        raise TemplateError(f"{where} did not finish rendering one conversation within {RENDER_STEPS:,} "
                            "steps (a loop without bound?)") from None
    except Exception as e:  # jinja2 errors, raise_exception() in the template
        raise TemplateError(f"{where} failed on these messages: {type(e).__name__}: {e}") from None


def template_pieces(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """[(text, trained)] from the tokenizer's chat template: before each assistant message, the
    conversation rendered up to it with the generation prompt; the reply is what the full render adds.
    Rendering every prefix costs time quadratic in the turns, so a shortcut of four renders is tried
    first and kept only where it gives exactly the same pieces on this conversation (`_pieces_in_one`)."""
    return _pieces_in_one(tokenizer, messages) or _pieces_by_prefix(tokenizer, messages)


def _pieces_in_one(tokenizer, messages: list[dict]) -> list[tuple[str, bool]] | None:
    """The pieces from one render with each reply replaced by a marker, with the end-of-turn text learned
    from the first reply's two prefix renders. None (use every prefix) unless the markers come out in
    order, verbatim, each followed by that end text, and the pieces join to the real full render."""
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if len(replies) < 2:
        return None
    k0 = replies[0]
    head0, full0 = _apply(tokenizer, messages[:k0], True), _apply(tokenizer, messages[:k0 + 1], False)
    if not (full0.startswith(head0) and all(isinstance(messages[k]["content"], str) for k in replies)):
        return None
    # markers padded with tabs (no template adds those) tell whether a reply is printed as it is or
    # trimmed (Llama 3's template)
    marks = {k: f"\u2063amdllm-reply-{k}\u2063" for k in replies}
    marked = _apply(tokenizer, [{**m, "content": f"\t{marks[k]}\t"} if k in marks else m
                                for k, m in enumerate(messages)], False)
    if f"\t{marks[k0]}\t" in marked:
        shown, marks = (lambda c: c), {k: f"\t{v}\t" for k, v in marks.items()}
    else:
        shown = str.strip
    i0 = full0.find(shown(messages[k0]["content"]), len(head0))
    if i0 < 0:
        return None
    pre, end = full0[len(head0):i0], full0[i0 + len(shown(messages[k0]["content"])):]  # around a reply
    pieces, at = [], 0
    for k in replies:
        i = marked.find(marks[k], at)
        j = i + len(marks[k])
        if i < len(pre) or not marked.startswith(pre, i - len(pre)) or not marked.startswith(end, j):
            return None
        pieces += [(marked[at:i - len(pre)], False), (pre + shown(messages[k]["content"]) + end, True)]
        at = j + len(end)
    if "\u2063amdllm-reply-" in marked[at:] or pieces[0][0] != head0:
        return None
    if "".join(t for t, _ in pieces) != _apply(tokenizer, messages[:replies[-1] + 1], False):
        return None
    return pieces


def _pieces_by_prefix(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    pieces, done = [], ""
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, full = _apply(tokenizer, messages[:k], True), _apply(tokenizer, messages[:k + 1], False)
        if not (head.startswith(done) and full.startswith(head)):
            raise TemplateError("the chat template renders a conversation differently once it grows (its "
                                "text for the first turns changes), so the assistant replies cannot be located")
        pieces += [(head[len(done):], False), (full[len(head):], True)]
        done = full
    return pieces


def chat_pieces(messages: list[dict], llama3: bool, eos: str) -> list[tuple[str, bool]]:
    """The built-in formats: [(text, trained)] for {role, content} messages; special tokens are literal."""
    out = []
    for m in messages:
        trained = m["role"] == "assistant"
        if llama3:
            out.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
            out.append((m["content"] + "<|eot_id|>", trained))  # the end token is learned too
        else:
            out.append((f"### {m['role'].capitalize()}:\n", False))
            out += [(m["content"] + eos, True), ("\n\n", False)] if trained else [(m["content"] + "\n\n", False)]
    return out


def alpaca_pieces(row: dict, llama3: bool, eos: str) -> list[tuple[str, bool]]:
    """An instruction row {instruction, input?, output}: one user turn and the reply."""
    if llama3:
        user = row["instruction"] + ("\n\n" + row["input"] if row.get("input") else "")
        return chat_pieces([{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}],
                           True, eos)
    p = f"### Instruction:\n{row['instruction']}\n\n"
    if row.get("input"):
        p += f"### Input:\n{row['input']}\n\n"
    return [(p + "### Response:\n", False), (row["output"] + eos, True)]


def assistant_header(llama3: bool) -> str:
    """What a prompt ends with so that the model writes the assistant's reply next."""
    return "<|start_header_id|>assistant<|end_header_id|>\n\n" if llama3 else "### Assistant:\n"


def render_chat(tokenizer, messages: list[dict]) -> tuple[str, list[str]]:
    """(prompt text with its special tokens written out, implicit stop strings) for serving: the text
    training put before the assistant's reply."""
    if getattr(tokenizer, "chat_template", None):
        return _apply(tokenizer, messages, True), []
    llama3 = is_llama3_chat(tokenizer)
    text = "".join(t for t, _ in chat_pieces(messages, llama3, tokenizer.eos_token or ""))
    return (tokenizer.bos_token or "") + text + assistant_header(llama3), [] if llama3 else list(PLAIN_STOPS)
