"""GPTQ-packed weights inside the model: int32 packing and the quantized matmul.

A quantized projection holds, per stacked layer, `qweight` int32 [K/p, N], `qzeros` int32 [n_g, N/p],
`scales` fp16 [n_g, N] and `g_idx` int32 [K] (docs/formats.md), with v2's real zero points. The matmul
dequantizes inside the caller's jit (the words stay on the device):
    W^T[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
Supported: 2, 4 and 8 bits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FORMAT_BITS = (2, 4, 8)
QUANT_KEYS = ("qweight", "qzeros", "scales", "g_idx")


class QuantFormatError(ValueError):
    """A GPTQ checkpoint or packed tensor that does not match the format."""


class QuantTensor(nnx.Variable):
    """Packed GPTQ data: not an nnx.Param, so LoRA filters and parameter counts treat it as frozen."""


def packed_logical_axes(kernel_axes) -> dict:
    """The logical axes of a stacked kernel's packed tensors, from the kernel's (layers, in, out): the
    packed words and g_idx run along `in`, and each group is a block of `in` rows."""
    la, ia, oa = kernel_axes
    return {"qweight": (la, ia, oa), "qzeros": (la, ia, oa), "scales": (la, ia, oa), "g_idx": (la, ia)}


class QuantLinear(nnx.Module):
    """A stacked quantized projection: qweight [L,K/p,N], qzeros [L,n_g,N/p], scales [L,n_g,N], g_idx [L,K].
    axes: {name: logical axes} (`packed_logical_axes`), so a mesh splits the packed base like a dense one."""

    def __init__(self, qweight, qzeros, scales, g_idx, axes: dict | None = None):
        axes = axes or {}
        meta = lambda k: {"axes": axes[k]} if k in axes else {}  # noqa: E731
        self.qweight, self.qzeros = QuantTensor(qweight, **meta("qweight")), QuantTensor(qzeros, **meta("qzeros"))
        self.scales, self.g_idx = QuantTensor(scales, **meta("scales")), QuantTensor(g_idx, **meta("g_idx"))


# --------------------------------------------------------------------------------------------------
# Packing (numpy for writing; the unpacking used at run time is in jnp and works on both)
# --------------------------------------------------------------------------------------------------
def check_bits(bits: int, what: str = "bits") -> int:
    if bits not in FORMAT_BITS:
        raise QuantFormatError(f"{what}={bits} is not supported by the packed format; expected one of "
                               f"{FORMAT_BITS} (3-bit packing is not implemented): quantize the full-precision "
                               "model at 4 bits instead (`amdllm quantize --bits 4`)")
    return 32 // bits


def group_count(in_features: int, group_size: int) -> int:
    """Rows of scales and zeros for K = in_features input rows in groups of `group_size` (-1 or 0, or a size
    of at least K: one group)."""
    return 1 if group_size in (-1, 0) or group_size >= in_features else -(-in_features // group_size)


def pack_rows(codes, bits: int) -> np.ndarray:
    """codes [K, N] ints in [0, 2^bits) -> int32 [K*bits/32, N], packed along K (qweight)."""
    p = check_bits(bits)
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
    """x2d [M, K] @ dequant(q) [K, N] -> [M, N], the kernel dequantized inside the caller's jit.

    Differentiable in x2d only (QLoRA: the packed base is frozen). The backward dequantizes the kernel
    again for dx = dy @ W^T instead of keeping it: autodiff would save each layer's dense W as a residual,
    which the layer scan stacks into a dense copy of the whole base."""
    return _qmm(x2d.astype(dtype), q)


@jax.custom_vjp
def _qmm(x2d, q):
    return jnp.dot(x2d, dequantize(q, x2d.dtype))                # [M, N]


def _qmm_fwd(x2d, q):
    return _qmm(x2d, q), (q, jnp.zeros((0,), x2d.dtype))        # the packed words only (and x's dtype)


def dequantizing_backward(res, dy):
    """The backward of a matmul on packed GPTQ tensors whose forward saved (q, an empty array of x's
    dtype): dx = dy @ W^T with W dequantized again, and no cotangent for the frozen words (also used by
    `amdllm.model.qmatmul`'s fused routes)."""
    q, like = res
    dx = jnp.dot(dy.astype(like.dtype), dequantize(q, like.dtype).T)  # [M, K]
    return dx, jax.tree.map(lambda a: None, q)


_qmm.defvjp(_qmm_fwd, dequantizing_backward)
