"""C++ kernels that XLA calls (XLA's FFI) for weights on a CPU, read as they lie.

* `rows.cc`, `rows_times`: a few float32 rows times bf16 weights (decoding, and a short prompt's
  prefill where there is no AMX: `amdllm.model.narrow.native_max_rows`). Decoding multiplies one row,
  or a few, by every weight matrix, so a decode step takes as long as reading the weights. XLA:CPU has no
  fast bfloat16 matrix-vector product (1.1-2.2 GB/s of weights on a 2-core Xeon with AVX-512 BF16,
  against about 20 GB/s for float32; docs/benchmark-history.md, "Decoding and prefill"), so a bf16
  checkpoint decoded in float32 (twice the bytes) or widened every layer for every token. The kernel
  widens each weight in a register on its way into a float32 multiply-add: half the bytes of a float32
  product and the same sums, since bfloat16 -> float32 is exact.
* `rows.cc`, `f32_rows_times`: up to 8 float32 rows times float32 weights [in, out] (decoding a float32
  model: `amdllm.model.dense`). XLA:CPU's float32 dots of 8 rows read the weights at about half the rate
  of one row's; the kernel keeps each block of sums in registers down a band of the weights' rows
  (31M benchmark model, 2-core AMD EPYC Zen 4: a decode step of 8 rows 9.9-10.3 -> 8.0-8.5 ms, of one
  row unchanged within the noise; docs/benchmark-history.md, "float32 decoding").
* `bf16_tiles.cc`, `tiles_times`: many bf16 rows times bf16 weights into float32 (a LoRA step's, or an
  evaluation's, products with a frozen bf16 base), on Intel AMX tiles where the CPU has AMX, else by
  AVX-512 BF16's VDPBF16PS where it has that (`tiles_kind`). 256 rows times the 1B shape's matrices (the
  ten products of a layer and a head block, benchmarks/bench_tiles.py): AMX at 1.4-1.6x XLA:CPU's bf16
  dots and 0.8-0.9x PyTorch's rate on a 2-core Xeon (BENCHMARKS.md, "The bf16 tile kernel's products");
  VDPBF16PS at about XLA's speed on a 2-core AMD EPYC Zen 4 (0.98x and 1.06x XLA's rate in two runs). Its
  gain in the LoRA step likely comes from reading the stacked layers in place (`jax.jit` timings;
  docs/benchmark-history.md, "an AMX kernel for the frozen base" and "VDPBF16PS").

* `attention.cc`, `causal_attention`: causal grouped-query attention in float32, forward and backward
  (training, evaluation and prefill without a cache: `amdllm.model.fast.native_attention`, which widens
  bf16 inputs to it). XLA:CPU's
  blocked attention spent about a third of its time on copies into the layouts its batched dots want; here
  each (sequence, kv head) is packed once and its query blocks run from the L2 cache (31M benchmark step's
  shape, 2-core AMD EPYC Zen 4: a layer's forward and backward 15-18 ms against 45-52 ms;
  docs/benchmark-history.md, "native attention"). `cached_attention`: the same over a decode step's
  head-major cache, forward only (`amdllm.model.fast.native_cached_attention`).
* `cross_entropy.cc`, `token_nll`: the training loss, -log softmax(logits)[target] per position, forward and
  backward, in float32 (`amdllm.model.loss.nll_for`). XLA:CPU wrote exp(logits - max) to memory in the
  forward only to sum it; here each row is read while in cache and the backward writes the gradient in one
  pass (31M benchmark step: the loss and its gradient over [2048, 8192] logits, 2-core AMD EPYC Zen 4;
  docs/benchmark-history.md, "the peer's environment").

* `copy.cc`, `materialized`: a float32 copy XLA cannot fuse through, so a table computed once (the RoPE
  tables' cos and sin) is read from memory by its consumers instead of recomputed per element in each
  (31M benchmark step: about 40 ms of ~1.5 s; docs/benchmark-history.md, "the per-layer training step").

* `transpose.cc` (`amdllm.native.transpose`, through ctypes, not XLA): a plain 2-D transpose of 2- or
  4-byte elements, the checkpoint loader's and writers' (HF stores kernels [out, in], amdllm [in, out]).
  numpy copies a transposed view an element at a time at 0.3-0.4 GB/s; the kernel's SSE tiles run at about
  3.4 GB/s (a [8192, 2048] bf16 kernel on a 2-core AMD EPYC Zen 4: 118 -> 10 ms). It runs whatever JAX's
  back end is.

`amdllm.model.narrow` and `amdllm.model.fast` decide where each runs. Each library is compiled on first use
with the host's C++ compiler (`$CXX`, else g++ or c++; about 5 s, once per machine) into `$AMDLLM_CACHE/native` (default
~/.cache/amdllm/native) and loaded from there afterwards (`amdllm.native.toolchain`). Where one cannot be built (no compiler, another
platform) its `available()` is False, one warning says why, and XLA's way runs. `AMDLLM_NATIVE=0` turns
all of them off (to compare).
"""
from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from amdllm.cpu import cpu_flags
from amdllm.native.toolchain import build, disabled


