"""Mesh sharding, MaxText style: one code path from 8 simulated CPU devices to 8x MI300X to many hosts.

  * A mesh with three named axes, in this order: `data`, `fsdp` (parameters split, gathered per matmul)
    and `tensor` (heads and MLP columns split), written as a spec: "fsdp=8", "data=2,fsdp=4", "auto".
  * Logical axis names on every parameter (`amdllm.model.param_table`), mapped to mesh axes by one
    rules table per strategy: changing strategy changes the table, never the model.
Indivisible dimensions are an error unless `strict=False` (replicated, with a warning); packed GPTQ
tensors carry their kernel's axes (`PACKED_GROUPED`)."""
from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from amdllm.config import LlamaConfig
from amdllm.model import param_table

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # batches are split over every axis that holds whole copies of the math

_COMMON = {"batch": BATCH, "length": None, "act_embed": None, "layers": None, "norm": None,
           "head_dim": None, "lora_rank": None}
RULES: dict[str, dict[str, Any]] = {
    # Felafax's 405B run: every matrix split along its model (embed) dimension over fsdp.
    "fsdp": {**_COMMON, "vocab": None, "embed": "fsdp", "heads": None, "kv_heads": None, "mlp": None},
    # Megatron-style tensor parallel: heads and MLP columns split; embeddings split by vocabulary.
    "tp": {**_COMMON, "vocab": "tensor", "embed": None, "heads": "tensor", "kv_heads": "tensor",
           "mlp": "tensor"},
    # both: fsdp on the model dimension, tensor on heads/MLP/vocab (the default: on a mesh without a
    # tensor axis it *is* fsdp, without fsdp it *is* tp, on data=N it is data parallel).
    "fsdp_tp": {**_COMMON, "vocab": "tensor", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
                "mlp": "tensor"},
    # data parallel: every device holds everything; only the batch is split.
    "dp": {**_COMMON, "vocab": None, "embed": None, "heads": None, "kv_heads": None, "mlp": None},
}
DEFAULT_RULES = "fsdp_tp"


class ShardingError(ValueError):
    """A mesh or rules table that cannot work; the message says which axis/parameter and what would."""


# --------------------------------------------------------------------------------------------------
# Meshes
# --------------------------------------------------------------------------------------------------
def parse_mesh_spec(spec: str | Mapping[str, int] | None, n_devices: int) -> dict[str, int]:
    """"data=2,fsdp=4" -> {"data": 2, "fsdp": 4, "tensor": 1}. One axis may be -1 ("the rest")."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return {"data": 1, "fsdp": n_devices, "tensor": 1}
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        items = []
        for part in spec.split(","):
            if "=" not in part:
                raise ShardingError(f"mesh spec {spec!r}: {part.strip()!r} is not axis=size "
                                    f"(examples: 'fsdp=8', 'data=2,fsdp=4', 'auto')")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    shape: dict[str, int] = {}
    for k, v in items:
        if k not in MESH_AXES:
            raise ShardingError(f"mesh spec {spec!r}: unknown mesh axis {k!r}; known axes: {', '.join(MESH_AXES)}")
        if k in shape:
            raise ShardingError(f"mesh spec {spec!r}: axis {k!r} given twice")
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ShardingError(f"mesh spec {spec!r}: size of {k!r} must be an integer, got {v!r}") from None
        if n == 0 or n < -1:
            raise ShardingError(f"mesh spec {spec!r}: size of {k!r} must be >= 1 (or -1 for the rest), got {n}")
        shape[k] = n
    fill = [k for k, n in shape.items() if n == -1]
    if len(fill) > 1:
        raise ShardingError(f"mesh spec {spec!r}: only one axis may be -1")
    known = math.prod(n for n in shape.values() if n != -1)
    if fill:
        if n_devices % known:
            raise ShardingError(f"mesh spec {spec!r}: the fixed axes use {known} devices, which does not "
                                f"divide the {n_devices} devices present")
        shape[fill[0]] = n_devices // known
    total = math.prod(shape.values())
    if total > n_devices:
        raise ShardingError(f"mesh spec {spec!r} asks for {total} devices but only {n_devices} are present; "
                            f"make the sizes multiply to {n_devices} (e.g. 'fsdp={n_devices}')")
    if n_devices % total:
        raise ShardingError(f"mesh spec {spec!r} uses {total} devices, which does not divide the "
                            f"{n_devices} devices present; use sizes whose product divides {n_devices}")
    return {a: shape.get(a, 1) for a in MESH_AXES}


def mesh_devices(n: int, accelerators=None) -> tuple[list, str]:
    """n devices for a mesh, and one line saying which: the first n of `accelerators` (default: JAX's
    devices) where there are that many, else n of the CPU devices JAX simulates beside them (the
    `jax_num_cpu_devices` setting, made before the first computation)."""
    acc = list(jax.devices() if accelerators is None else accelerators)
    if len(acc) >= n:
        return acc[:n], f"{n} devices: {acc[0].platform} ({acc[0].device_kind})"
    cpu = jax.devices("cpu")
    if len(cpu) < n:
        raise ShardingError(f"a mesh of {n} devices, with {len(acc)} {acc[0].platform} device(s) and {len(cpu)} "
                            f"CPU devices: set jax.config.update('jax_num_cpu_devices', {n}) before the first "
                            "computation")
    return cpu[:n], (f"only {len(acc)} {acc[0].platform} device(s) here: the meshes use {n} simulated CPU "
                     "devices instead")


def make_mesh(spec: str | Mapping[str, int] | None = "auto", *, devices=None, cfg=None, rules=None) -> Mesh:
    """A `Mesh` with axes (data, fsdp, tensor). With `cfg`, also checks the model splits evenly.

    A spec that uses fewer devices than present (e.g. fsdp=4 of 8) takes the first ones; that is
    only allowed in a single process, where it is handy for experiments.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = parse_mesh_spec(spec, len(devices))
    total = math.prod(shape.values())
    if total < len(devices):
        if jax.process_count() > 1:
            raise ShardingError(f"mesh spec {spec!r} uses {total} of {len(devices)} devices; with several "
                                f"processes the mesh must use all of them")
        devices = devices[:total]
    dims = tuple(shape[a] for a in MESH_AXES)
    try:  # topology-aware order on real accelerators (keeps fsdp/tensor inside fast links)
            grid = mesh_utils.create_device_mesh(dims, devices)
    except Exception:  # noqa: BLE001 - CPU and odd subsets: plain order is fine
        grid = np.array(devices, dtype=object).reshape(dims)
    mesh = Mesh(grid, MESH_AXES)
    if cfg is not None:
        check_model_fits_mesh(cfg, shape, rules)
    return mesh


