"""GPTQ checkpoints on disk: the quantization config, save and load (GPTQModel's v1 and v2 layouts).

For a linear of K inputs and N outputs at b bits (p = 32/b codes a word), group size G, n_g = K/G groups:
qweight int32 [K/p, N], qzeros int32 [n_g, N/p] (v1 stores zero-1, v2 the zero), scales fp16 [n_g, N],
g_idx int32 [K] (docs/formats.md). In memory the model keeps v2's zeros (`amdllm.model.quantized`):
v1's zero-1 cannot hold an asymmetric zero of 0, so files are converted once at load and save."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from safetensors.numpy import save as st_save

from amdllm.config import LlamaConfig
from amdllm.files import atomic_path, atomic_write_text
from amdllm.io.checks import check_finite, check_layer_count, keep_file_head
from amdllm.io.names import HF_PARENT, IGNORED_SUFFIXES, hf_proj
from amdllm.io.safetensors import CheckpointError, SafetensorsFile, aligned_empty, load_tensors
from amdllm.io.tokenizer import copy_tokenizer
from amdllm.model.llama import Llama, param_table
from amdllm.model.qmatmul import restore_gptq
from amdllm.io.transpose import transposed
from amdllm.model.quantized import (FORMAT_BITS, QUANT_KEYS, QuantFormatError, QuantLinear,  # noqa: F401
                                    check_bits, group_count, infer_bits, pack_cols, packed_logical_axes,
                                    unpack_cols)
from amdllm.parallel.sharding import activation_sharding, param_spec

PROJECTIONS = tuple(HF_PARENT)


# --------------------------------------------------------------------------------------------------
# safetensors: the shared reader (amdllm.io.safetensors), bf16/fp16/int32 all come back as numpy
# --------------------------------------------------------------------------------------------------
def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file, copied out of the map; a bad file is a QuantFormatError."""
    try:
        return load_tensors(path)
    except CheckpointError as e:
        raise QuantFormatError(str(e)) from None


def read_checkpoint_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of every *.safetensors file in `path` (any file names: AutoGPTQ wrote
    gptq_model-4bit-128g.safetensors), as read-only memory-mapped views: nothing is copied until used."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QuantFormatError(f"{path}: no *.safetensors files")
    tensors, where = {}, {}
    for f in files:
        try:
            st = SafetensorsFile(f)
        except CheckpointError as e:
            raise QuantFormatError(str(e)) from None
        for name in st.tensors:
            if name in where:  # a stray copy: neither file may silently win
                raise QuantFormatError(f"{path}: tensor {name} is in both {where[name]} and {f.name}; a "
                                       "checkpoint directory holds one copy of each tensor (remove the stray file)")
            where[name], tensors[name] = f.name, st.get(name)
    return tensors


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------
def quant_config_dict(bits, group_size, sym, desc_act, *, static_groups=False, damp_percent=0.01,
                      true_sequential=True, checkpoint_format=None, act_group_aware=False, mse=0.0) -> dict:
    fmt = checkpoint_format or ("gptq" if sym else "gptq_v2")  # asym zero 0 does not survive v1
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
            "sym": sym, "true_sequential": true_sequential, "damp_percent": damp_percent,
            "static_groups": static_groups, "lm_head": False, "checkpoint_format": fmt, "format": fmt,
            "meta": {"quantizer": ["amdllm"], "act_group_aware": act_group_aware,
                     "mse": mse}}  # GPTQModel's meta field: the grid search's norm, 0 for none


def is_quantized(path: Path, raw: dict) -> bool:
    """Does the checkpoint directory `path` (its config.json parsed as `raw`) hold a quantized model?"""
    return bool(raw.get("quantization_config")) or (path / "quantize_config.json").is_file()


