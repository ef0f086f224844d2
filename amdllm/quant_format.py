"""GPTQ on disk and on the device: int32 packing, the quantized matmul, checkpoint save/load.

The format (GPTQ-for-LLaMa / AutoGPTQ / GPTQModel / transformers, docs/formats.md), for a
linear with in_features K, out_features N, `bits` b, pack factor p = 32/b, group size G (-1 means K),
n_g = K/G:
    qweight int32 [K/p, N]    codes packed along K, lowest k in the lowest bits
    qzeros  int32 [n_g, N/p]  zero points packed along N; v1 ("gptq") stores zero-1, v2 ("gptq_v2") zero
    scales  fp16  [n_g, N]
    g_idx   int32 [K]         group of each input row (k // G unless act-order)
    W^T[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])

In memory (the dict a quantized projection holds in `model.layers`) we always keep the *v2* convention
(the real zero point): v1's zero-1 cannot represent an asymmetric zero of 0 without wrapping (the
"-1 overflow" of AutoGPTQ PR #640), so we convert once at load/save time, nibble by nibble.
Supported here: 2, 4 and 8 bits (3-bit's 10-1-10-1-10 packing is not implemented).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from amdllm.config import LlamaConfig
from amdllm.io import atomic_path, atomic_write_text
from amdllm.safetensors_io import CheckpointError, load_tensors

FORMAT_BITS = (2, 4, 8)
QUANT_KEYS = ("qweight", "qzeros", "scales", "g_idx")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json", "chat_template.jinja")


class QuantFormatError(ValueError):
    """A GPTQ checkpoint or packed tensor that does not match the format."""


class QuantTensor(nnx.Variable):
    """Packed GPTQ data: not an nnx.Param, so LoRA filters and parameter counts treat it as frozen."""


class QuantLinear(nnx.Module):
    """A stacked quantized projection: qweight [L,K/p,N], qzeros [L,n_g,N/p], scales [L,n_g,N], g_idx [L,K]."""

    def __init__(self, qweight, qzeros, scales, g_idx):
        self.qweight, self.qzeros = QuantTensor(qweight), QuantTensor(qzeros)
        self.scales, self.g_idx = QuantTensor(scales), QuantTensor(g_idx)


# --------------------------------------------------------------------------------------------------
# Packing (numpy for writing; the unpacking used at run time is in jnp and works on both)
# --------------------------------------------------------------------------------------------------
def _check_bits(bits: int, what: str = "bits") -> int:
    if bits not in FORMAT_BITS:
        raise QuantFormatError(f"{what}={bits} is not supported by the packed format; expected one of "
                               f"{FORMAT_BITS} (3-bit packing is not implemented)")
    return 32 // bits


def pack_rows(codes, bits: int) -> np.ndarray:
    """codes [K, N] ints in [0, 2^bits) -> int32 [K*bits/32, N], packed along K (qweight)."""
    p = _check_bits(bits)
    c = np.asarray(codes).astype(np.uint32)
    if c.shape[0] % p:
        raise QuantFormatError(f"cannot pack {c.shape[0]} rows at {bits} bits: need a multiple of {p}")
    c = c.reshape(c.shape[0] // p, p, c.shape[1]) & np.uint32(2 ** bits - 1)
    shifts = (np.arange(p, dtype=np.uint32) * bits)[None, :, None]
    return np.bitwise_or.reduce(c << shifts, axis=1).view(np.int32)


def pack_cols(codes, bits: int) -> np.ndarray:
    """codes [G, N] -> int32 [G, N*bits/32], packed along N (qzeros)."""
    return pack_rows(np.asarray(codes).T, bits).T.copy()


def unpack_rows(packed, bits: int):
    """int32 [K/p, N] -> int32 codes [K, N] (arithmetic shifts are fine because we mask).

    numpy in, numpy out (saving, converting: eager jnp would compile a kernel per shape); otherwise jnp
    (inside the jitted dequantization)."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    p = 32 // bits
    shifts = (xp.arange(p, dtype=xp.int32) * bits)[None, :, None]
    c = xp.right_shift(xp.asarray(packed)[:, None, :], shifts) & (2 ** bits - 1)  # [K/p, p, N]
    return c.reshape(-1, c.shape[-1])