def mesh_shape(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh) else {a: int(mesh.get(a, 1)) for a in MESH_AXES}


# --------------------------------------------------------------------------------------------------
# Rules: logical axes -> mesh axes
# --------------------------------------------------------------------------------------------------
def get_rules(rules: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A rules table by preset name ("fsdp", "tp", "fsdp_tp", "dp") or as a dict; checked."""
    if rules is None:
        rules = DEFAULT_RULES
    if isinstance(rules, str):
        if rules not in RULES:
            raise ShardingError(f"unknown rules preset {rules!r}; presets: {', '.join(RULES)}")
        rules = RULES[rules]
    out = {}
    for logical, target in dict(rules).items():
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        for a in axes:
            if a not in MESH_AXES:
                raise ShardingError(f"rules map logical axis {logical!r} to unknown mesh axis {a!r}; "
                                    f"mesh axes are {', '.join(MESH_AXES)}")
        out[logical] = axes
    return out


PACKED_GROUPED = ("qzeros", "scales")  # GPTQ tensors [layers, groups, out]: groups may be too few to split


def logical_to_spec(axes, rules=None, *, shape=None, mesh=None, strict: bool = True, name: str = "array",
                    warn: bool = True) -> P:
    """Logical axis names (+ optional shape and mesh for divisibility checks) -> PartitionSpec.
    strict=False replicates a dimension that does not split (warning about it unless warn=False)."""
    rules = get_rules(rules)
    sizes = None if mesh is None else mesh_shape(mesh)
    used: set[str] = set()
    spec = []
    for i, logical in enumerate(axes):
        if logical not in rules:
            raise ShardingError(f"{name}: logical axis {logical!r} has no entry in the rules table "
                                f"(known: {', '.join(sorted(rules))}); add it, e.g. {logical!r}: None to replicate")
        targets = tuple(a for a in rules[logical] if sizes is None or sizes[a] > 1)
        for a in targets:
            if a in used:
                raise ShardingError(f"{name}: mesh axis {a!r} is used by two dimensions of axes {tuple(axes)}")
        if targets and shape is not None and sizes is not None:
            ways = math.prod(sizes[a] for a in targets)
            if shape[i] % ways:
                msg = (f"{name}: dimension {i} ({logical!r}, size {shape[i]}) does not split over mesh axes "
                       f"{'x'.join(f'{a}={sizes[a]}' for a in targets)}")
                if strict:
                    raise ShardingError(msg + f"; use a mesh whose {'x'.join(targets)} divides {shape[i]}, "
                                              f"map {logical!r} to None in the rules, or strict=False to replicate it")
                if warn:
                    warnings.warn(msg + "; replicating that dimension", stacklevel=3)
                targets = ()
        used.update(targets)
        spec.append(None if not targets else (targets[0] if len(targets) == 1 else targets))
    while spec and spec[-1] is None:  # P('fsdp', None) == P('fsdp'); keep the canonical short form
        spec.pop()
    return P(*spec)


def param_spec(name: str, axes, rules=None, *, shape=None, mesh=None, strict: bool = True) -> P:
    """`logical_to_spec` for the parameter `name`: a packed GPTQ tensor's group axis (`PACKED_GROUPED`) is
    replicated, without a warning, where its group count does not split."""
    grouped = name.rsplit("/", 1)[-1] in PACKED_GROUPED
    return logical_to_spec(axes, rules, shape=shape, mesh=mesh, strict=strict and not grouped, warn=not grouped,
                           name=name)


def _iter_params(model_or_cfg):
    """Yield (our_name, shape, dtype, logical axes or None) for every parameter (arrays or abstract)."""
    if isinstance(model_or_cfg, LlamaConfig):
        for name, (shape, axes) in param_table(model_or_cfg).items():
            yield name, tuple(shape), np.dtype("float32"), axes
        return
    for path, var in nnx.to_flat_state(nnx.state(model_or_cfg)):  # Params, LoRA, packed GPTQ tensors
        name = "/".join(str(p) for p in path)
        axes = var.get_metadata().get("axes")
        value = var.get_value()
        if not (isinstance(value, dict) or hasattr(value, "shape")):
            continue
        leaves = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, leaf in leaves:  # a GPTQ projection is a dict of packed tensors
            ax = axes.get(sub) if isinstance(axes, dict) else axes
            ax = tuple(ax) if ax is not None and len(ax) == len(leaf.shape) else None
            yield (name if sub is None else f"{name}/{sub}"), tuple(leaf.shape), np.dtype(leaf.dtype), ax


def param_specs(model_or_cfg, mesh, rules=None, *, strict: bool = True) -> dict[str, tuple]:
    """our_name -> (shape, dtype, PartitionSpec, per-device shape). Pure: `mesh` may be a dict of sizes."""
    sizes = mesh_shape(mesh)
    out = {}
    for name, shape, dtype, axes in _iter_params(model_or_cfg):
        spec = P() if axes is None else param_spec(name, axes, rules, shape=shape, mesh=sizes, strict=strict)
        local = list(shape)
        for i, s in enumerate(spec):
            for a in (() if s is None else ((s,) if isinstance(s, str) else s)):
                local[i] //= sizes[a]
        out[name] = (shape, dtype, spec, tuple(local))
    return out


def param_shardings(model_or_abstract, mesh: Mesh, rules=None, *, strict: bool = True) -> dict[str, NamedSharding]:
    """our_name ("embed_tokens", "layers/q_proj", "layers/q_proj_lora_a", ...) -> NamedSharding."""
    return {n: NamedSharding(mesh, s[2]) for n, s in param_specs(model_or_abstract, mesh, rules,
                                                                   strict=strict).items()}


def shard_model(model, mesh: Mesh, rules=None, *, strict: bool = True):
    """Move an existing model's parameters onto `mesh` (in place; returns the model)."""
    shardings = param_shardings(model, mesh, rules, strict=strict)
    paths, values, targets = [], [], []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name = "/".join(str(p) for p in path)
        value = var.get_value()
        if name in shardings and getattr(value, "sharding", None) == shardings[name]:
            continue  # already there (loaded into the mesh, or created sharded)
        if name in shardings or isinstance(value, dict):
            paths.append(path)
            values.append(jax.tree.map(_host_if_cpu, value))
            targets.append({k: shardings[f"{name}/{k}"] for k in value} if isinstance(value, dict)
                           else shardings[name])
    for path, new in zip(paths, jax.device_put(values, targets)):  # one batched transfer
        _set_param(model, path, new)
    model.act_sharding = activation_sharding(mesh, rules)  # activations split by batch, not like weights
    return model


def placement(mesh: Mesh, rules=None, *, strict: bool = True):
    """(name, shape, logical axes) -> NamedSharding: where a new parameter goes, so that it can be created
    already split (LoRA factors, `amdllm.model.lora.apply_lora(place=...)`)."""
    def place(name, shape, axes):
        return NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh, strict=strict, name=name))
    return place


