"""The planner: memory per device, FLOPs per token and MFU, from a config, a mesh and a batch shape.

Memory by part: weights (split as the rules table splits them; GPTQ-packed with `bits`), LoRA factors,
AdamW moments, gradients, activations (what the backward keeps, by remat mode) and the layer in flight
under FSDP. FLOPs: forward 2N, full training 6N, LoRA training 4N, plus attention. docs/planner.md has
every formula; tests/test_plan.py compares the totals with XLA's own memory and FLOP counts."""
from __future__ import annotations

import functools
from functools import partial
import math
import time

import jax
import jax.numpy as jnp

from amdllm.model import PROJECTIONS, param_table
from amdllm.model.llama import REMAT, remat_mode
from amdllm.model.quantized import check_bits, group_count, packed_logical_axes
from amdllm.model.lora import normalize_targets
import amdllm.parallel.sharding as S

GB = 1e9
# Peak dense bf16 FLOP/s per JAX device (vendor data sheets, no sparsity). MI250X: 383 per package;
# JAX sees each of its two dies as a device (191.5 each, 64 GB). TPU v4: per chip (megacore).
PEAK_BF16_TFLOPS = {"mi300x": 1307.4, "mi325x": 1307.4, "mi250x": 383.0, "h100": 989.4, "h200": 989.4,
                    "a100": 312.0, "tpu-v4": 275.0, "tpu-v5e": 197.0, "tpu-v5p": 459.0, "tpu-v6e": 918.0}
DEVICE_MEMORY_GB = {"mi300x": 192, "mi325x": 256, "mi250x": 128, "h100": 80, "h200": 141, "a100": 80,
                    "tpu-v4": 32, "tpu-v5e": 16, "tpu-v5p": 95, "tpu-v6e": 32}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
IN_FLIGHT_LAYERS = 1.5
CPU_NARROW_IN_FLIGHT_LAYERS = 2.5  # XLA:CPU, a bfloat16/float16 training step: float32 copies of 2.5 layers


def _bytes(dtype) -> int:
    name = str(getattr(dtype, "name", dtype)).lower()
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _local(shape, axes, sizes, rules, name: str = "planned") -> int:
    """Elements of an array of `shape` with logical `axes` held by one device (`name`: the parameter, for
    a packed tensor's group axis, `sharding.param_spec`)."""
    spec = S.param_spec(name, axes, rules, shape=shape, mesh=sizes, strict=False)
    n = math.prod(shape)
    for s in spec:
        for a in (() if s is None else ((s,) if isinstance(s, str) else s)):
            n //= sizes[a]
    return n


def lora_shapes(cfg, rank: int, targets) -> dict:
    """name -> (shape, logical axes) of every LoRA factor (matches `amdllm.model.lora.apply_lora`)."""
    table, out = param_table(cfg), {}
    for name in normalize_targets(targets):
        (L, d_in, d_out), (la, ia, oa) = table["layers/" + name]
        out[f"layers/{name}_lora_a"] = ((L, d_in, rank), (la, ia, "lora_rank"))
        out[f"layers/{name}_lora_b"] = ((L, rank, d_out), (la, "lora_rank", oa))
    return out


