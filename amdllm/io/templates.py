"""Prompt templates: how instruction rows and chat messages become text, for training and for serving
alike (the same text a fine-tuned model learned is what the server sends it).

  * The tokenizer's own chat template (`chat_template` in tokenizer_config.json or chat_template.jinja),
    when it has one, for serving.
  * Llama 3's header format when the tokenizer has <|start_header_id|>, <|end_header_id|> and <|eot_id|>:
      <|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n...
  * Otherwise the plain format: "### User:\\n{content}\\n\\n" blocks, an assistant reply ending with EOS,
    and the Alpaca layout for instruction rows ("### Instruction:", "### Input:", "### Response:").
A piece is (text, trained): training puts the loss on the trained pieces (every assistant reply and the
end token after it); serving joins the pieces and adds the assistant's header.
"""
from __future__ import annotations

LLAMA3_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
PLAIN_STOPS = ("\n### ",)  # a base model in the plain format would go on to write the next turn


def is_llama3_chat(tokenizer) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in LLAMA3_SPECIALS)


def chat_pieces(messages: list[dict], llama3: bool, eos: str) -> list[tuple[str, bool]]:
    """[(text, trained)] for {role, content} messages; special tokens are literal strings."""
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
    """(prompt text with its special tokens written out, implicit stop strings) for serving."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), []
    llama3 = is_llama3_chat(tokenizer)
    text = "".join(t for t, _ in chat_pieces(messages, llama3, tokenizer.eos_token or ""))
    return (tokenizer.bos_token or "") + text + assistant_header(llama3), [] if llama3 else list(PLAIN_STOPS)