SOURCE = Path(__file__).with_name("rows.cc")
TILES_SOURCE = Path(__file__).with_name("bf16_tiles.cc")
ATTENTION_SOURCE = Path(__file__).with_name("attention.cc")
CROSS_ENTROPY_SOURCE = Path(__file__).with_name("cross_entropy.cc")
COPY_SOURCE = Path(__file__).with_name("copy.cc")
MAX_ROWS = 64  # rows.cc kMaxRows: the most rows of x `rows_times` takes
F32_MAX_ROWS = 8  # rows.cc kF32MaxRows: the most rows of x `f32_rows_times` takes
TARGETS = {False: "amdllm_bf16_rows_kn", True: "amdllm_bf16_rows_nk"}  # by `transposed`
F32_TARGET = "amdllm_f32_rows_kn"
TILES_TARGETS = {"amx": {False: "amdllm_bf16_tiles_kn", True: "amdllm_bf16_tiles_nk"},  # by kind, `transposed`
                 "avx512_bf16": {False: "amdllm_bf16_dots_kn", True: "amdllm_bf16_dots_nk"}}
TILES_SYMBOLS = {"amx": {False: "Bf16TilesKn", True: "Bf16TilesNk"},
                 "avx512_bf16": {False: "Bf16DotsKn", True: "Bf16DotsNk"}}
