"""The upper Cholesky factor of a layer's inverse Hessian, with GPTQ's dampening: LAPACK on the host where
JAX runs on the CPU, XLA on the device otherwise; dampening raised by 0.01 while it fails (GPTQModel)."""
from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import threadpoolctl
from scipy.linalg import lapack

# in_features from which the host factorisation uses every BLAS thread: there more threads pay off (the
# factor's rounding then follows the thread count); below it a factor takes well under a second
BLAS_THREADS_FROM = 4096


class GPTQError(ValueError):
    """Bad quantization settings or calibration data."""


def _chol_inv_upper(H, damp):
    """Upper U with U^T U = (H + damp I)^-1, or None if H + damp I is not positive definite, by
    LAPACK in float32 on the host. With P the reversal of the index order, P (H + damp I) P = L L^T
    gives U = P L^-1 P: one Cholesky and one triangular inverse (potrf, trtri), half the work of the
    reference's torch sequence (cholesky -> cholesky_inverse -> cholesky(upper); the same factor up
    to rounding, as tests/test_gptq.py checks against it). Not in XLA: its triangular solves took longer
    to compile (per shape) than the whole factorisation takes here, and a failure is an info code."""
    Hd = np.array(H[::-1, ::-1], np.float32, copy=True)
    Hd[np.diag_indices_from(Hd)] += np.float32(damp)
    L, info = lapack.spotrf(Hd, lower=1, overwrite_a=1)
    if info != 0:
        return None
    Li, info = lapack.strtri(L, lower=1, overwrite_c=1)
    if info != 0:
        return None
    U = np.ascontiguousarray(Li[::-1, ::-1])
    return U if np.all(np.isfinite(U)) else None


@jax.jit
def _chol_inv_upper_device(H, damp):
    """The same factor computed by XLA on the accelerator, and whether it is finite. On a GPU the
    host path would move H ([K, K], 0.76 GB for Llama 13B's down_proj) to the CPU and factor it there
    on one thread; the device's solver is far faster at those sizes."""
    K = H.shape[0]
    eye = jnp.eye(K, dtype=jnp.float32)
    L = jnp.linalg.cholesky(H + damp * eye)
    Hinv = jax.scipy.linalg.cho_solve((L, True), eye)
    U = jnp.linalg.cholesky((Hinv + Hinv.T) / 2).T                 # upper: U^T U = Hinv
    return U, jnp.all(jnp.isfinite(U))


def mean_diagonal(diag) -> float:
    """The mean of a Hessian's diagonal, in float64: dampening adds percdamp times it (`hessian_inverse`),
    and `gptq_quantize` takes the same figure back out of the solve's error."""
    return float(np.mean(np.asarray(diag), dtype=np.float64))


def one_blas_thread():
    """numpy's and scipy's BLAS on one thread (threadpoolctl): a small factorisation gains nothing from more,
    and their spinning threads took the cores from XLA. One thread also makes the factor the same on any
    machine (the blocking changes the float32 rounding)."""
    return threadpoolctl.threadpool_limits(1, user_api="blas")


def hessian_inverse(H, percdamp: float, where: str = "layer", on_host: bool | None = None):
    """(U, damp fraction used). Raises dampening by 0.01 while the factorisation fails (GPTQModel).
    on_host: LAPACK on the host CPU (the default when JAX runs on the CPU), else XLA on the device."""
    on_host = jax.default_backend() == "cpu" if on_host is None else on_host
    H = np.asarray(H, np.float32) if on_host else jnp.asarray(H, jnp.float32)
    mean_diag = mean_diagonal(np.diag(H) if on_host else jnp.diag(H))
    p = percdamp
    while p < 1.0:
        if on_host:  # small factors on one thread (see `one_blas_thread`); the large ones on all cores
            with one_blas_thread() if H.shape[0] < BLAS_THREADS_FROM else contextlib.nullcontext():
                U = _chol_inv_upper(H, p * mean_diag)
        else:
            U, ok = _chol_inv_upper_device(H, jnp.float32(p * mean_diag))
            U = U if bool(ok) else None
        if U is not None:
            if p != percdamp:
                warnings.warn(f"{where}: Cholesky failed at percdamp={percdamp}; used {p:.2f}", stacklevel=3)
            return (jax.device_put(U) if on_host else U), p
        p = round(p + 0.01, 6)
    raise GPTQError(f"{where}: the Hessian is not positive definite even with percdamp < 1 "
                    "(too few or degenerate calibration tokens?)")
