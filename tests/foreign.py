"""A checkpoint that is not the course's, as a teacher would bring one: built here, offline, with
`transformers` and `tokenizers`, and trained for a few seconds with PyTorch so that it has learned
something (its held-out perplexity is far below its vocabulary size).

It differs from the course model wherever a lesson could have assumed the course's:
- hidden size 96 (not a multiple of 128: GPTQ's group size 128 cannot apply), intermediate 256,
  6 query heads sharing 2 key/value heads, 2 layers, tied embeddings, rope_theta 500000;
- a Llama-2-style tokenizer: Metaspace BPE, `<unk>`=0, `<s>`=1, `</s>`=2, no pad token, vocabulary
  not padded to a multiple of 64;
- its own text (weather and market reports, not stories) and its own instruction task (the colour of
  a fruit, in Alpaca rows), with held-out rows phrased differently from the training rows.

    from tests.foreign import build_foreign
    paths = build_foreign(tmp_path)   # {"model_dir", "train_text", "eval_text", "task_train", "task_eval"}
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

FRUITS = {"banana": "yellow", "apple": "red", "lime": "green", "plum": "purple", "orange": "orange",
          "cherry": "red", "pear": "green", "lemon": "yellow", "grape": "purple", "kiwi": "brown",
          "blueberry": "blue", "coconut": "brown"}
TOWNS = ["Oakfield", "Rivermouth", "Stonebridge", "Millbrook", "Ashford", "Fernhill", "Clearwater", "Eastwick"]
WEATHER = ["sunny", "rainy", "windy", "foggy", "cloudy", "snowy", "stormy", "mild"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve"]
CONFIG = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)


def report(rng: random.Random) -> str:
    town, day, weather = rng.choice(TOWNS), rng.choice(DAYS), rng.choice(WEATHER)
    fruit = rng.choice(sorted(FRUITS))
    n = rng.choice(NUMBERS)
    return (f"On {day} the weather in {town} was {weather}. At the market a trader sold {n} baskets of "
            f"{fruit}s, and every {fruit} was {FRUITS[fruit]}. People in {town} said the {fruit}s were fresh.")


def text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "\n".join(report(rng) for _ in range(n)) + "\n"


def task_rows(n: int, seed: int, held_out: bool) -> list[dict]:
    """Alpaca rows: which colour is this fruit. Held-out rows use other instructions and contexts."""
    rng = random.Random(seed)
    train_q = ["What colour is the fruit?", "Name the colour of this fruit."]
    eval_q = ["Which colour does this fruit have?", "Tell me the fruit's colour."]
    rows = []
    for _ in range(n):
        fruit = rng.choice(sorted(FRUITS))
        town = rng.choice(TOWNS)
        ctx = (f"A basket of {fruit}s from {town}." if not held_out
               else f"The {fruit} came from the market in {town}.")
        rows.append({"instruction": rng.choice(eval_q if held_out else train_q), "input": ctx,
                     "output": FRUITS[fruit]})
    return rows


def make_tokenizer(train_file: Path, out_dir: Path):
    """Llama-2 style: Metaspace BPE with <unk>, <s>, </s> (ids 0, 1, 2), BOS added, no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    # every printable ASCII character is in the alphabet, so prompt templates ("### Instruction:") encode
    tok.train([str(train_file)], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                     initial_alphabet=list(string.printable.strip()),
                                                     show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
    return fast


def train_model(tokenizer, train_text: str, steps: int = 150, seq_len: int = 128, batch: int = 8, seed: int = 0):
    """A transformers LlamaForCausalLM of CONFIG's shape, trained briefly on `train_text` (float32)."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=None,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **CONFIG)
    model = LlamaForCausalLM(cfg)
    # one report per line, EOS between reports, so the model learns to end a reply too
    ids = []
    for line in train_text.splitlines():
        ids += tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    model.train()
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
        x = torch.stack([ids[s:s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def build_foreign(root) -> dict[str, Path]:
    """Write the foreign checkpoint, its texts and its task under `root`; returns their paths."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = {"model_dir": root / "foreign-llama", "train_text": root / "reports_train.txt",
             "eval_text": root / "reports_heldout.txt", "task_train": root / "fruit_train.jsonl",
             "task_eval": root / "fruit_heldout.jsonl"}
    paths["train_text"].write_text(text(3000, seed=1))
    paths["eval_text"].write_text(text(150, seed=2))
    for key, n, seed, held in (("task_train", 600, 3, False), ("task_eval", 48, 4, True)):
        paths[key].write_text("".join(json.dumps(r) + "\n" for r in task_rows(n, seed, held)))
    tok = make_tokenizer(paths["train_text"], paths["model_dir"])
    model = train_model(tok, paths["train_text"].read_text())
    model.save_pretrained(paths["model_dir"])
    return paths
