"""The training loss: token negative log-likelihood in float32, with a one-pass backward."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from amdllm import native


def cross_entropy(logits, targets, weights):
    """Mean token NLL in float32 over positions where weights > 0. logits [B,T,V], targets/weights [B,T]."""
    w = weights.astype(jnp.float32)
    return jnp.sum(token_nll(logits, targets) * w) / jnp.maximum(jnp.sum(w), 1.0)


@jax.custom_vjp
def token_nll(logits, targets):
    """-log softmax(logits)[target] in float32, per position. logits [..., V], targets [...] int."""
    return _nll_fwd(logits, targets)[0]


def _nll_fwd(logits, targets):
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return lse - picked, (logits, lse, targets)


def _nll_bwd(res, g):
    # softmax - onehot in one pass; autodiff of log_softmax + take_along_axis would store the
    # log-probabilities and scatter into a zeroed [..., V] buffer
    logits, lse, targets = res
    onehot = jnp.arange(logits.shape[-1]) == targets[..., None]
    grad = (jnp.exp(logits.astype(jnp.float32) - lse[..., None]) - onehot) * g[..., None]
    return grad.astype(logits.dtype), None


token_nll.defvjp(_nll_fwd, _nll_bwd)


def nll_for(run):
    """The `token_nll` a step run as `run` (a `llama.Run`) uses: on a CPU off a mesh, for float32 logits (the
    head's), the C++ one (`native.token_nll`, amdllm/native/cross_entropy.cc; the same numbers to float32
    rounding, tests/test_native.py) where it builds and AMDLLM_NATIVE is not 0; else the one above. On a
    mesh XLA would gather the sharded logits to call it."""
    def nll(logits, targets):
        if run.act_sharding is None and logits.dtype == jnp.float32 and native.cross_entropy_available():
            return native.token_nll(logits, targets)
        return token_nll(logits, targets)
    return nll
