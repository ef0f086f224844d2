"""Checkpoints for the cluster tests, and `amdllm` run as several processes on one machine: each process gets
CPU devices through XLA_FLAGS and joins with JAX's own variables (amdllm.course.cluster.run_local)."""
import json
from pathlib import Path

from amdllm.course.cluster import amdllm_command, run_local
from tests.tiny import make_hf_checkpoint

STORY = ("the cat sat on the mat. the dog ran to the park. a bird sang in the tree. tom had three apples and "
         "ann had two pears. the red fox met the blue owl near the old mill by the river.\n")
ROWS = [{"instruction": f"where is the {a}?", "output": f"the {a} is in the {b}."}
        for a, b in [("cat", "park"), ("dog", "tree"), ("fox", "mat"), ("owl", "park"), ("bird", "mill"),
                     ("ann", "river"), ("tom", "tree"), ("fox", "park")] * 4]


def make_model(root: Path, *, hidden: int, intermediate: int, layers: int, heads: int = 16, kv_heads: int = 4,
               vocab: int = 512, dtype: str = "bfloat16") -> Path:
    """A random Llama checkpoint in the Hugging Face layout (sharded safetensors) with its own BPE tokenizer,
    plus train.jsonl beside it."""
    from amdllm.io import tokenizer as T
    root.mkdir(parents=True, exist_ok=True)
    (root / "text.txt").write_text(STORY * 20)
    tok = T.train_bpe([root / "text.txt"], vocab_size=300)  # BOS 0, EOS 1, PAD 2
    ckpt, _ = make_hf_checkpoint(root, name="model", dtype=dtype, max_shard_size="100MB", std=0.02,
                                 vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                 num_hidden_layers=layers, num_attention_heads=heads,
                                 num_key_value_heads=kv_heads, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                 max_position_embeddings=256)
    T.save_for_transformers(tok, ckpt)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return ckpt


def launch(args: list, *, processes: int, devices: int, timeout: float = 600, env: dict | None = None,
           started: int | None = None, kill_when=None, kill: int = 1) -> list:
    """`amdllm ARGS` as `processes` processes of `devices` CPU devices each (amdllm.course.cluster.run_local).
    Returns [(returncode, stdout, stderr, seconds)] per launched process."""
    procs = run_local(amdllm_command(*args), processes=processes, devices=devices, env=env, timeout=timeout,
                      started=started, kill_when=kill_when, kill=kill)
    return [(p.returncode, p.stdout, p.stderr, p.seconds) for p in procs]
