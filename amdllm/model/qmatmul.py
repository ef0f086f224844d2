"""Dequantizing matmuls for GPUs that never build the dense kernel: a Pallas kernel and XLA's int4 route.

  pallas_matmul  lowered through Triton (NVIDIA and ROCm alike): each program owns an output tile and a
                 slice of K, unpacks the packed words, scales and zeros in registers, sums in float32.
  int4_matmul    codes as `jnp.uint4` [K, N]; the convert and the scale are ops XLA may fuse into the dot.
Both need the groups in order; an act-order checkpoint is sorted once when prepared (`sort_act_order`).
`default_route` picks the Pallas kernel on a GPU; on a CPU it runs in Pallas' interpreter (the tests),
and decoding uses the reference, `quantized.quantized_matmul`."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from amdllm.model.quantized import (QUANT_KEYS, QuantFormatError, QuantLinear, QuantTensor, check_bits,
                                    dequantize, dequantizing_backward, group_count, infer_bits, pack_cols,
                                    pack_rows, quantized_matmul, unpack_cols, unpack_rows)

GEMV_MAX_ROWS = 1   # up to this many rows of x: the multiply-and-sum inner product (batch-1 decoding)
DECODE_ROWS = 16    # up to this many rows (a decode batch): narrower tiles, K split over programs
# At 8 rows the tensor-core kernel beat the multiply-and-sum one on an H200 (BENCHMARKS.md, "On a GPU"),
# so the latter serves one row only.


# --------------------------------------------------------------------------------------------------
# Preparing a layer: groups in order (act-order permuted once), the group size read off the shapes
# --------------------------------------------------------------------------------------------------
def group_size_of(q: dict) -> int:
    """The group size of one layer's {qweight, scales, g_idx}: K rows over scales' rows (one group: K)."""
    K, n_g = q["g_idx"].shape[-1], q["scales"].shape[-2]
    return K if n_g == 1 else -(-K // n_g)


def sort_act_order(q: dict) -> tuple[dict, np.ndarray | None]:
    """One layer's GPTQ tensors (numpy, v2 zeros) -> (the same with rows in group order, perm or None).

    perm is None when g_idx is already k // group_size. Otherwise W's rows are permuted (unpacked,
    reordered, packed again) so that row i belongs to group i // group_size, and the caller multiplies
    x[:, perm] instead of x. Raises QuantFormatError if the groups cannot be put in order (a group with
    more rows than the group size)."""
    g = np.asarray(q["g_idx"]).astype(np.int64)
    K = g.shape[0]
    bits = infer_bits(np.asarray(q["qweight"]).shape[0], K)
    gs = group_size_of(q)
    in_order = np.arange(K) // gs
    if np.array_equal(g, in_order):
        return dict(q), None
    perm = np.argsort(g, kind="stable")
    if not np.array_equal(g[perm], in_order):
        raise QuantFormatError(f"g_idx does not split {K} rows into groups of {gs}: cannot put it in group order")
    codes = unpack_rows(np.asarray(q["qweight"]), bits)[perm]
    return {**q, "qweight": pack_rows(codes, bits), "g_idx": in_order.astype(np.int32)}, perm.astype(np.int32)


# --------------------------------------------------------------------------------------------------
# The Pallas kernel
# --------------------------------------------------------------------------------------------------
MAGIC = 0x4B000000  # the bits of the float32 2^23: OR'd with an integer c < 2^23, they read as 2^23 + c
DEQUANT = ("convert", "bits")


def codes_as_float(codes, dequant: str):
    """Integer codes (int32, 0 <= c < 2^23) -> float32, each exactly c + the same offset (0 or 2^23):
    "convert" by an int-to-float conversion; "bits" by OR'ing them into 2^23's mantissa and reading the
    word as a float: integer operations, where a GPU's int-to-float conversions run at a fraction of its
    FP32 rate (the CUDA programming guide's throughput table). The offset cancels exactly in codes - zero,
    so either gives the same products, bit for bit; which is faster is for a GPU run to say."""
    if dequant == "bits":
        return jax.lax.bitcast_convert_type(codes | MAGIC, jnp.float32)
    return codes.astype(jnp.float32)


def _kernel(x_ref, qw_ref, qz_ref, s_ref, o_ref, *, bits, group_size, words_per_step, steps, gemv, dequant):
    # refs: x [bm, Kp*p] (this split's K rows), qweight [Kp, bn] words, qzeros [G, bn/p], scales [G, bn];
    # the output tile [bm, bn] is this split's partial sum, in float32.
    p = 32 // bits
    rows = words_per_step * p                       # K rows per step, all in one group
    bm, bn = o_ref.shape[-2], o_ref.shape[-1]

    def step(i, acc):
        g = i * rows // group_size                  # this step's group, within the split
        w = qw_ref[pl.ds(i * words_per_step, words_per_step), :]                    # [wps, bn] int32
        codes = codes_as_float(unpack_rows(w, bits), dequant)                       # [rows, bn]
        zero = codes_as_float(unpack_cols(qz_ref[pl.ds(g, 1), :], bits), dequant)   # [1, bn]
        scale = s_ref[pl.ds(g, 1), :].astype(jnp.float32)                           # [1, bn]
        kernel = (codes - zero) * scale                                             # [rows, bn]
        x = x_ref[:, pl.ds(i * rows, rows)]                                         # [bm, rows]
        if gemv:  # one row: a tensor-core tile would be mostly padding
            return acc + jnp.sum(x.astype(jnp.float32)[:, :, None] * kernel[None, :, :], axis=1)  # [bm, bn]
        return acc + jnp.dot(x, kernel.astype(x_ref.dtype), preferred_element_type=jnp.float32)  # tensor cores

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.reshape(o_ref.shape)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def plan_blocks(M: int, K: int, N: int, bits: int, group_size: int, *, block_n: int | None = None,
                k_splits: int | None = None, block_m: int | None = None, gemv_rows: int = GEMV_MAX_ROWS) -> dict:
    """Static tiling for pallas_matmul -> {block_m, block_n, k_splits, words_per_step, gemv, rows_m};
    raises ValueError when the shape does not tile (the caller keeps the reference path)."""
    p = check_bits(bits)
    if group_size % p or K % group_size:
        raise ValueError(f"group size {group_size} must divide K={K} and be a multiple of {p} ({bits}-bit words)")
    gemv, decode = M <= gemv_rows, M <= DECODE_ROWS
    # the dot's tiles need 16 rows at least (Triton); a GEMV row block is the next power of two
    bm = block_m or (_next_pow2(M) if gemv else min(64, max(16, _next_pow2(M))))
    bn = block_n or min(64 if decode else 128, N & -N)  # the largest power of two dividing N, up to the default
    if N % bn or bn & (bn - 1) or bn % p:
        raise ValueError(f"N={N} does not tile by block_n={bn} (a power of two and a multiple of {p})")
    # one group per step when groups are small; per-channel (one group) steps through 128 rows at a time
    rows = group_size if group_size <= 128 else 128
    if group_size % rows:
        raise ValueError(f"group size {group_size} is not a multiple of 128 rows")
    n_groups = K // group_size
    ks = k_splits or (max(1, min(n_groups, 256 // max(1, N // bn))) if decode else 1)  # ~256 programs
    while n_groups % ks:  # a split holds whole groups
        ks -= 1
    return {"block_m": bm, "block_n": bn, "k_splits": ks, "words_per_step": rows // p, "gemv": gemv,
            "rows_m": -(-M // bm) * bm}


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_n", "k_splits", "block_m", "interpret",
                                             "gemv_rows", "num_warps", "dequant"))
def pallas_matmul(x, qweight, qzeros, scales, *, bits: int, group_size: int, block_n: int | None = None,
                  k_splits: int | None = None, block_m: int | None = None, interpret: bool = False,
                  gemv_rows: int = GEMV_MAX_ROWS, num_warps: int = 4, dequant: str = "convert"):
    """x [M, K] @ dequant(qweight [K/p, N], qzeros (v2) [G, N/p], scales [G, N]) -> [M, N] in x's dtype,
    groups in order (g_idx == k // group_size; see sort_act_order). interpret=True runs Pallas'
    interpreter (any backend); otherwise the kernel is lowered through Triton (NVIDIA and AMD GPUs).
    Up to gemv_rows rows run the GEMV-shaped kernel, more the tensor-core one. dequant: how codes become
    floats (`codes_as_float`; the same numbers either way). "bits" has not run on a GPU yet:
    benchmarks/gpu.py times both, and the default stays "convert", the measured one, until a run says."""
    if dequant not in DEQUANT:
        raise ValueError(f"dequant must be one of {', '.join(DEQUANT)}, got {dequant!r}")
    M, K = x.shape
    N = qweight.shape[1]
    t = plan_blocks(M, K, N, bits, group_size, block_n=block_n, k_splits=k_splits, block_m=block_m,
                    gemv_rows=gemv_rows)
    bm, bn, ks, p = t["block_m"], t["block_n"], t["k_splits"], 32 // bits
    xp = jnp.pad(x, ((0, t["rows_m"] - M), (0, 0)))                        # [Mp, K]
    Kw, G = K // p // ks, K // group_size // ks                               # words and groups per split
    steps = Kw // t["words_per_step"]
    kernel = functools.partial(_kernel, bits=bits, group_size=group_size, words_per_step=t["words_per_step"],
                               steps=steps, gemv=t["gemv"], dequant=dequant)
    partial = pl.pallas_call(
        kernel,
        grid=(t["rows_m"] // bm, N // bn, ks),
        in_specs=[pl.BlockSpec((bm, Kw * p), lambda i, j, s: (i, s)),
                  pl.BlockSpec((Kw, bn), lambda i, j, s: (s, j)),
                  pl.BlockSpec((G, bn // p), lambda i, j, s: (s, j)),
                  pl.BlockSpec((G, bn), lambda i, j, s: (s, j))],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((ks, t["rows_m"], N), jnp.float32),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="gptq_matmul",
    )(xp, qweight, qzeros, scales)
    return partial.sum(axis=0)[:M].astype(x.dtype)                            # [M, N]


# --------------------------------------------------------------------------------------------------
# XLA's int4 route
# --------------------------------------------------------------------------------------------------
def to_int4(q: dict) -> dict:
    """One layer's GPTQ tensors (4-bit, groups in order) -> {codes uint4 [K, N], zeros uint4 [G, N], scales}."""
    K = q["g_idx"].shape[-1]
    if infer_bits(q["qweight"].shape[0], K) != 4:
        raise QuantFormatError("the int4 route needs 4-bit weights")
    codes = unpack_rows(q["qweight"], 4).astype(jnp.uint4)
    return {"codes": codes, "zeros": unpack_cols(q["qzeros"], 4).astype(jnp.uint4), "scales": q["scales"]}


def int4_kernel(q4: dict, dtype):
    """(codes - zeros[g]) * scales[g] [K, N] in `dtype`, g = k // group_size: elementwise, for XLA to fuse."""
    codes, zeros, scales = q4["codes"], q4["zeros"], q4["scales"]
    K, N = codes.shape
    G = scales.shape[0]
    w = codes.astype(dtype).reshape(G, K // G, N)                             # [G, gs, N]
    return ((w - zeros.astype(dtype)[:, None, :]) * scales.astype(dtype)[:, None, :]).reshape(K, N)


def int4_matmul(x, q4: dict):
    """x [M, K] @ int4_kernel(q4) -> [M, N] in x's dtype (float32 sums)."""
    return jnp.dot(x, int4_kernel(q4, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def reference_matmul(x, q: dict):
    """The reference the routes are tested against: quantized.dequantize, then a float32 dot."""
    return jnp.dot(x.astype(jnp.float32), dequantize(q, jnp.float32)).astype(x.dtype)


# --------------------------------------------------------------------------------------------------
# In the model: a projection's dict says which route it was prepared for
# --------------------------------------------------------------------------------------------------
ROUTES = ("xla", "pallas", "int4")


def on_gpu() -> bool:
    """Whether JAX runs on a GPU (NVIDIA or AMD): where the Pallas kernel is lowered through Triton, and
    where decoding unrolls its layers (`generate.Decoder`)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def default_route() -> str:
    """The route `generate` and the server prepare a GPTQ model for (one of ROUTES): $AMDLLM_QMATMUL where
    set; else "pallas" on a GPU, the fastest 4-bit route for decoding there (BENCHMARKS.md, "On a GPU");
    the reference ("xla") on CPUs and TPUs, where the kernel does not run."""
    chosen = os.environ.get("AMDLLM_QMATMUL", "").strip()
    if chosen:
        if chosen not in ROUTES:
            raise ValueError(f"AMDLLM_QMATMUL={chosen!r}: expected one of {', '.join(ROUTES)}")
        return chosen
    return "pallas" if on_gpu() else "xla"


def packed_matmul(x2d, q: dict, dtype=jnp.float32):
    """x2d [M, K] @ the packed kernel, by the route `q` was prepared for (`prepare_kernels`): a "perm" key
    means the Pallas kernel (groups in order; perm [K] for act-order, [0] otherwise), "codes" the int4
    route, neither the reference `quantized_matmul`. Differentiable in x2d (QLoRA): the backward
    dequantizes again, as the reference does, so no dense kernel is kept between the passes.
    The Pallas kernel serves decode rows (up to DECODE_ROWS); more rows (a prefill, a training batch) take
    the reference on the sorted rows, which was faster there on an H200 (BENCHMARKS.md, "On a GPU")."""
    x2d = x2d.astype(dtype)
    if "perm" in q:
        if q["perm"].shape[-1]:
            x2d = x2d[:, q["perm"]]                                        # act-order: x in group order
        core = {k: q[k] for k in QUANT_KEYS}
        if x2d.shape[0] > DECODE_ROWS:
            return quantized_matmul(x2d, core, dtype)
        try:
            plan_blocks(*x2d.shape, core["qweight"].shape[1], infer_bits(core["qweight"].shape[0], x2d.shape[1]),
                        group_size_of(core))
        except ValueError:  # a shape the kernel does not tile (static): the reference, on the sorted rows
            return quantized_matmul(x2d, core, dtype)
        return _pallas_vjp(x2d, core)
    if "codes" in q:
        return _int4_vjp(x2d, q)
    return quantized_matmul(x2d, q, dtype)


@jax.custom_vjp
def _pallas_vjp(x2d, q):
    bits = infer_bits(q["qweight"].shape[0], q["g_idx"].shape[-1])
    return pallas_matmul(x2d, q["qweight"], q["qzeros"], q["scales"], bits=bits, group_size=group_size_of(q),
                         interpret=not on_gpu())


def _pallas_fwd(x2d, q):
    return _pallas_vjp(x2d, q), (q, jnp.zeros((0,), x2d.dtype))


_pallas_vjp.defvjp(_pallas_fwd, dequantizing_backward)


@jax.custom_vjp
def _int4_vjp(x2d, q4):
    return int4_matmul(x2d, q4)


def _int4_fwd(x2d, q4):
    return int4_matmul(x2d, q4), (q4, jnp.zeros((0,), x2d.dtype))


def _int4_bwd(res, dy):
    q4, like = res
    return jnp.dot(dy.astype(like.dtype), int4_kernel(q4, like.dtype).T), jax.tree.map(lambda a: None, q4)


_int4_vjp.defvjp(_int4_fwd, _int4_bwd)


def prepare_kernels(model, route: str):
    """Convert a loaded GPTQ model's projections, in place, for `route` (one of ROUTES) -> the model.

    "pallas": each layer's rows are put in group order (`sort_act_order`), and a `perm` tensor is added
    ([L, K] for act-order, [L, 0] otherwise). "int4": the packed words become uint4 codes [L, K, N] and
    the zeros uint4 [L, G, N] (4-bit, groups in order; converted on the device). "xla": unchanged.
    `save_quantized` writes a prepared model as the checkpoint it came from (`restore_gptq`). One device
    only: the kernels are not sharded."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if route == "xla":
        return model
    if route == "pallas" and jax.default_backend() == "tpu":
        raise ValueError("prepare_kernels('pallas'): the kernel is written for Triton (NVIDIA and AMD GPUs); "
                         "on a TPU keep the reference route ('xla')")
    for proj, lin in sorted(vars(model.layers).items()):
        if not isinstance(lin, QuantLinear) or hasattr(lin, "perm") or hasattr(lin, "codes"):
            continue
        if len(lin.qweight[...].devices()) > 1:
            raise ValueError(f"prepare_kernels({route!r}): layers/{proj} is sharded over several devices; "
                             "the fused kernels run on one device")
        g_idx = np.asarray(lin.g_idx[...])                                            # [L, K], small
        L, K = g_idx.shape
        gs = group_size_of({"g_idx": g_idx[0], "scales": lin.scales[...][0]})
        in_order = all(np.array_equal(g, np.arange(K) // gs) for g in g_idx)
        if route == "int4":
            if not in_order:
                raise QuantFormatError(f"layers/{proj}: the int4 route needs groups in order (no act-order)")
            q4 = jax.jit(jax.vmap(to_int4))({k: getattr(lin, k)[...] for k in QUANT_KEYS})  # on the device
            lin.codes, lin.zeros = QuantTensor(q4["codes"]), QuantTensor(q4["zeros"])
            del lin.qweight, lin.qzeros
            continue
        if in_order:  # nothing to move: an empty perm says so (its shape is static inside jit)
            lin.perm = QuantTensor(jnp.zeros((L, 0), jnp.int32))
            continue
        stacked = {k: np.asarray(getattr(lin, k)[...]) for k in QUANT_KEYS}
        per = [sort_act_order({k: v[i] for k, v in stacked.items()}) for i in range(L)]
        for k in ("qweight", "g_idx"):
            getattr(lin, k)[...] = jnp.asarray(np.stack([d[k] for d, _ in per]))
        lin.perm = QuantTensor(jnp.asarray(np.stack([np.arange(K, dtype=np.int32) if p is None else p
                                                     for _, p in per])))
    return model


def restore_gptq(q: dict) -> dict:
    """One layer's tensors as `prepare_kernels` left them (numpy) -> the GPTQ tensors they came from."""
    if "perm" in q:
        perm, q = np.asarray(q["perm"]), {k: np.asarray(q[k]) for k in QUANT_KEYS}
        if perm.shape[-1] == 0:
            return q
        K = perm.shape[0]
        bits = infer_bits(q["qweight"].shape[0], K)
        codes, g = np.empty((K, q["qweight"].shape[1]), np.int64), np.empty(K, np.int32)
        codes[perm], g[perm] = unpack_rows(q["qweight"], bits), q["g_idx"]
        return {**q, "qweight": pack_rows(codes, bits), "g_idx": g}
    if "codes" in q:
        codes, zeros = np.asarray(q["codes"]).astype(np.int64), np.asarray(q["zeros"]).astype(np.int64)
        return {"qweight": pack_rows(codes, 4), "qzeros": pack_cols(zeros, 4),
                "scales": np.asarray(q["scales"]), "g_idx": np.asarray(q["g_idx"])}
    return q


__all__ = ["DECODE_ROWS", "GEMV_MAX_ROWS", "ROUTES", "default_route", "group_count", "group_size_of", "int4_kernel",
           "int4_matmul", "on_gpu", "packed_matmul", "pallas_matmul", "plan_blocks", "prepare_kernels",
           "reference_matmul", "restore_gptq", "sort_act_order", "to_int4"]
