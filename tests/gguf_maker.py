"""Small GGUF files written locally with ggml's `gguf` writer, as llama.cpp's converter lays them out.

    path = write_llama_gguf(tmp_path / "m.gguf", types={"blk.0.attn_q.weight": "Q4_K"})

Every tensor type the reader claims is used at least once (TYPE_PLAN). Quantizable types go through
`gguf.quants.quantize`; the K-quants, which gguf-py can only dequantize, are random blocks whose
float16 scales are set to small finite values (other types: random blocks, for refusals). q and k are permuted into llama.cpp's rotary order."""
from __future__ import annotations

from pathlib import Path

import numpy as np

SHAPE = dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2, vocab=320, ctx=512, theta=10000.0, eps=1e-5)
# which type each tensor is stored in: all of F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K
TYPE_PLAN = {
    "token_embd.weight": "Q8_0", "output_norm.weight": "F32", "output.weight": "Q6_K",
    "blk.0.attn_norm.weight": "F32", "blk.0.ffn_norm.weight": "F16",
    "blk.0.attn_q.weight": "F16", "blk.0.attn_k.weight": "BF16", "blk.0.attn_v.weight": "Q4_0",
    "blk.0.attn_output.weight": "Q4_1", "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_0",
    "blk.0.ffn_down.weight": "Q5_1",
    "blk.1.attn_norm.weight": "F32", "blk.1.ffn_norm.weight": "F32",
    "blk.1.attn_q.weight": "Q4_K", "blk.1.attn_k.weight": "Q6_K", "blk.1.attn_v.weight": "Q2_K",
    "blk.1.attn_output.weight": "Q3_K", "blk.1.ffn_gate.weight": "Q5_K", "blk.1.ffn_up.weight": "Q8_0",
    "blk.1.ffn_down.weight": "Q4_1",
}
# byte offsets of each K-quant block's float16 scales (d, and dmin where the type has one)
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' half-split rotary order -> llama.cpp's interleaved one (convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def shapes(s=SHAPE) -> dict[str, tuple[int, ...]]:
    """GGUF name -> [out, in] shape as transformers holds it."""
    hd = s["hidden"] // s["heads"]
    out = {"token_embd.weight": (s["vocab"], s["hidden"]), "output_norm.weight": (s["hidden"],),
           "output.weight": (s["vocab"], s["hidden"])}
    for i in range(s["layers"]):
        out |= {f"blk.{i}.attn_norm.weight": (s["hidden"],), f"blk.{i}.ffn_norm.weight": (s["hidden"],),
                f"blk.{i}.attn_q.weight": (s["heads"] * hd, s["hidden"]),
                f"blk.{i}.attn_k.weight": (s["kv_heads"] * hd, s["hidden"]),
                f"blk.{i}.attn_v.weight": (s["kv_heads"] * hd, s["hidden"]),
                f"blk.{i}.attn_output.weight": (s["hidden"], s["heads"] * hd),
                f"blk.{i}.ffn_gate.weight": (s["inter"], s["hidden"]),
                f"blk.{i}.ffn_up.weight": (s["inter"], s["hidden"]),
                f"blk.{i}.ffn_down.weight": (s["hidden"], s["inter"])}
    return out


def encode(w: np.ndarray, kind: str, rng) -> tuple[np.ndarray, object]:
    """(the array gguf's writer takes, its raw dtype) for float32 `w` stored as `kind`."""
    import gguf
    q = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    if kind in ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return gguf.quants.quantize(w.astype(np.float32), q), q
    block, size = gguf.GGML_QUANT_SIZES[q]
    raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    for off in K_SCALES.get(kind, ()):  # finite scales: random bytes could be inf or nan
        raw[:, :, off:off + 2] = np.frombuffer(np.float16(0.0005).tobytes(), np.uint8)
    return raw.reshape(w.shape[0], -1), q


def write_llama_gguf(path, *, types=None, arch="llama", tied=False, drop=(), extra=None, seed=0, s=SHAPE) -> Path:
    """A random Llama of shape `s` as a GGUF file. types: overrides of TYPE_PLAN; tied: no output.weight;
    drop: GGUF tensor names left out; extra: {name: (float32 array, kind)} added as they are."""
    import gguf
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(s["layers"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_vocab_size(s["vocab"])
    plan = {**TYPE_PLAN, **(types or {})}
    for name, shape in shapes(s).items():
        if name in drop or (tied and name == "output.weight"):
            continue
        a = (rng.standard_normal(shape) * (0.08 if len(shape) == 2 else 0.1) + (len(shape) == 1)).astype(np.float32)
        if ".attn_q." in name:
            a = permute(a, s["heads"])
        elif ".attn_k." in name:
            a = permute(a, s["kv_heads"])
        data, raw = encode(a, plan[name], rng)
        w.add_tensor(name, data, raw_dtype=raw)
    for name, (a, kind) in (extra or {}).items():
        data, raw = encode(a, kind, rng)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
