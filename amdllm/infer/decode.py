"""The decode core that `generate` and the server's engine share: sampling, and the two model calls every
decoder is built from. A prefill writes a prompt's keys and values into the cache and returns the
logits at the last position only (a prefill's [B, P, V] float32 logits would be 8 GB for 8 x 2048
tokens of a 128k vocabulary, and only the last column is used); a step writes one token per row.
Both run the fast model (`amdllm.model.fast.forward`) over the weights `amdllm.backends.prepare` gives.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from amdllm.model import Run
from amdllm.model.fast import forward
from amdllm.model.narrow import head


def inference_run(model) -> Run:
    """How inference (decoding, perplexity) runs `model`: its compute dtype and LoRA scale, and on a mesh its
    activation sharding (the hidden states stay split by batch); no remat, no dropout."""
    return Run(model.dtype, lora_scale=float(model.lora_scale), act_sharding=getattr(model, "act_sharding", None))


def last_logits(cfg, run: Run, top, layers, tokens, positions, segment_ids, cache, cache_index):
    """tokens/positions/segment_ids [B, T], written into `cache` from slot cache_index ->
    (float32 logits at the last position [B, V], the cache)."""
    h, cache = forward(cfg, top, layers, tokens, positions=positions, segment_ids=segment_ids, cache=cache,
                       cache_index=cache_index, run=run, return_hidden=True)           # [B, T, D] normed
    return head(top, h[:, -1], run.dtype), cache


def step_logits(cfg, run: Run, top, layers, tok, pos, active, cache, cache_index):
    """One decode step: tok/pos/active [B] (an inactive row writes an invalid slot) -> (logits [B, V], cache)."""
    return last_logits(cfg, run, top, layers, tok[:, None], pos[:, None], active[:, None].astype(jnp.int32),
                       cache, cache_index)


# --------------------------------------------------------------------------------------------------
# Sampling: pure functions over arrays
# --------------------------------------------------------------------------------------------------
def sampling_mode(temperature, top_p) -> str:
    """What a batch's sampler must compute, from its per-row settings on the host (numpy): "greedy" (no
    row samples), "sample" (some row samples, none cuts the tail) or "nucleus". A static argument of the
    jitted steps: a device-side conditional would make the host wait for its predicate every step
    (XLA on a GPU copies it back), and the next step could not be launched while this one runs."""
    temperature, top_p = np.asarray(temperature), np.asarray(top_p)
    if not (temperature > 0).any():
        return "greedy"
    return "nucleus" if (top_p < 1).any() else "sample"


def first_max(logits):
    """jnp.argmax(logits, axis=-1) as int32, to the tie and the NaN (the first maximum; where a row holds a
    NaN, its first NaN), from a max and a min of the indices where it is reached: XLA:CPU computes argmax as
    one slower reduction of (value, index) pairs."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    reached = (logits == m) | jnp.isnan(logits)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(reached, index, logits.shape[-1]), axis=-1)


def sample_token(logits, key, temperature, top_p, mode: str = "nucleus"):
    """logits [B, V] float32; temperature, top_p [B] -> token ids [B] int32.

    temperature 0 is greedy. Otherwise nucleus sampling: keep the smallest set of most likely tokens whose
    probability reaches top_p (the most likely always kept), renormalise, sample, in vocabulary order, one
    key per row: a row samples the same token alone or in any batch. `mode` (`sampling_mode`, static) skips
    what no row needs (the draw, the sort); every mode gives the same tokens where it applies."""
    return sample_rows(logits, jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(logits.shape[0])),
                       temperature, top_p, mode)


def sample_rows(logits, keys, temperature, top_p, mode: str = "nucleus"):
    """`sample_token` with one key per row given (keys [B, 2]): row b draws with keys[b] alone. Callers
    that batch unrelated requests (the server) pass each request's own key, and must not vmap this."""
    if mode not in ("greedy", "sample", "nucleus"):
        raise ValueError(f"sampling mode must be greedy, sample or nucleus, got {mode!r}")
    greedy = first_max(logits)
    if mode == "greedy":
        return greedy
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    if mode == "nucleus":
        desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs                         # mass strictly above
        first = jnp.arange(desc.shape[-1]) == 0  # always kept: a top_p that rounds to 0 in float32 keeps it
        keep = (before < top_p[:, None]) | (top_p[:, None] >= 1.0) | first
        cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)  # smallest kept logit
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    tok = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, tok, greedy)