AMX_FLAGS = ("amx_tile", "amx_bf16")  # /proc/cpuinfo
TILES_FLAGS = {"amx": AMX_FLAGS, "avx512_bf16": ("avx512bw", "avx512_bf16")}  # each kind's, the faster first
ATTENTION_TARGETS = ("amdllm_attention_fwd", "amdllm_attention_bwd", "amdllm_attention_cached")
CROSS_ENTROPY_TARGETS = ("amdllm_cross_entropy_fwd", "amdllm_cross_entropy_bwd")
COPY_TARGET = "amdllm_copy_f32"


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: the CPU back end, AMDLLM_NATIVE not 0, and the library built and
    registered with XLA (a warning says why not, once)."""
    return _register(SOURCE, (TARGETS[False], TARGETS[True], F32_TARGET), ("Bf16RowsKn", "Bf16RowsNk", "F32RowsKn"),
                     "bfloat16 weights are decoded through XLA, which widens them to float32 every token (slower), "
                     "and float32 ones by XLA's dots", what="row")


def _register(source: Path, names, symbols, off: str, what: str | None = None) -> bool:
    """Build `source` and register its FFI handlers `symbols` as targets `names` (`_off()`: False); False with
    one warning naming the `what` kernel (default: the source's name) and `off`, what runs instead, where that
    fails."""
    if _off():
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source)))
        for name, symbol in zip(names, symbols):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (RuntimeError, OSError, AttributeError) as e:
        warnings.warn(f"amdllm.native: the {what or source.stem.replace('_', '-')} kernel is off ({e}); {off}. "
                      "AMDLLM_NATIVE=0 silences this.", RuntimeWarning, stacklevel=3)
        return False
    return True


def _off() -> bool:  # the XLA kernels: also off the CPU back end
    return disabled() or jax.default_backend() != "cpu"


@functools.cache
def tiles_kind() -> str | None:
    """Which kernel of `bf16_tiles.cc` runs many-row bf16 products here: "amx" on a CPU with AMX tiles and
    bf16 that Linux lets this process use, else "avx512_bf16" on a CPU with AVX-512 BF16 (VDPBF16PS: AMD
    Zen 4 and later, Intel Cooper Lake and later), else None (quietly). `available()`'s conditions apply;
    where neither can be built or loaded, one warning says why and XLA's dots run."""
    if _off():
        return None
    why = None
    for kind in tiles_kinds_of(cpu_flags()):
        try:
            _register_tiles(kind)
            return kind
        except (RuntimeError, OSError, AttributeError) as e:
            why = why or e
    if why is not None:
        warnings.warn(f"amdllm.native: the bf16 tile kernel is off ({why}); bf16 products of many rows run in "
                      "XLA (slower on this CPU). AMDLLM_NATIVE=0 silences this.", RuntimeWarning, stacklevel=2)
    return None


def tiles_kinds_of(flags) -> list[str]:
    """The tile kernels a CPU with these /proc/cpuinfo flags can run, the faster first."""
    return [k for k, need in TILES_FLAGS.items() if all(f in flags for f in need)]


@functools.cache
def _register_tiles(kind: str) -> None:
    """Build and load `bf16_tiles.cc` and register `kind`'s two handlers with XLA, once per process."""
    lib = ctypes.cdll.LoadLibrary(str(build(TILES_SOURCE)))
    ready = lib.amdllm_tiles_ready if kind == "amx" else lib.amdllm_dots_ready
    if ready() != 1:
        raise RuntimeError("the kernel did not grant this process the AMX tile state (arch_prctl)" if kind == "amx"
                           else "the compiled library does not see AVX-512 BF16 on this CPU")
    for transposed, name in TILES_TARGETS[kind].items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, TILES_SYMBOLS[kind][transposed])),
                                    platform="cpu")


def tiles_available() -> bool:
    """Whether many-row bf16 products run in `bf16_tiles.cc` here (`tiles_kind()` is not None)."""
    return tiles_kind() is not None


def tiles_times(x2, bits, transposed: bool = False, layer=None, kind: str | None = None):
    """x2 [M, K] as bfloat16 times the bfloat16 matrix whose bits (uint16) are `bits` [K, N] ([N, K] if
    transposed) -> float32 [M, N], in `bf16_tiles.cc`: on AMX tiles or by VDPBF16PS (`kind`, by default
    `tiles_kind()`); float32 sums, as XLA's bf16 dots with preferred_element_type=float32. With `layer` (an
    int32 scalar), `bits` is a stack [L, K, N] read in place at that layer: inside the layer scan, no copy
    of the slice. No gradient: `amdllm.model.narrow.bf16_dot` is the differentiable form. Where the kernel
    is not available, a RuntimeError."""
    kind = kind or tiles_kind()  # tiles_kind() also registers the kernel with XLA, once per process
    if kind is None:
        raise RuntimeError("amdllm.native: the bf16 tile kernel is not available here")
    _register_tiles(kind)
    n = bits.shape[-2] if transposed else bits.shape[-1]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    at = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    return jax.ffi.ffi_call(TILES_TARGETS[kind][transposed], out, vmap_method="sequential")(
        x2.astype(jnp.bfloat16), bits, at)


