"""Fine-tuning data: JSON-lines rows -> token ids with a loss mask -> packed (or padded) fixed-length rows.

Rows are Alpaca ({"instruction", "input"?, "output"}), chat ({"messages": [...]}) or plain ({"text"}),
rendered by `amdllm.io.templates` (as the server renders chat prompts). The loss is on response tokens
only (every assistant reply and the end token after it); a plain row trains on all its tokens but BOS.
`prompt_ids` is the template up to the response header, for exact-match evaluation."""
from __future__ import annotations

import bisect
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from amdllm.files import check_text
from amdllm.io.templates import TemplateError, alpaca_pieces, chat_pieces, is_llama3_chat, template_pieces
from amdllm.io.tokenizer import pad_id



class DataError(ValueError):
    """A data file that cannot be used; the message gives file:line and what was expected."""


class DataWarning(UserWarning):
    """Rows that are used but probably not as meant: unknown fields (a typo like "inptu"), empty replies."""


FIELDS = {"alpaca": ("instruction", "input", "output"), "chat": ("messages",), "plain": ("text",)}


# --------------------------------------------------------------------------------------------------
# Reading rows
# --------------------------------------------------------------------------------------------------
def read_jsonl(path) -> list[tuple[int, dict]]:
    """[(line_number, row)] from a JSON-lines file; blank lines are skipped; errors name file:line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file (expected JSON lines)")
    rows = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8 "
                                "(expected UTF-8 JSON lines)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise DataError(f"{path}:{n}: JSON nested too deeply (expected a flat row object)") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append((n, row))
    if not rows:
        raise DataError(f"{path}: empty data file (expected JSON lines with instruction/output, "
                        "messages, or text)")
    return rows


def row_shape(row: dict, where: str) -> str:
    """'alpaca' | 'chat' | 'plain', checking the fields; `where` is 'file:line' for errors."""
    def need_str(key):
        if key not in row:
            raise DataError(f"{where}: missing field {key!r}")
        if not isinstance(row[key], str):
            raise DataError(f"{where}: field {key!r} must be a string, got {type(row[key]).__name__}")
        check_text(row[key], f"{where}: field {key!r}", DataError)
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}] must be {{'role': system|user|assistant, "
                                f"'content': str}}, got {m!r}")
            check_text(m["content"], f"{where}: messages[{i}].content", DataError)
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message (nothing to train on)")
        return "chat"
    if "instruction" in row or "output" in row:
        need_str("instruction")
        need_str("output")
        if "input" in row and row["input"] is not None and not isinstance(row["input"], str):
            raise DataError(f"{where}: field 'input' must be a string")
        if row.get("input"):
            check_text(row["input"], f"{where}: field 'input'", DataError)
        return "alpaca"
    if "text" in row:
        need_str("text")
        return "plain"
    raise DataError(f"{where}: missing field: a row needs 'instruction' and 'output' (Alpaca), "
                    f"'messages' (chat) or 'text' (plain); found keys {sorted(row)}")


# --------------------------------------------------------------------------------------------------
# Templates (amdllm.io.templates, shared with the server): row -> pieces of (text, trained?)
# --------------------------------------------------------------------------------------------------
def _pieces(row: dict, shape: str, llama3: bool, eos: str) -> list[tuple[str, bool]]:
    if shape == "plain":
        return [(row["text"] + eos, True)]
    if shape == "alpaca":
        return alpaca_pieces(row, llama3, eos)
    return chat_pieces(row["messages"], llama3, eos)


def encode_row(row: dict, tokenizer, shape: str | None = None, where: str = "row") -> tuple[list[int], list[int]]:
    """(ids, mask): mask 1 where the token is part of a response (so predicting it is trained).
    Chat rows use the tokenizer's chat template when it has one (`amdllm.io.templates`)."""
    shape = shape or row_shape(row, where)
    if shape == "chat" and getattr(tokenizer, "chat_template", None):
        pieces = template_pieces(tokenizer, row["messages"])  # the template writes BOS if it wants one
    else:
        llama3 = is_llama3_chat(tokenizer)
        eos = tokenizer.eos_token or ""
        if not eos and shape != "plain" and not llama3:
            raise DataError("the tokenizer has no EOS token; the response template needs one")
        bos = tokenizer.bos_token if tokenizer.bos_token_id is not None else ""
        pieces = [(bos or "", False)] + _pieces(row, shape, llama3, eos)
    while pieces and not pieces[-1][1]:  # trailing prompt pieces (after the last reply) teach nothing
        pieces.pop()
    return tokenize_pieces(tokenizer, pieces)