def put(host, sharding):
    """A host (numpy) array as a jax.Array with `sharding`, each process transferring only the blocks its
    own devices hold (works with one process or several; every process passes the same array)."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _host_if_cpu(x):
    """A single-device CPU array goes through a zero-copy numpy view: device-to-device resharding
    compiles a small program per shape (~0.2-1 s each on XLA:CPU); host-to-device slicing does not."""
    if isinstance(x, jax.Array) and len(x.devices()) == 1 and next(iter(x.devices())).platform == "cpu":
        return np.asarray(x)
    return x


def _set_param(model, path, value):
    obj = model
    for p in path[:-1]:
        obj = getattr(obj, p)
    getattr(obj, path[-1]).set_value(value)


def check_model_fits_mesh(cfg, mesh, rules=None) -> None:
    """Clear error when a mesh axis does not split the model's heads / kv heads / MLP / vocab / embed."""
    sizes, table = mesh_shape(mesh), get_rules(rules)
    counts = {"heads": ("num_attention_heads", cfg.num_attention_heads),
              "kv_heads": ("num_key_value_heads", cfg.num_key_value_heads),
              "mlp": ("intermediate_size", cfg.intermediate_size), "vocab": ("vocab_size", cfg.vocab_size),
              "embed": ("hidden_size", cfg.hidden_size), "layers": ("num_hidden_layers", cfg.num_hidden_layers)}
    n = math.prod(sizes.values())

    def splits(logical, size_of):  # how many ways `logical` is cut if mesh axes had sizes `size_of`
        return math.prod(size_of(a) for a in table.get(logical, ()))

    for logical, (field, count) in counts.items():
        targets = [a for a in table.get(logical, ()) if sizes[a] > 1]
        ways = splits(logical, sizes.get)
        if targets and count % ways:
            axis = targets[-1]
            good = [d for d in range(1, n + 1) if n % d == 0 and all(
                c % splits(lg, lambda a: d if a == axis else sizes[a]) == 0 for lg, (_, c) in counts.items())]
            mesh_txt = "x".join(f"{a}={sizes[a]}" for a in targets)
            raise ShardingError(f"mesh {mesh_txt} cannot split {logical}: {field}={count} is not divisible by "
                                f"{ways}; sizes of {axis!r} that work for this model: "
                                f"{', '.join(map(str, good))} (or map {logical!r} to None in the rules)")
    param_specs(cfg, sizes, rules)  # and every concrete parameter dimension