def _call(x2, bits, transposed: bool):
    if not available():  # also what registers the kernel with XLA, once per process
        raise RuntimeError("amdllm.native: the bf16 row kernel is not available here (its warning says why)")
    n = bits.shape[0] if transposed else bits.shape[1]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[transposed], out, vmap_method="sequential")(x2.astype(jnp.float32), bits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rows_times(x2, bits, transposed: bool = False):
    """x2 [M, K] (1 <= M <= MAX_ROWS) times the bfloat16 matrix whose bits (uint16) are `bits` [K, N]
    ([N, K] if transposed, as a tied head's embedding table) -> float32 [M, N]. The weights are frozen:
    the backward gives x2's gradient only, by the other layout's kernel on the same bits. Where the kernel
    is not `available()`, a RuntimeError."""
    return _call(x2, bits, transposed)


def _rows_times_bwd(transposed, res, dy):
    bits, like = res  # like: an empty array of x2's dtype
    return _call(dy, bits, not transposed).astype(like.dtype), None  # [M, N] . W^T -> [M, K]


rows_times.defvjp(lambda x2, bits, transposed: (_call(x2, bits, transposed), (bits, x2[:0, :0])), _rows_times_bwd)


def _f32_call(x2, w):
    if not available():
        raise RuntimeError("amdllm.native: the row kernel is not available here (its warning says why)")
    return jax.ffi.ffi_call(F32_TARGET, jax.ShapeDtypeStruct((x2.shape[0], w.shape[1]), jnp.float32),
                            vmap_method="sequential")(x2.astype(jnp.float32), w.astype(jnp.float32))


@jax.custom_vjp
def f32_rows_times(x2, w):
    """x2 [M, K] (1 <= M <= F32_MAX_ROWS) times float32 weights w [K, N] -> float32 [M, N], in `rows.cc`.
    Differentiable in both (the backward is XLA's: dy . w^T and x2^T . dy). Where the kernel is not
    `available()`, a RuntimeError."""
    return _f32_call(x2, w)


def _f32_rows_times_bwd(res, dy):
    x2, w = res
    return (dy @ w.T).astype(x2.dtype), (x2.T.astype(jnp.float32) @ dy).astype(w.dtype)


f32_rows_times.defvjp(lambda x2, w: (_f32_call(x2, w), (x2, w)), _f32_rows_times_bwd)


# --------------------------------------------------------------------------------------------------
# attention.cc: causal grouped-query attention, forward and backward
# --------------------------------------------------------------------------------------------------
@functools.cache
def attention_available() -> bool:
    """Whether `causal_attention` runs here (`available()`'s conditions, for `attention.cc`; a warning says why
    not, once)."""
    return _register(ATTENTION_SOURCE, ATTENTION_TARGETS, ("AttentionFwd", "AttentionBwd", "AttentionCached"),
                     "training's attention runs in XLA (slower)")


def _attention_fwd_call(q, k, v, mask, scale, block):
    if not attention_available():
        raise RuntimeError("amdllm.native: the attention kernel is not available here (its warning says why)")
    B, T, H, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((B, H, T), jnp.float32))
    return jax.ffi.ffi_call(ATTENTION_TARGETS[0], out, vmap_method="sequential")(
        q, k, v, mask.astype(jnp.bool_), scale=np.float32(scale), block=np.int64(block))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def causal_attention(q, k, v, mask, scale: float, block: int = 32):
    """softmax(scale q k^T, masked) v for float32 q [B, T, H, hd], k/v [B, T, Hkv, hd] (H a multiple of Hkv),
    mask [B, T, T] bool, in `attention.cc`, by query blocks of `block` positions that skip the keys after
    their block: the mask must be causal (no query sees a later key). Differentiable in q, k and v; the
    backward recomputes the probabilities from the forward's row statistics. Where the kernel is not
    `attention_available()`, a RuntimeError."""
    return _attention_fwd_call(q, k, v, mask, scale, block)[0]


def _causal_attention_fwd(q, k, v, mask, scale, block):
    o, lse = _attention_fwd_call(q, k, v, mask, scale, block)
    return o, (q, k, v, mask, o, lse)