def quant_config_of(path: Path) -> dict | None:
    """`read_quant_config` of a quantized checkpoint directory (checked), None for a dense one."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    return read_quant_config(path) if is_quantized(path, raw) else None


def read_quant_config(path: Path) -> dict:
    """quantization_config from config.json, else quantize_config.json; normalised keys, validated."""
    cfg_file, qc_file = path / "config.json", path / "quantize_config.json"
    qc = json.loads(cfg_file.read_text()).get("quantization_config") if cfg_file.exists() else None
    src = f"{cfg_file}: quantization_config"
    if qc is None and qc_file.exists():
        qc, src = json.loads(qc_file.read_text()), str(qc_file)
    if qc is None:
        raise QuantFormatError(f"{path}: no quantization_config in config.json and no quantize_config.json")
    if not isinstance(qc, dict):
        raise QuantFormatError(f"{src}: expected an object of settings, got {type(qc).__name__} {qc!r:.60}")
    method = qc.get("quant_method", "gptq")
    if method != "gptq":
        raise QuantFormatError(f"{src}: quant_method {method!r} is not supported (expected 'gptq'); quantize the "
                               "full-precision model with `amdllm quantize` (GPTQ) instead")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantFormatError(f"{src}: checkpoint_format {fmt!r} is unknown; expected 'gptq' or 'gptq_v2'")
    bits = qc.get("bits")
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise QuantFormatError(f"{src}: bits must be an integer, got {bits!r}")
    check_bits(bits, f"{src}: bits")
    group_size = qc.get("group_size", -1)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise QuantFormatError(f"{src}: group_size must be -1 or a positive integer, got {group_size!r}")
    for k, default in (("sym", True), ("desc_act", False)):
        if not isinstance(qc.get(k, default), bool):
            raise QuantFormatError(f"{src}: {k} must be true or false, got {qc[k]!r}")
    return {"bits": bits, "group_size": group_size, "format": fmt,
            "sym": qc.get("sym", True), "desc_act": qc.get("desc_act", False), "raw": qc}


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------
def _zeros_v1_to_v2(qzeros, bits, inverse=False):
    z = unpack_cols(np.asarray(qzeros), bits)
    z = (z - 1 if inverse else z + 1) & (2 ** bits - 1)  # nibble-wise, no carry into the neighbour
    return pack_cols(z, bits)


def save_quantized(model, path, quant_config: dict, *, tokenizer_from=None) -> Path:
    """Write `model` (projections QuantLinear) as a GPTQ checkpoint (HF names; non-quantized tensors fp16,
    or bf16 for a bf16 model)."""
    path = Path(path)
    cfg: LlamaConfig = model.cfg
    fmt, bits = quant_config["checkpoint_format"], quant_config["bits"]
    # to numpy first (no copy on the CPU): indexing the JAX arrays per layer compiled a slice per shape
    layers = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model.layers)))
    t = {"model.embed_tokens.weight": np.asarray(model.embed_tokens[...]),
         "model.norm.weight": np.asarray(model.norm[...])}
    if hasattr(model, "lm_head"):
        t["lm_head.weight"] = transposed(np.asarray(model.lm_head[...]))  # ours [D, V] -> HF [V, D]
    for i in range(cfg.num_hidden_layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = layers["input_layernorm"][i]
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = layers["post_attention_layernorm"][i]
        for proj in PROJECTIONS:
            v = layers[proj]
            if not isinstance(v, dict):
                t[hf_proj(i, proj) + ".weight"] = transposed(v[i])
                continue
            q = restore_gptq({k: a[i] for k, a in v.items()})  # as loaded, if prepared for a fused kernel
            qz = np.asarray(q["qzeros"])
            t[hf_proj(i, proj) + ".qweight"] = np.asarray(q["qweight"], np.int32)
            t[hf_proj(i, proj) + ".qzeros"] = _zeros_v1_to_v2(qz, bits, inverse=True) if fmt == "gptq" else qz
            t[hf_proj(i, proj) + ".scales"] = np.asarray(q["scales"], np.float16)
            t[hf_proj(i, proj) + ".g_idx"] = np.asarray(q["g_idx"], np.int32)
    # unquantized tensors: float16, as GPTQ checkpoints store them, except a bfloat16 model's, which keep
    # their dtype (as GPTQModel keeps the source's): bf16 values beyond float16's range would become inf
    store = np.dtype(ml_dtypes.bfloat16) if np.asarray(t["model.embed_tokens.weight"]).dtype == ml_dtypes.bfloat16 \
        else np.dtype(np.float16)
    # C order: astype keeps a transposed view's Fortran layout, and safetensors writes memory order
    # (jnp.issubdtype: bfloat16 is a float too, though numpy files it under kind "V")
    t = {k: np.ascontiguousarray(np.asarray(v).astype(store) if jnp.issubdtype(np.asarray(v).dtype, jnp.floating)
                                 and not k.endswith("scales") else v) for k, v in t.items()}
    path.mkdir(parents=True, exist_ok=True)
    with atomic_path(path / "model.safetensors") as tmp:
        tmp.write_bytes(st_save(t, metadata={"format": "pt"}))
    hf = cfg.to_dict()
    hf["torch_dtype"] = hf["dtype"] = store.name
    hf["quantization_config"] = quant_config
    atomic_write_text(path / "config.json", json.dumps(hf, indent=2))
    atomic_write_text(path / "quantize_config.json", json.dumps(quant_config, indent=2))
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, path, required=False)
    return path


# --------------------------------------------------------------------------------------------------
# Load (ours, GPTQModel/AutoGPTQ v1 and v2) -- also reads plain dense HF Llama directories
# --------------------------------------------------------------------------------------------------
def _get(t, name, shape, path, codes: bool = False):
    """Tensor `name`, checked as the dense loader checks: its shape, and its dtype (integer `codes`, or
    floats that hold no NaN or infinity). A float qweight or g_idx is refused, never cast."""
    if name not in t:
        raise QuantFormatError(f"{path}: tensor {name} is missing")
    a = t[name]
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise QuantFormatError(f"{path}: tensor {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if codes and a.dtype.kind not in "iu":
        raise QuantFormatError(f"{path}: tensor {name} is {a.dtype}, expected integers (int32)")
    if not codes:
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise QuantFormatError(f"{path}: tensor {name} is {a.dtype}, expected floating point")
        check_finite(a, path, name, QuantFormatError)
    return a


def _expected_names(t, cfg: LlamaConfig) -> set[str]:
    """Every tensor name the config asks for (a projection packed or dense, as the file holds it)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not cfg.tie_word_embeddings
                                                                 else set())
    for i in range(cfg.num_hidden_layers):
        names |= {f"model.layers.{i}.{nm}.weight" for nm in ("input_layernorm", "post_attention_layernorm")}
        for proj in PROJECTIONS:
            base = hf_proj(i, proj)
            names |= ({f"{base}.{k}" for k in QUANT_KEYS} if f"{base}.qweight" in t else {f"{base}.weight"})
    return names


