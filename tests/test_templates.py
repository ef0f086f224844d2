"""Chat templates (amdllm.io.templates): the named ones give the formats their projects define (written
out here), a tokenizer's own template renders as transformers' apply_chat_template, training puts the
loss on exactly the assistant replies, and the server sends the prompt training used."""
from __future__ import annotations

import json

import pytest

from amdllm import cli
from amdllm.io.templates import NAMED_TEMPLATES, VICUNA_SYSTEM, render_chat, template_pieces, use_chat_template
from amdllm.io.tokenizer import load_tokenizer
from amdllm.train.data import encode_row, load_dataset
from tests.vicuna import DATA, make_vicuna_layout, train_sentencepiece, write_sentencepiece_tokenizer

CHAT = [{"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Which animal went to the park?"},
        {"role": "assistant", "content": "The cat."},
        {"role": "user", "content": "And what color was it?"},
        {"role": "assistant", "content": "Red, 12 times."}]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    write_sentencepiece_tokenizer(d, train_sentencepiece())
    return d


def fastchat_vicuna(messages, generation=False):
    """FastChat's vicuna_v1.1 conversation (sep " ", sep2 "</s>", roles USER/ASSISTANT), written out."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else VICUNA_SYSTEM
    ret = system + " "
    for i, m in enumerate(x for x in messages if x["role"] != "system"):
        ret += ("USER" if m["role"] == "user" else "ASSISTANT") + ": " + m["content"] + (" " if i % 2 == 0 else "</s>")
    return "<s>" + ret + ("ASSISTANT:" if generation else "")


def test_named_templates_render_their_projects_formats(sp_dir):
    tok = use_chat_template(load_tokenizer(sp_dir), "vicuna")
    assert tok.apply_chat_template(CHAT, tokenize=False) == fastchat_vicuna(CHAT)
    assert render_chat(tok, CHAT[:4])[0] == fastchat_vicuna(CHAT[:4], generation=True)
    tok = use_chat_template(load_tokenizer(sp_dir), "llama2")
    assert tok.apply_chat_template(CHAT, tokenize=False) == (
        "<s>[INST] <<SYS>>\nAnswer in one word.\n<</SYS>>\n\nWhich animal went to the park? [/INST] The cat. </s>"
        "<s>[INST] And what color was it? [/INST] Red, 12 times. </s>")
    tok = use_chat_template(load_tokenizer(DATA / "tokenizer"), "llama3")
    h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
    assert render_chat(tok, CHAT[:2])[0] == (f"<|begin_of_text|>{h('system')}Answer in one word.<|eot_id|>"
                                             f"{h('user')}Which animal went to the park?<|eot_id|>{h('assistant')}")


@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_training_pieces_join_to_apply_chat_template_and_mask_the_replies(name, sp_dir):
    """The training text is apply_chat_template's; the trained tokens are the replies (with their end
    token), nothing else; the served prompt is the training text up to the last reply."""
    tok = use_chat_template(load_tokenizer(sp_dir), name)
    pieces = template_pieces(tok, CHAT)
    text = "".join(t for t, _ in pieces)
    assert text == tok.apply_chat_template(CHAT, tokenize=False)
    replies = [t for t, trained in pieces if trained]
    assert len(replies) == 2 and all(r.strip().startswith(c["content"]) for r, c in zip(replies, CHAT[2::2]))
    ids, mask = encode_row({"messages": CHAT}, tok)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # tokenized once, as a server would
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained.replace(" ", "") == "".join(replies).replace(" ", "")
    prompt = render_chat(tok, CHAT[:4])[0]
    assert text.startswith(prompt) and text[len(prompt):] == replies[1]


def test_finetune_and_serve_use_the_same_template(tmp_path, sp_dir, capfd):
    """finetune --chat-template vicuna on a Vicuna-layout checkpoint trains the replies only, saves the
    template with the adapter, and the server built on that adapter renders chats with it."""
    from amdllm.infer.serve import build
    model_dir = tmp_path / "vicuna"
    make_vicuna_layout(model_dir, (sp_dir / "tokenizer.model").read_bytes(), seed=5)
    rows = [{"messages": CHAT}] * 8
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = use_chat_template(load_tokenizer(model_dir), "vicuna")
    ds = load_dataset(tmp_path / "chat.jsonl", tok, 128, pack=False)
    ids, mask = encode_row({"messages": CHAT}, tok)
    assert int(ds.weights[0].sum()) == sum(mask) > 0
    out = tmp_path / "lora"
    rc = cli.main(["finetune", "--model", str(model_dir), "--allow-pickle", "--data", str(tmp_path / "chat.jsonl"),
                   "--out", str(out), "--chat-template", "vicuna", "--steps", "2", "--batch-size", "4",
                   "--seq-len", "128", "--mesh", "fsdp=1", "--rank", "2", "--targets", "q", "--no-progress", "--json"])
    assert rc == 0, capfd.readouterr().err
    assert (out / "chat_template.jinja").read_text() == NAMED_TEMPLATES["vicuna"]
    app, engine = build(model_dir=model_dir, adapter=out, allow_pickle=True, warmup=False)
    try:
        served = render_chat(engine.tokenizer, CHAT[:4])[0]
    finally:
        engine.stop()
    assert served == fastchat_vicuna(CHAT[:4], generation=True)


@pytest.mark.parametrize("name", [*sorted(NAMED_TEMPLATES), "smollm2", "trims"])
def test_the_four_render_shortcut_gives_the_pieces_of_every_prefix_or_steps_aside(name, sp_dir, monkeypatch):
    """Long chats: `template_pieces` renders four times instead of twice per reply when that gives the very
    pieces the prefix renders give, replies printed as they are or trimmed (Llama 3's template, and here a
    trimming Vicuna). Whatever else a template does to a reply makes the shortcut step aside."""
    from amdllm.course.chat_model import chat_model_dir
    from amdllm.io.templates import _pieces_by_prefix, _pieces_in_one
    if name == "smollm2":  # the course's real chat model: ChatML, with its own default system prompt
        tok = load_tokenizer(chat_model_dir())
    else:
        tok = use_chat_template(load_tokenizer(sp_dir), "vicuna" if name == "trims" else name)
        if name == "trims":
            tok.chat_template = tok.chat_template.replace("m['content']", "m['content'] | trim")
    chat = CHAT + [{"role": "user", "content": " Why? "}, {"role": "assistant", "content": " Because. "}]
    fast, slow = _pieces_in_one(tok, chat), _pieces_by_prefix(tok, chat)
    assert fast == slow
    from amdllm.io import templates
    renders, real = [], templates._apply
    monkeypatch.setattr(templates, "_apply", lambda *a: renders.append(1) or real(*a))
    long_chat = chat[:1] + chat[1:5] * 100  # 200 replies: four renders, not 400
    assert template_pieces(tok, long_chat) and len(renders) == 4


def test_a_template_that_rewrites_replies_falls_back_to_the_prefix_renders(sp_dir):
    from amdllm.io.templates import _pieces_by_prefix, _pieces_in_one
    tok = use_chat_template(load_tokenizer(sp_dir), "vicuna")
    tok.chat_template = tok.chat_template.replace("m['content']", "m['content'] | upper")
    assert _pieces_in_one(tok, CHAT) is None
    assert template_pieces(tok, CHAT) == _pieces_by_prefix(tok, CHAT)