# --------------------------------------------------------------------------------------------------
# Batches and activations
# --------------------------------------------------------------------------------------------------
def batch_sharding(mesh: Mesh, rules=None, ndim: int = 2) -> NamedSharding:
    """[B, T, ...] arrays: batch split over data x fsdp (per the rules' `batch` entry), the rest whole."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + ("length",) * (ndim - 1), rules, mesh=mesh))


def activation_sharding(mesh: Mesh, rules=None) -> NamedSharding:
    """[B, T, D] hidden states, for `jax.lax.with_sharding_constraint` inside a jitted step."""
    return NamedSharding(mesh, logical_to_spec(("batch", "length", "act_embed"), rules, mesh=mesh))


def batch_ways(mesh: Mesh, rules=None) -> int:
    """Into how many shards the rules split a batch on this mesh (every batch size must divide by it)."""
    return math.prod(mesh.shape[a] for a in get_rules(rules)["batch"])


def shard_batch(x, mesh: Mesh, rules=None):
    """Place a host batch [B, ...] on the mesh; B must divide by the batch axes' size (clear error)."""
    sh = batch_sharding(mesh, rules, np.ndim(x))
    ways = batch_ways(mesh, rules)
    if np.shape(x)[0] % ways:
        raise ShardingError(f"batch size {np.shape(x)[0]} is not divisible by the {ways} batch shards "
                            f"({'x'.join(get_rules(rules)['batch'])}); use a multiple of {ways}")
    return jax.device_put(x, sh)


# --------------------------------------------------------------------------------------------------
# Pictures and tables
# --------------------------------------------------------------------------------------------------
def sharding_table(model_or_cfg, mesh, rules=None, *, strict: bool = True) -> list[dict]:
    """One row per parameter: name, shape, dtype, spec, bytes (whole) and bytes per device."""
    rows = []
    for name, (shape, dtype, spec, local) in param_specs(model_or_cfg, mesh, rules, strict=strict).items():
        rows.append({"name": name, "shape": shape, "dtype": str(dtype), "spec": str(tuple(spec)),
                     "bytes": math.prod(shape) * dtype.itemsize,
                     "bytes_per_device": math.prod(local) * dtype.itemsize})
    return rows


def format_table(rows: list[dict]) -> str:
    """A fixed-width text rendering of `sharding_table` rows, with totals."""
    head = ("parameter", "shape", "partition spec", "bytes/device")
    body = [(r["name"], "x".join(map(str, r["shape"])), r["spec"], _human(r["bytes_per_device"])) for r in rows]
    body.append(("total", "", "", _human(sum(r["bytes_per_device"] for r in rows))))
    w = [max(len(str(x[i])) for x in [head] + body) for i in range(4)]
    fmt = lambda x: "  ".join(str(c).ljust(w[i]) if i < 3 else str(c).rjust(w[i]) for i, c in enumerate(x))
    return "\n".join([fmt(head), "  ".join("-" * k for k in w)] + [fmt(x) for x in body])


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