def unpack_cols(packed, bits: int):
    """int32 [G, N/p] -> codes [G, N]."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    return unpack_rows(xp.asarray(packed).T, bits).T


def infer_bits(qweight_rows: int, in_features: int, where: str = "qweight") -> int:
    """bits = 32 * qweight.shape[0] / K, checked."""
    bits, rem = divmod(32 * qweight_rows, in_features)
    if rem or bits not in FORMAT_BITS:
        raise QuantFormatError(f"{where}: {qweight_rows} packed rows for in_features={in_features} "
                               f"gives {32 * qweight_rows / in_features:g} bits; expected one of {FORMAT_BITS}")
    return bits


# --------------------------------------------------------------------------------------------------
# Quantized linear: everything below runs inside the caller's jit, so the int32 words stay on device
# --------------------------------------------------------------------------------------------------
def dequantize(q: dict, dtype=jnp.float32):
    """One layer's {qweight, qzeros (v2), scales, g_idx} -> dense kernel [K, N] in `dtype`."""
    K = q["g_idx"].shape[-1]
    bits = infer_bits(q["qweight"].shape[0], K)
    codes = unpack_rows(q["qweight"], bits)                 # [K, N] int32
    zeros = unpack_cols(q["qzeros"], bits)                  # [n_g, N] int32
    g = q["g_idx"]                                          # [K]: act-order makes this a gather
    scales = jnp.asarray(q["scales"]).astype(dtype)
    return ((codes - zeros[g]).astype(dtype) * scales[g])   # [K, N]


def quantized_matmul(x2d, q: dict, dtype=jnp.float32):
    """x2d [M, K] @ dequant(q) [K, N] -> [M, N]. Dequantizes per group on the fly (XLA fuses it)."""
    return jnp.dot(x2d.astype(dtype), dequantize(q, dtype))