def _causal_attention_bwd(scale, block, res, do):
    q, k, v, mask, o, lse = res
    out = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, jnp.float32),
           jax.ShapeDtypeStruct(v.shape, jnp.float32))
    dq, dk, dv = jax.ffi.ffi_call(ATTENTION_TARGETS[1], out, vmap_method="sequential")(
        q, k, v, mask.astype(jnp.bool_), o, lse, do.astype(jnp.float32), scale=np.float32(scale), block=np.int64(block))
    return dq, dk, dv, None


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def cached_attention(q, k, v, mask, scale: float):
    """softmax(scale q k^T, masked) v for float32 q [B, T, H, hd] over a head-major cache k, v [B, Hkv, S, hd]
    (`amdllm.model.attention.cached_attention`'s layout), mask [B, T, S] bool -> [B, T, H, hd], in
    `attention.cc`. Forward only (decoding). Where the kernel is not `attention_available()`, a RuntimeError."""
    if not attention_available():
        raise RuntimeError("amdllm.native: the attention kernel is not available here (its warning says why)")
    return jax.ffi.ffi_call(ATTENTION_TARGETS[2], jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")(
        q, k, v, mask.astype(jnp.bool_), scale=np.float32(scale))


# --------------------------------------------------------------------------------------------------
# cross_entropy.cc: token cross-entropy, forward and backward
# --------------------------------------------------------------------------------------------------
@functools.cache
def cross_entropy_available() -> bool:
    """Whether `token_nll` runs here (`available()`'s conditions, for `cross_entropy.cc`; a warning says why
    not, once)."""
    return _register(CROSS_ENTROPY_SOURCE, CROSS_ENTROPY_TARGETS, ("CrossEntropyFwd", "CrossEntropyBwd"),
                     "the training loss runs in XLA (slower)")


def _token_nll_fwd(logits, targets):
    if not cross_entropy_available():
        raise RuntimeError("amdllm.native: the cross-entropy kernel is not available here (its warning says why)")
    lead, V = logits.shape[:-1], logits.shape[-1]
    x, t = logits.reshape(-1, V), targets.reshape(-1).astype(jnp.int32)
    row = jax.ShapeDtypeStruct(t.shape, jnp.float32)
    nll, lse = jax.ffi.ffi_call(CROSS_ENTROPY_TARGETS[0], (row, row), vmap_method="sequential")(x, t)
    return nll.reshape(lead), (x, t, lse)


@jax.custom_vjp
def token_nll(logits, targets):
    """-log softmax(logits)[target] per position, for float32 logits [..., V] and int targets [...] in [0, V),
    in `cross_entropy.cc` -> [...] float32. Differentiable in the logits. Where the kernel is not
    `cross_entropy_available()`, a RuntimeError."""
    return _token_nll_fwd(logits, targets)[0]


def _token_nll_bwd(res, g):
    x, t, lse = res
    grad = jax.ffi.ffi_call(CROSS_ENTROPY_TARGETS[1], jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential", input_output_aliases={0: 0})(
        x, t, lse, g.reshape(-1).astype(jnp.float32))
    return grad.reshape(*g.shape, x.shape[-1]), None


token_nll.defvjp(_token_nll_fwd, _token_nll_bwd)


# copy.cc: a copy XLA cannot fuse through
# --------------------------------------------------------------------------------------------------
@functools.cache
def copy_available() -> bool:
    """Whether `materialized` copies here (`available()`'s conditions, for `copy.cc`; a warning says why not,
    once)."""
    return _register(COPY_SOURCE, (COPY_TARGET,), ("CopyF32",),
                     "XLA recomputes the RoPE tables in every layer (slower)", what="copy")


def materialized(x):
    """x copied by `copy.cc`, a custom call XLA cannot fuse through: x's consumers read it from memory instead
    of computing x again inside each of them. x itself where x is not float32 or the kernel does not run
    (`copy_available()`). No gradient flows through the copy: for values that carry none (tables computed
    from positions)."""
    if x.dtype != jnp.float32 or not copy_available():
        return x
    return jax.ffi.ffi_call(COPY_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")(x)