def tokenize_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(ids, mask) of the pieces' joined text, tokenized once, as the server tokenizes a prompt (pieces
    tokenized one by one could differ at the seams: SentencePiece adds a "▁" to each). A token is
    trained when its first character lies in a trained piece."""
    texts, starts, ends, at = [], [], [], 0
    for t, trained in pieces:
        if trained:
            starts.append(at)
            ends.append(at + len(t))
        texts.append(t)
        at += len(t)
    enc = tokenizer("".join(texts), add_special_tokens=False, return_offsets_mapping=True)

    def trained(start):  # the spans are in order and disjoint: a bisection, not a scan (long chats)
        i = bisect.bisect_right(starts, start) - 1
        return int(i >= 0 and start < ends[i])
    mask = [trained(start) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def prompt_ids(row: dict, tokenizer) -> list[int]:
    """Token ids of the prompt for generation: the template up to the response (Alpaca rows)."""
    ids, mask = encode_row(row, tokenizer, "alpaca")
    first = mask.index(1)
    return ids[:first]


# --------------------------------------------------------------------------------------------------
# Fixed-length rows
# --------------------------------------------------------------------------------------------------
TOO_LONG = ("split", "truncate", "drop")


@dataclass
class Dataset:
    """Next-token training rows, all [N, T]: predict targets[t] from tokens[..t] where weights > 0."""
    tokens: np.ndarray       # int32
    targets: np.ndarray      # int32
    weights: np.ndarray      # float32, 1 on response tokens
    segment_ids: np.ndarray  # int32, 0 = padding; packed examples get 1, 2, ...
    positions: np.ndarray    # int32, restart at 0 in every segment
    stats: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)  # the source rows (for task accuracy)

    def __len__(self):
        return int(self.tokens.shape[0])

    def take(self, idx) -> dict:
        return {k: getattr(self, k)[idx] for k in ("tokens", "targets", "weights", "segment_ids", "positions")}


def build_dataset(examples: list[tuple[list[int], list[int]]], seq_len: int, *, pack: bool = True,
                  too_long: str = "split", pad_id: int = 0) -> Dataset:
    """Shift each example by one (inputs ids[:-1], targets ids[1:]) and lay them into rows of seq_len.

    pack=True: examples are placed greedily, in order, into rows (segment ids 1, 2, ... keep them from
    attending to each other, positions restart per example); pack=False: one example per row, padded.
    too_long: an example with more than seq_len predictions is
      'split' into consecutive windows of seq_len (each its own segment: every token is still predicted
      once, without the context of the windows before it), 'truncate'd to its first seq_len, or 'drop'ped.
    `stats` counts each, and the predicted tokens that truncation and dropping lost (`dropped_tokens`)."""
    if too_long not in TOO_LONG:
        raise DataError(f"too_long must be one of {TOO_LONG}, got {too_long!r}")
    if seq_len < 2:
        raise DataError(f"seq_len must be >= 2, got {seq_len}")
    split = truncated = dropped = lost = 0
    shifted = []
    for ids, mask in examples:
        x, y, w = ids[:-1], ids[1:], mask[1:]
        if len(x) > seq_len:
            if too_long == "drop":
                dropped, lost = dropped + 1, lost + sum(w)
                continue
            if too_long == "truncate":
                lost += sum(w[seq_len:])
                x, y, w, truncated = x[:seq_len], y[:seq_len], w[:seq_len], truncated + 1
            else:
                split += 1
                parts = [(x[i:i + seq_len], y[i:i + seq_len], w[i:i + seq_len]) for i in range(0, len(x), seq_len)]
                shifted += [p for p in parts if any(p[2])]  # a window of prompt only teaches nothing
                continue
        if not x or not any(w):
            dropped += 1  # nothing left to learn (e.g. the response was cut off entirely)
            continue
        shifted.append((x, y, w))
    if not shifted:
        raise DataError(f"no usable examples: {dropped} dropped (too long for seq_len {seq_len} or "
                        "without response tokens)")
    rows: list[list[tuple]] = []
    if pack:
        used = []
        for ex in shifted:  # first fit into the current row, else open a new one
            if rows and used[-1] + len(ex[0]) <= seq_len:
                rows[-1].append(ex)
                used[-1] += len(ex[0])
            else:
                rows.append([ex])
                used.append(len(ex[0]))
    else:
        rows = [[ex] for ex in shifted]
    N = len(rows)
    arr = {k: np.zeros((N, seq_len), np.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    arr["tokens"][:] = pad_id
    weights = np.zeros((N, seq_len), np.float32)
    for r, row in enumerate(rows):
        t = 0
        for s, (x, y, w) in enumerate(row, 1):
            n = len(x)
            arr["tokens"][r, t:t + n], arr["targets"][r, t:t + n] = x, y
            weights[r, t:t + n] = w
            arr["segment_ids"][r, t:t + n] = s
            arr["positions"][r, t:t + n] = np.arange(n)
            t += n
    stats = {"examples": len(examples), "segments": len(shifted), "split": split, "truncated": truncated,
             "dropped": dropped, "dropped_tokens": int(lost),
             "rows": N, "tokens": int((arr["segment_ids"] > 0).sum()), "trained_tokens": int(weights.sum())}
    return Dataset(weights=weights, stats=stats, **arr)


def load_dataset(path, tokenizer, seq_len: int, *, pack: bool = True, too_long: str = "split") -> Dataset:
    """Read, template, tokenize and lay out a JSONL file. Errors name file:line."""
    rows = read_jsonl(path)
    examples, unknown, empty = [], {}, []
    for n, row in rows:
        where = f"{path}:{n}"
        shape = row_shape(row, where)
        for k in row.keys() - set(FIELDS[shape]):
            unknown.setdefault(k, []).append(n)
        if not _reply_text(row, shape).strip():
            empty.append(n)
        try:
            examples.append(encode_row(row, tokenizer, shape, where))
        except TemplateError as e:  # the template's own failure, on this line's conversation
            raise DataError(f"{where}: {e}") from None
    for k, lines in sorted(unknown.items()):
        warnings.warn(f"{path}:{lines[0]}: field {k!r} is ignored ({len(lines)} row{'s' * (len(lines) > 1)}); "
                      f"rows are read from {', '.join(sorted({f for fs in FIELDS.values() for f in fs}))}",
                      DataWarning, stacklevel=2)
    if empty:
        warnings.warn(f"{path}:{empty[0]}: empty response ({len(empty)} row{'s' * (len(empty) > 1)}): such a "
                      "row teaches only the end token", DataWarning, stacklevel=2)
    ds = build_dataset(examples, seq_len, pack=pack, too_long=too_long, pad_id=pad_id(tokenizer))
    ds.rows = [row for _, row in rows]
    return ds


def _reply_text(row: dict, shape: str) -> str:
    if shape == "alpaca":
        return row["output"]
    if shape == "chat":
        return "".join(m["content"] for m in row["messages"] if m["role"] == "assistant")
    return row["text"]


# --------------------------------------------------------------------------------------------------
# Deterministic batch order
# --------------------------------------------------------------------------------------------------
def batch_indices(n_rows: int, step: int, batch_size: int, seed: int) -> np.ndarray:
    """Row indices of batch `step` (0-based): epochs are permutations seeded by (seed, epoch), read in
    order, so batch `step` depends only on (seed, step) -- which is what makes --resume exact."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
        out.extend(perm[offset:offset + batch_size - len(out)].tolist())
    return np.asarray(out)


def cursor(n_rows: int, step: int, batch_size: int) -> dict:
    epoch, offset = divmod(step * batch_size, n_rows)
    return {"epoch": epoch, "offset": offset}