def _load_quant_proj(t, name, K, N, qc, path):
    bits, G = qc["bits"], qc["group_size"]
    p = 32 // bits
    if K % p or N % p:
        raise QuantFormatError(f"{path}: {name} has in/out features {K}/{N}, not multiples of {p} at {bits} bits")
    qw = t.get(name + ".qweight")
    if qw is not None and qw.dtype.kind in "iu" and infer_bits(qw.shape[0], K, f"{path}: {name}.qweight") != bits:
        raise QuantFormatError(f"{path}: {name}.qweight shape {qw.shape} implies "
                               f"{32 * qw.shape[0] // K} bits but the quantization config says bits={bits}")
    g = _get(t, name + ".g_idx", (K,), path, codes=True).astype(np.int32)
    ng = group_count(K, G)
    if G not in (-1, 0) and K % G:
        raise QuantFormatError(f"{path}: {name}: group_size {G} does not divide in_features {K}")
    if g.min() < 0 or g.max() >= ng:
        raise QuantFormatError(f"{path}: {name}.g_idx has values in [{g.min()}, {g.max()}], expected [0, {ng})")
    qw = _get(t, name + ".qweight", (K // p, N), path, codes=True)  # a view of the file: read block by block at placement
    qw = qw if qw.dtype == np.int32 else qw.astype(np.int32)
    qz = _get(t, name + ".qzeros", (ng, N // p), path, codes=True).astype(np.int32)
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

    dtype: for the non-quantized tensors; compute_dtype: the activations' (default: dtype). With `mesh` (+
    `rules`) every tensor is split as the rules say, the packed ones too (`sharding.PACKED_GROUPED`), each
    device's block of `qweight` read straight from the memory-mapped files; on one device each tensor is
    written once into the buffer that becomes the device array. `shardings` is accepted and ignored."""
    path = Path(path)
    cfg = LlamaConfig.from_json(path)
    qc = quant_config_of(path)
    t = read_checkpoint_tensors(path)
    # names first, as the dense loader: the layer count, the head, and nothing the config does not name
    check_layer_count(t, cfg.num_hidden_layers, path, QuantFormatError)
    cfg = keep_file_head(cfg, t, path)
    expected = _expected_names(t, cfg)
    unexpected = sorted(n for n in t if n not in expected and not n.endswith(IGNORED_SUFFIXES)
                        and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
    if unexpected:
        raise QuantFormatError(f"{path}: unexpected tensors (not in config.json's model): "
                               f"{', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    model = Llama.abstract(cfg, param_dtype=dtype, dtype=compute_dtype or dtype, remat=remat)
    table = param_table(cfg)
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    if mesh is not None:
        model.act_sharding = activation_sharding(mesh, rules)  # activations split by batch

    def place(name, per_layer, axes, dtype=None, stacked=True):
        """Host arrays (views of the file, one per layer) -> one stacked [L, ...] jax array, or with
        stacked=False the single array, cast to `dtype` if given. On a mesh each device's block is built from
        the views alone; on one device the result is written once into an aligned buffer that becomes the
        device array (on a CPU without a second copy)."""
        dtype = np.dtype(dtype or per_layer[0].dtype)
        shape = ((len(per_layer),) if stacked else ()) + tuple(per_layer[0].shape)
        if mesh is None:
            out = aligned_empty(shape, dtype)
            for i, a in enumerate(per_layer):
                out[i if stacked else ...] = a
            return jax.device_put(out, may_alias=True)
        block = ((lambda idx: np.stack([per_layer[i][idx[1:]] for i in range(shape[0])[idx[0]]]).astype(dtype))
                 if stacked else (lambda idx: per_layer[0][idx].astype(dtype)))
        return jax.make_array_from_callback(shape, NamedSharding(mesh, param_spec(name, axes, rules, shape=shape,
                                                                                   mesh=mesh)), block)

    def put_param(owner, attr, name, arr, axes):
        setattr(owner, attr, nnx.Param(place(name, [np.asarray(arr)], axes, jnp.dtype(dtype), stacked=False),
                                       axes=axes))

    put_param(model, "embed_tokens", "embed_tokens", _get(t, "model.embed_tokens.weight", (V, D), path),
              table["embed_tokens"][1])
    put_param(model, "norm", "norm", _get(t, "model.norm.weight", (D,), path), table["norm"][1])
    if "lm_head" in table:
        put_param(model, "lm_head", "lm_head", transposed(_get(t, "lm_head.weight", (V, D), path)),
                  table["lm_head"][1])
    for nm in ("input_layernorm", "post_attention_layernorm"):
        rows = [_get(t, f"model.layers.{i}.{nm}.weight", (D,), path) for i in range(L)]
        put_param(model.layers, nm, "layers/" + nm, np.stack(rows), table["layers/" + nm][1])
    for proj in PROJECTIONS:
        (_, K, N), axes = table["layers/" + proj]
        kinds = {i: (hf_proj(i, proj) + ".qweight") in t for i in range(L)}
        if len(set(kinds.values())) > 1:
            raise QuantFormatError(f"{path}: {proj} is quantized in some layers and dense in others "
                                   f"(quantized in layers {[i for i, k in kinds.items() if k]})")
        if kinds[0]:
            if qc is None:
                raise QuantFormatError(f"{path}: {hf_proj(0, proj)}.qweight present but config.json has no "
                                       "quantization_config")
            per = [_load_quant_proj(t, hf_proj(i, proj), K, N, qc, path) for i in range(L)]
            packed_axes = packed_logical_axes(axes)
            stk = {k: place(f"layers/{proj}/{k}", [d[k] for d in per], packed_axes[k]) for k in QUANT_KEYS}
            setattr(model.layers, proj, QuantLinear(**stk, axes=packed_axes))
        else:
            rows = [transposed(_get(t, hf_proj(i, proj) + ".weight", (N, K), path)) for i in range(L)]
            put_param(model.layers, proj, "layers/" + proj, np.stack(rows), axes)
    return model