def packed_shapes(cfg, bits: int, group_size: int) -> dict:
    """name -> (shape, logical axes, bytes per element) of every tensor a GPTQ base holds for its seven
    projections (`amdllm.model.quantized`: qweight, qzeros, scales, g_idx per stacked kernel)."""
    p = check_bits(bits)
    out = {}
    for name, (shape, axes) in param_table(cfg).items():
        if name.rsplit("/", 1)[-1] not in PROJECTIONS:
            continue
        L, K, N = shape
        ng = group_count(K, group_size)
        pa = packed_logical_axes(axes)
        out.update({f"{name}/qweight": ((L, K // p, N), pa["qweight"], 4),
                    f"{name}/qzeros": ((L, ng, N // p), pa["qzeros"], 4),
                    f"{name}/scales": ((L, ng, N), pa["scales"], 2),
                    f"{name}/g_idx": ((L, K), pa["g_idx"], 4)})
    return out


def weight_bytes(cfg, sizes, rules, dtype, bits: int | None = None, group_size: int = 128) -> int:
    """Bytes of the base weights on one device: every parameter in `dtype`, or with `bits` the
    projections packed (`packed_shapes`) and the rest in `dtype`."""
    wb = _bytes(dtype)
    total = 0
    for name, (shape, axes) in param_table(cfg).items():
        if bits and name.rsplit("/", 1)[-1] in PROJECTIONS:
            continue
        total += _local(shape, axes, sizes, rules) * wb
    if bits:
        for name, (shape, axes, nb) in packed_shapes(cfg, bits, group_size).items():
            total += _local(shape, axes, sizes, rules, name) * nb
    return total


def matmul_params(cfg) -> int:
    """N: parameters that take part in a matmul per token (all but the embedding lookup and norms)."""
    L, D, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    return L * (2 * D * cfg.q_dim + 2 * D * cfg.kv_dim + 3 * D * F) + D * cfg.vocab_size


def flops_per_token(cfg, seq_len: int, lora_rank: int = 0, lora_targets=("q", "k", "v", "o")) -> dict:
    """FLOPs per trained/predicted token: forward, full training, LoRA training, and the seed's 6N."""
    n, L, q = matmul_params(cfg), cfg.num_hidden_layers, cfg.q_dim
    attn = 4 * L * seq_len * q  # QK^T and PV: 2 FLOPs x S x q each, per token per layer
    lora = 0
    if lora_rank:
        # x@A, (xA)@B forward (2r(in+out)), their activation and weight gradients (2x that)
        lora = sum(6 * lora_rank * shape[1 if k.endswith("_a") else 2]
                   for k, (shape, _) in lora_shapes(cfg, lora_rank, lora_targets).items()) * L
    return {"forward": 2 * n + attn, "full_train": 6 * n + 3 * attn, "lora_train": 4 * n + 3 * attn + lora,
            "six_n": 6 * cfg.num_params(), "matmul_params": n}


def mfu(tokens_per_s: float, flops_per_tok: float, n_devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak."""
    return tokens_per_s * flops_per_tok / (n_devices * peak_flops_per_device)


@functools.lru_cache(maxsize=None)
def measure_cpu_flops(n: int = 1024, repeats: int = 5) -> float:
    """This machine's CPU matmul FLOP/s, cached per process: the best of `repeats` n^3 float32 dots (a CPU
    training step computes in float32)."""
    cpu = jax.local_devices(backend="cpu")[0]  # this process's own (with several, [0] is process 0's)
    kinds = [(jnp.float32, partial(jnp.dot, preferred_element_type=jnp.float32))]
    best = math.inf
    for dt, fn in kinds:
        a = jax.device_put(jnp.ones((n, n), dt), cpu)
        f = jax.jit(fn)
        f(a, a).block_until_ready()  # compile
        for _ in range(repeats):
            t = time.perf_counter()
            f(a, a).block_until_ready()
            best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def peak_flops(accelerator: str) -> float:
    """Peak FLOP/s of one device: the table above, or "cpu" for a measured figure (`measure_cpu_flops`)."""
    key = accelerator.lower()
    if key == "cpu":
        return measure_cpu_flops()
    if key not in PEAK_BF16_TFLOPS:
        raise ValueError(f"unknown accelerator {accelerator!r}; known: cpu, {', '.join(PEAK_BF16_TFLOPS)}")
    return PEAK_BF16_TFLOPS[key] * 1e12


def device_memory(device=None) -> tuple[float, str]:
    """(bytes one device can hold, where that figure comes from): the runtime's limit on an accelerator;
    on a CPU, the host memory available now, shared by the process's devices."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{device.device_kind}'s memory limit"
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    n = jax.local_device_count()
    return avail / n, f"host memory available now / {n} local device{'s' * (n > 1)}"


def activation_bytes(cfg, *, batch_per_device: float, seq_len: int, tensor: int = 1, dtype="bfloat16",
                     remat: bool | str = False, training: bool = True, mlp_lora: bool = False) -> int:
    """Activation memory on one device (formula in the module docstring); remat: one of `llama.REMAT`
    (False: "none", True: "full")."""
    b, D, F, L = _bytes(dtype), cfg.hidden_size, cfg.intermediate_size / tensor, cfg.num_hidden_layers
    q, kv, H, V = cfg.q_dim / tensor, cfg.kv_dim / tensor, cfg.num_attention_heads / tensor, cfg.vocab_size
    tokens = batch_per_device * seq_len
    layer = b * (4 * D + 3 * q + 3 * kv + (5 if mlp_lora else 3) * F) + 8 * H  # per token
    head = 8 * V / tensor  # float32 logits + log-softmax
    if not training:  # one layer live at a time, nothing kept for a backward pass
        return int(tokens * (4 * H * seq_len + b * (D + q + 2 * kv + F) + 4 * V / tensor))
    projections = b * (q + 2 * kv + D + 2 * F)  # remat="dots": q, k, v, o, gate, up outputs (down's is unused)
    kept = {"none": L * layer, "dots": L * (b * D + projections) + layer, "full": L * b * D + layer}[remat_mode(remat)]
    return int(tokens * (kept + head))


def plan(cfg, *, devices: int, device_memory_gb: float, mesh: str | dict | None = None, rules=None,
         lora_rank: int = 0, lora_targets=("q", "k", "v", "o"), full_finetune: bool = False,
         batch_size: int = 1, seq_len: int = 2048, dtype="bfloat16", optimizer: str = "adamw",
         accelerator: str | None = None, tokens_per_s: float | None = None, bits: int | None = None,
         group_size: int = 128) -> dict:
    """Memory per device by part, whether it fits, FLOPs per token and (given tokens/s) MFU.
    bits: a GPTQ-packed base (2, 4 or 8 bits, groups of `group_size` input rows, -1 one group), as
    `finetune --model GPTQ_DIR` (QLoRA) and `generate`/`serve` hold it; `dtype` is then the compute dtype
    and that of the unquantized tensors."""
    sizes = S.parse_mesh_spec(mesh, devices)
    S.check_model_fits_mesh(cfg, sizes, rules)
    table = S.get_rules(rules)
    wb = _bytes(dtype)
    bits = None if bits in (None, 0, 16, 32) else int(bits)
    if bits and full_finetune:
        raise ValueError("full fine-tuning of a quantized base is not possible: the packed weights are frozen; "
                         "plan LoRA (QLoRA) with --rank, or full fine-tuning without --bits")
    weights = weight_bytes(cfg, sizes, rules, dtype, bits, group_size)
    lora_n = lora_total = 0
    if lora_rank:
        items = lora_shapes(cfg, lora_rank, lora_targets).values()
        lora_n = sum(_local(shape, axes, sizes, rules) for shape, axes in items)
        lora_total = sum(math.prod(shape) for shape, _ in items)
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"unknown optimizer {optimizer!r}; the planner knows adamw and sgd")
    training = bool(lora_rank) or full_finetune
    if full_finetune:  # all weights trainable; bf16 weights get a float32 master copy
        trainable_local = weights // wb  # (never packed: refused above)
        master = 4 * trainable_local if wb < 4 else 0
        opt = (8 * trainable_local if optimizer == "adamw" else 0) + master
        grads = wb * trainable_local
    else:
        opt = 8 * lora_n if optimizer == "adamw" else 0
        grads = 4 * lora_n
    batch_ways = math.prod(sizes[a] for a in table["batch"])
    bpd = math.ceil(batch_size / batch_ways)  # a batch smaller than the shards still costs one row each
    tensor = math.prod(sizes[a] for a in table.get("heads", ()))
    mlp_lora = bool(lora_rank) and bool({"gate_proj", "up_proj", "down_proj"} & set(normalize_targets(lora_targets)))
    cpu_narrow = training and accelerator == "cpu" and wb < 4  # XLA:CPU runs a narrow dtype in float32
    act = {r: activation_bytes(cfg, batch_per_device=bpd, seq_len=seq_len, tensor=tensor,
                               dtype="float32" if cpu_narrow else dtype, remat=r, training=training,
                               mlp_lora=mlp_lora) for r in (False, "dots", True)}
    layer = sum(math.prod(shape[1:]) for name, (shape, _) in param_table(cfg).items() if name.startswith("layers/"))
    gathered = any(sizes[a] > 1 for a in table.get("embed", ()))  # FSDP: a layer is gathered to be used
    in_flight = int((IN_FLIGHT_LAYERS if training else float(gathered)) * layer * wb / tensor)
    if cpu_narrow:  # float32 copies of the widened weights (docstring)
        in_flight = int(CPU_NARROW_IN_FLIGHT_LAYERS * layer * 4 / tensor)
    parts = {"weights": weights, "lora": 4 * lora_n, "optimizer": opt, "gradients": grads if training else 0,
             "in_flight": in_flight, "activations": act[False], "activations_dots": act["dots"],
             "activations_remat": act[True]}
    static = weights + parts["lora"] + opt + parts["gradients"] + in_flight
    cap = device_memory_gb * GB
    fl = flops_per_token(cfg, seq_len, lora_rank, lora_targets)
    out = {
        "params": cfg.num_params(), "devices": devices, "mesh": sizes, "rules": rules or S.DEFAULT_RULES,
        "dtype": str(dtype), "batch_size": batch_size, "seq_len": seq_len, "batch_per_device": bpd,
        "mode": "full_finetune" if full_finetune else ("lora" if lora_rank else "inference"),
        "optimizer": (f"{optimizer} (mu, nu float32" + (", float32 master weights)" if full_finetune and wb < 4
                                                         else ")")) if training and optimizer == "adamw"
        else (optimizer if training else None),
        "lora_rank": lora_rank, "lora_targets": list(lora_targets) if lora_rank else [],
        "lora_params": lora_total, "lora_bytes_total": 4 * lora_total,
        "weights_bytes_total": weight_bytes(cfg, {a: 1 for a in S.MESH_AXES}, rules, dtype, bits, group_size),
        "bits": bits, "group_size": group_size if bits else None,
        "per_device_bytes": parts, "per_device_gb": {k: v / GB for k, v in parts.items()},
        "total_bytes": static + act[False], "total_bytes_dots": static + act["dots"],
        "total_bytes_remat": static + act[True], "device_memory_gb": device_memory_gb,
        "fits": static + act[False] <= cap, "fits_dots": static + act["dots"] <= cap,
        "fits_remat": static + act[True] <= cap,
        "flops_per_token": fl,
    }
    for k in ("", "_dots", "_remat"):
        out["total_gb" + k] = out["total_bytes" + k] / GB
    if tokens_per_s is not None and accelerator:
        pk = peak_flops(accelerator)
        key = "lora_train" if lora_rank else ("full_train" if full_finetune else "forward")
        out["mfu"] = {"accelerator": accelerator, "tokens_per_s": tokens_per_s, "peak_flops": pk,
                      key: mfu(tokens_per_s, fl[key], devices, pk),
                      "six_n": mfu(tokens_per_s, fl["six_n"], devices, pk)}
    return out


REMAT_KEYS = {"none": "", "dots": "_dots", "full": "_remat"}  # plan()'s key suffixes: total_bytes_dots, fits_remat


def remat_key(remat) -> str:
    """The suffix of plan()'s totals for a remat mode (False/"none": "", "dots": "_dots", True/"full": "_remat")."""
    return REMAT_KEYS[remat_mode(remat)]


def least_remat(p: dict) -> str | None:
    """The remat mode that recomputes least among those with which plan `p` fits ("none", "dots", "full"),
    or None if none does."""
    return next((m for m in REMAT if p["fits" + REMAT_KEYS[m]]), None)


def fewest_devices(cfg, device_memory_gb: float, *, remat: bool | str = False, most: int = 1024,
                   **shape) -> int | None:
    """The fewest devices N on which a run fits, on an fsdp=N mesh (the model must split N ways), with
    `shape` plan()'s other keywords (rank, batch, seq_len, dtype, bits, ...). None if none up to `most`."""
    for n in range(1, most + 1):
        try:
            p = plan(cfg, devices=n, device_memory_gb=device_memory_gb, mesh=f"fsdp={n}", **shape)
        except S.ShardingError:  # the model does not split n ways
            continue
        if p["fits" + remat_key(remat)]:
            return n
    return None


def format_plan(p: dict) -> str:
    g = p["per_device_gb"]
    mesh = ",".join(f"{a}={n}" for a, n in p["mesh"].items() if n > 1) or "single device"
    held = f"{p['bits']}-bit g{p['group_size']} + {p['dtype']}" if p.get("bits") else p["dtype"]
    lines = [f"{p['params'] / 1e9:.2f}B parameters ({p['weights_bytes_total'] / GB:.1f} GB in {held}), "
             f"{p['mode']}, mesh {mesh}, rules {p['rules']}, batch {p['batch_size']} x {p['seq_len']} tokens",
             f"per device ({p['device_memory_gb']:g} GB):"]
    for k in ("weights", "lora", "optimizer", "gradients", "in_flight", "activations", "activations_dots",
              "activations_remat"):
        lines.append(f"  {k:<18} {g[k]:10.3f} GB")
    for label, k in (("total", ""), ("with remat dots", "_dots"), ("with remat full", "_remat")):
        lines.append(f"  {label:<18} {p['total_gb' + k]:10.3f} GB  -> {'fits' if p['fits' + k] else 'does NOT fit'}")
    if p["optimizer"]:
        lines.append(f"optimizer: {p['optimizer']}")
    f = p["flops_per_token"]
    lines.append(f"FLOPs/token: forward {f['forward']:.3e}, LoRA train {f['lora_train']:.3e}, "
                 f"full train {f['full_train']:.3e}, 6N {f['six_n']:.3e}")
    if "mfu" in p:
        m = p["mfu"]
        honest = next(k for k in m if k in ("lora_train", "full_train", "forward"))
        lines.append(f"MFU at {m['tokens_per_s']:g} tokens/s on {p['devices']}x {m['accelerator']}: "
                     f"{100 * m[honest]:.3f}% ({honest} FLOPs), {100 * m['six_n']:.3f}% (6N)")
    return "\n".join(lines)