# --------------------------------------------------------------------------------------------------
# safetensors: the shared reader (amdllm.safetensors_io), bf16/fp16/int32 all come back as numpy
# --------------------------------------------------------------------------------------------------
def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file, copied out of the map; a bad file is a QuantFormatError."""
    try:
        return load_tensors(path)
    except CheckpointError as e:
        raise QuantFormatError(str(e)) from None


def read_checkpoint_tensors(path: Path) -> dict[str, np.ndarray]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QuantFormatError(f"{path}: no *.safetensors files")
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors


def _hf(i, proj):
    return f"model.layers.{i}.{'self_attn' if proj in ATTN else 'mlp'}.{proj}"


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------
def quant_config_dict(bits, group_size, sym, desc_act, *, static_groups=False, damp_percent=0.01,
                      true_sequential=True, checkpoint_format=None) -> dict:
    fmt = checkpoint_format or ("gptq" if sym else "gptq_v2")  # asym zero 0 does not survive v1
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
            "sym": sym, "true_sequential": true_sequential, "damp_percent": damp_percent,
            "static_groups": static_groups, "lm_head": False, "checkpoint_format": fmt, "format": fmt,
            "meta": {"quantizer": ["amdllm"]}}


def read_quant_config(path: Path) -> dict:
    """quantization_config from config.json, else quantize_config.json; normalised keys, validated."""
    cfg_file, qc_file = path / "config.json", path / "quantize_config.json"
    qc = json.loads(cfg_file.read_text()).get("quantization_config") if cfg_file.exists() else None
    src = f"{cfg_file}: quantization_config"
    if qc is None and qc_file.exists():
        qc, src = json.loads(qc_file.read_text()), str(qc_file)
    if qc is None:
        raise QuantFormatError(f"{path}: no quantization_config in config.json and no quantize_config.json")
    method = qc.get("quant_method", "gptq")
    if method != "gptq":
        raise QuantFormatError(f"{src}: quant_method {method!r} is not supported (expected 'gptq')")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantFormatError(f"{src}: checkpoint_format {fmt!r} is unknown; expected 'gptq' or 'gptq_v2'")
    bits = qc.get("bits")
    _check_bits(bits, f"{src}: bits")
    return {"bits": bits, "group_size": qc.get("group_size", -1), "format": fmt,
            "sym": qc.get("sym", True), "desc_act": qc.get("desc_act", False), "raw": qc}


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------
def _zeros_v1_to_v2(qzeros, bits, inverse=False):
    z = unpack_cols(np.asarray(qzeros), bits)
    z = (z - 1 if inverse else z + 1) & (2 ** bits - 1)  # nibble-wise, no carry into the neighbour
    return pack_cols(z, bits)


def save_quantized(model, path, quant_config: dict, *, tokenizer_from=None) -> Path:
    """Write `model` (projections QuantLinear) as a GPTQ checkpoint (HF names, fp16 non-quantized)."""
    from safetensors.numpy import save

    path = Path(path)
    cfg: LlamaConfig = model.cfg
    fmt, bits = quant_config["checkpoint_format"], quant_config["bits"]
    # to numpy first (no copy on the CPU): indexing the JAX arrays per layer compiled a slice per shape
    layers = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.layers)))
    t = {"model.embed_tokens.weight": np.asarray(model.embed_tokens[...]),
         "model.norm.weight": np.asarray(model.norm[...])}
    if hasattr(model, "lm_head"):
        t["lm_head.weight"] = np.asarray(model.lm_head[...]).T  # ours [D, V] -> HF [V, D]
    for i in range(cfg.num_hidden_layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = layers["input_layernorm"][i]
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = layers["post_attention_layernorm"][i]
        for proj in ATTN + MLP:
            v = layers[proj]
            if not isinstance(v, dict):
                t[_hf(i, proj) + ".weight"] = v[i].T
                continue
            qz = np.asarray(v["qzeros"][i])
            t[_hf(i, proj) + ".qweight"] = np.asarray(v["qweight"][i], np.int32)
            t[_hf(i, proj) + ".qzeros"] = _zeros_v1_to_v2(qz, bits, inverse=True) if fmt == "gptq" else qz
            t[_hf(i, proj) + ".scales"] = np.asarray(v["scales"][i], np.float16)
            t[_hf(i, proj) + ".g_idx"] = np.asarray(v["g_idx"][i], np.int32)
    # C order: astype keeps a transposed view's Fortran layout, and safetensors writes memory order
    # (jnp.issubdtype: bfloat16 is a float too, though numpy files it under kind "V")
    t = {k: np.ascontiguousarray(np.asarray(v).astype(np.float16) if jnp.issubdtype(np.asarray(v).dtype, jnp.floating)
                                 and not k.endswith("scales") else v) for k, v in t.items()}
    path.mkdir(parents=True, exist_ok=True)
    with atomic_path(path / "model.safetensors") as tmp:
        tmp.write_bytes(save(t, metadata={"format": "pt"}))
    hf = cfg.to_dict()
    hf["torch_dtype"] = hf["dtype"] = "float16"
    hf["quantization_config"] = quant_config
    atomic_write_text(path / "config.json", json.dumps(hf, indent=2))
    atomic_write_text(path / "quantize_config.json", json.dumps(quant_config, indent=2))
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).exists():
                with atomic_path(path / name) as tmp:
                    shutil.copyfile(Path(tokenizer_from) / name, tmp)
    return path


# --------------------------------------------------------------------------------------------------
# Load (ours, GPTQModel/AutoGPTQ v1 and v2) -- also reads plain dense HF Llama directories
# --------------------------------------------------------------------------------------------------
def _get(t, name, shape, path):
    if name not in t:
        raise QuantFormatError(f"{path}: tensor {name} is missing")
    a = t[name]
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise QuantFormatError(f"{path}: tensor {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def _load_quant_proj(t, name, K, N, qc, path):
    bits, G = qc["bits"], qc["group_size"]
    p = 32 // bits
    if K % p or N % p:
        raise QuantFormatError(f"{path}: {name} has in/out features {K}/{N}, not multiples of {p} at {bits} bits")
    qw = t.get(name + ".qweight")
    if qw is not None and infer_bits(qw.shape[0], K, f"{path}: {name}.qweight") != bits:
        raise QuantFormatError(f"{path}: {name}.qweight shape {qw.shape} implies "
                               f"{32 * qw.shape[0] // K} bits but the quantization config says bits={bits}")
    g = _get(t, name + ".g_idx", (K,), path).astype(np.int32)
    ng = K // G if G not in (-1, 0) and G < K else 1
    if G not in (-1, 0) and K % G:
        raise QuantFormatError(f"{path}: {name}: group_size {G} does not divide in_features {K}")
    if g.min() < 0 or g.max() >= ng:
        raise QuantFormatError(f"{path}: {name}.g_idx has values in [{g.min()}, {g.max()}], expected [0, {ng})")
    qw = _get(t, name + ".qweight", (K // p, N), path).astype(np.int32)
    qz = _get(t, name + ".qzeros", (ng, N // p), path).astype(np.int32)
    sc = _get(t, name + ".scales", (ng, N), path).astype(np.float16)
    if qc["format"] == "gptq":
        z = unpack_cols(np.asarray(qz), bits)
        if qc["sym"] and np.all(z == 2 ** (bits - 1)):  # v2 zeros labelled "gptq" (vLLM PR #38966)
            warnings.warn(f"{path}: {name}.qzeros hold symmetric v2 zeros ({2 ** (bits - 1)}) but the "
                          "checkpoint says 'gptq' (v1, which stores zero-1); reading them as v2", stacklevel=3)
        else:
            qz = _zeros_v1_to_v2(qz, bits)
    return {"qweight": qw, "qzeros": qz, "scales": sc, "g_idx": g}


def load_quantized(path, *, dtype=jnp.float32, compute_dtype=None, mesh=None, rules=None,
                   shardings=None, remat: bool = False, **_ignored):
    """A GPTQ (or dense) HF Llama directory -> `Llama` with QuantLinear projections (packed, on device).

    dtype: for the non-quantized tensors (embeddings, norms, lm_head, dense projections);
    compute_dtype: the activations' dtype (default: dtype). Sharding arguments are accepted for
    checkpoint.load's signature; quantized weights are placed on the default device.
    """
    from amdllm.model import Llama, param_table

    path = Path(path)
    cfg = LlamaConfig.from_json(path)
    raw = json.loads((path / "config.json").read_text())
    quantized = "quantization_config" in raw or (path / "quantize_config.json").exists()
    qc = read_quant_config(path) if quantized else None
    t = read_checkpoint_tensors(path)
    model = Llama.abstract(cfg, param_dtype=dtype, dtype=compute_dtype or dtype, remat=remat)
    table = param_table(cfg)
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size

    def put(owner, attr, arr, axes):
        setattr(owner, attr, nnx.Param(jnp.asarray(arr, dtype), axes=axes))

    put(model, "embed_tokens", _get(t, "model.embed_tokens.weight", (V, D), path), table["embed_tokens"][1])
    put(model, "norm", _get(t, "model.norm.weight", (D,), path), table["norm"][1])
    if "lm_head" in table:
        put(model, "lm_head", _get(t, "lm_head.weight", (V, D), path).T, table["lm_head"][1])
    for nm in ("input_layernorm", "post_attention_layernorm"):
        rows = [_get(t, f"model.layers.{i}.{nm}.weight", (D,), path) for i in range(L)]
        put(model.layers, nm, np.stack(rows), table["layers/" + nm][1])
    for proj in ATTN + MLP:
        (_, K, N), axes = table["layers/" + proj]
        kinds = {i: (_hf(i, proj) + ".qweight") in t for i in range(L)}
        if len(set(kinds.values())) > 1:
            raise QuantFormatError(f"{path}: {proj} is quantized in some layers and dense in others "
                                   f"(quantized in layers {[i for i, k in kinds.items() if k]})")
        if kinds[0]:
            if qc is None:
                raise QuantFormatError(f"{path}: {_hf(0, proj)}.qweight present but config.json has no "
                                       "quantization_config")
            per = [_load_quant_proj(t, _hf(i, proj), K, N, qc, path) for i in range(L)]
            stk = {k: jnp.asarray(np.stack([d[k] for d in per])) for k in QUANT_KEYS}
            setattr(model.layers, proj, QuantLinear(**stk))
        else:
            rows = [_get(t, _hf(i, proj) + ".weight", (N, K), path).T for i in range(L)]
            put(model.layers, proj, np.stack(rows), axes)
    return model
