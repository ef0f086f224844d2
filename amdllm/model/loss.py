"""The training loss: token negative log-likelihood in float32, with a one-pass backward."""
from __future__ import annotations

import jax
import jax.numpy as jnp



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
