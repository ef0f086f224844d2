"""Text generation with a KV cache: one prefill, then a jitted one-token decode step.

Prompts are left-padded (pads get segment id 0, never attended to) and keep their own RoPE positions,
so a batched row gives what it gives alone. Prompt and cache lengths are rounded up to buckets, so the
steps compile once per bucket, not per prompt. The decode loop is a Python loop over the jitted step: it
streams, stops when every row has finished, and dispatches the next step before reading this one's
tokens. The weights go in as arguments, as `amdllm.backends.prepare` gives them."""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from amdllm import backends
from amdllm.io import checkpoint
from amdllm.io.peft import load_adapter
from amdllm.io.tokenizer import load_tokenizer, pad_id
from amdllm.infer.decode import inference_run, last_logits, sample_token, sampling_mode, step_logits
from amdllm.model import KVCache, to_pure
from amdllm.model.fast import init_cache, layer_slices, split_cache
from amdllm.model.qmatmul import default_route, on_gpu, prepare_kernels
from amdllm.model.quantized import QuantFormatError
from amdllm.model.inputs import expect_model, expect_tokenizer, token_ids

PROMPT_BUCKET = 16
CACHE_BUCKET = 64


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# --------------------------------------------------------------------------------------------------
# Compiled prefill / decode, cached per model structure
# --------------------------------------------------------------------------------------------------
_COMPILED: dict = {}


def _compiled(model):
    """Jitted (prefill, step) for this model's config/dtype/LoRA scale; weights are arguments."""
    cfg = model.cfg
    key = (json.dumps(cfg.to_dict(), sort_keys=True, default=str), str(model.dtype),
           float(model.lora_scale), getattr(model, "act_sharding", None))
    if key in _COMPILED:
        return _COMPILED[key]
    run = inference_run(model)

    def prefill(top, layers, tokens, positions, segment_ids, key, temperature, top_p, cache_len,
                per_layer=False, mode="nucleus"):
        # tokens/positions/segment_ids [B, P] left-padded: the last column is a real token in every row.
        # cache_len (static) fixes the cache shape. It hands the step a per-layer cache when the step runs
        # per-layer weights.
        cache = init_cache(cfg, tokens.shape[0], cache_len, run.dtype)
        last, cache = last_logits(cfg, run, top, layers, tokens, positions, segment_ids, cache, 0)  # [B, V]
        tok = sample_token(last, jax.random.fold_in(key, 0), temperature, top_p, mode)
        return tok, last, split_cache(cache) if per_layer else cache

    def step(top, layers, tok, pos, cache: KVCache, cache_index, i, key, temperature, top_p, mode="nucleus",
             unstack=False):
        # tok/pos [B]: the token just produced and its RoPE position; written at slot cache_index.
        # unstack: run the stacked layers as an unrolled loop over static slices (`Decoder`)
        if unstack:
            layers = layer_slices(layers)
        logits, cache = step_logits(cfg, run, top, layers, tok, pos, jnp.ones_like(tok), cache, cache_index)
        nxt = sample_token(logits, jax.random.fold_in(key, i), temperature, top_p, mode)
        return nxt, logits, cache

    # the cache is rewritten every step: donate it so XLA writes the new slot in place
    _COMPILED[key] = (jax.jit(prefill, static_argnames=("cache_len", "per_layer", "mode")),
                      jax.jit(step, donate_argnums=(4,), static_argnames=("mode", "unstack"),
                              compiler_options=backends.compiler_options("decode", cfg.hidden_size)))
    return _COMPILED[key]


def _per_row(value, batch: int, name: str) -> jax.Array:
    arr = np.broadcast_to(np.asarray(value, np.float32), (batch,))
    if name == "temperature" and not ((arr >= 0) & np.isfinite(arr)).all():  # NaN fails every comparison
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {value}")
    if name == "top_p" and not ((arr > 0) & (arr <= 1)).all():
        raise ValueError(f"top_p must be in (0, 1], got {value}")
    return jnp.asarray(arr)


def pack_prompts(prompt_ids: Sequence[Sequence[int]], pad_id: int = 0, bucket: int = PROMPT_BUCKET):
    """Left-pad prompts to a bucketed length -> (tokens, positions, segment_ids) int32 [B, P], lengths."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (got an empty prompt)")
    lens = np.array([len(p) for p in prompt_ids])
    P = _round_up(int(lens.max()), bucket)
    B = len(prompt_ids)
    tokens = np.full((B, P), pad_id, np.int32)
    seg = np.zeros((B, P), np.int32)
    for b, p in enumerate(prompt_ids):
        tokens[b, P - len(p):] = p
        seg[b, P - len(p):] = 1
    positions = np.maximum(np.cumsum(seg, axis=1) - 1, 0).astype(np.int32)  # real tokens count 0, 1, ...
    return tokens, positions, seg, lens


class Decoder:
    """Streaming batched decoding for one model. `stream` yields, per step, one new token id per row
    (None once that row has finished); `return_logits=True` yields (tokens, logits [B, V]) instead.
    per_layer=False keeps the stacked weights a backend would give per layer (`backends.prepare`).
    unstack=True runs stacked layers as a loop over static slices instead of a scan; the default (None)
    does so on a GPU, where a scan copies each layer out of the stack (slower to compile, faster to run)."""

    def __init__(self, model, *, eos_ids: Sequence[int] = (), pad_id: int = 0, per_layer: bool = True,
                 unstack: bool | None = None):
        self.model = expect_model(model, "Decoder")
        self.per_layer = per_layer
        self.unstack = on_gpu() if unstack is None else unstack
        self.eos_ids = tuple(sorted({int(e) for e in eos_ids}))
        self.pad_id = int(pad_id)
        if not 0 <= self.pad_id < model.cfg.vocab_size:  # it would be clamped into a real token: rows corrupted
            raise ValueError(f"pad_id {self.pad_id} is outside the model's vocabulary [0, {model.cfg.vocab_size})")
        self.prefill, self.step = _compiled(model)

    def stream(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int = 64, *,
               temperature=0.0, top_p=1.0, seed: int = 0, return_logits: bool = False
               ) -> Iterator[list]:
        # times[0]: start; times[k]: step k's tokens on the host; counts[k-1]: how many rows produced one
        self.times, self.counts = [time.perf_counter()], []
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if isinstance(prompt_ids, (str, bytes)) or not len(prompt_ids):
            raise TypeError("expected a list of prompts, each a list of token ids, got "
                            f"{type(prompt_ids).__name__}")
        prompt_ids = [token_ids(p, self.model.cfg.vocab_size, f"prompt {i}") for i, p in enumerate(prompt_ids)]
        if max_new_tokens < 1:
            return
        tokens, positions, seg, lens = pack_prompts(prompt_ids, self.pad_id)
        w = backends.prepare(*to_pure(self.model), rows=tokens.shape[0])
        step_layers = w.layers if self.per_layer else w.stacked
        per_layer = isinstance(step_layers, list)
        limit = self.model.cfg.max_position_embeddings
        if int(lens.max()) + max_new_tokens > limit:
            raise ValueError(f"prompt ({int(lens.max())} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context, max_position_embeddings={limit}")
        B, P = tokens.shape
        S = _round_up(P + max_new_tokens - 1, CACHE_BUCKET)  # the last new token is never written
        temp, tp = _per_row(temperature, B, "temperature"), _per_row(top_p, B, "top_p")
        mode = sampling_mode(temperature, top_p)  # the host's values, checked by _per_row
        unstack = not per_layer and self.unstack
        key = jax.random.PRNGKey(seed)
        prefill_layers = w.for_rows(B * P) if per_layer else step_layers
        tok, logits, cache = self.prefill(w.top, prefill_layers, tokens, positions, seg, key, temp, tp,
                                          cache_len=S, per_layer=per_layer or unstack, mode=mode)
        done = np.zeros(B, bool)
        eos = np.array(self.eos_ids, np.int64)
        # Pipelined: step i+1 is dispatched (asynchronously) on step i's tokens while they are still on
        # the device, and only then are step i's tokens read back, checked for EOS and yielded, so the
        # host's work overlaps the next step instead of idling the device between steps. A finished row
        # keeps decoding its own tokens (rows never mix, so the others are unaffected); they are dropped
        # here. When every row has finished, one step already dispatched is discarded.
        # The positions stay numpy: eager jnp ops here would each cost a dispatch a step.
        pos = lens.astype(np.int32)  # next RoPE position per row = its real prompt length
        for i in range(max_new_tokens):
            nxt = None
            if i < max_new_tokens - 1:
                nxt = self.step(w.top, step_layers, tok, pos, cache, P + i, i + 1, key, temp, tp, mode=mode,
                                unstack=unstack)
                cache = nxt[2]
                pos = pos + 1  # numpy
            host = np.asarray(tok)
            out = [None if d else int(t) for d, t in zip(done, host)]
            self.times.append(time.perf_counter())
            self.counts.append(sum(t is not None for t in out))
            done = done | np.isin(host, eos)
            yield (out, logits) if return_logits else out
            if done.all() or nxt is None:
                return
            tok, logits = nxt[0], nxt[1]

    def tokens_per_second(self) -> float:
        """Steady decode throughput of the last `stream`, all rows together: tokens from the third step
        on over their time, so neither compilation (first prefill and first step) nor the prefill
        counts; with fewer than 3 steps, all tokens over the whole time."""
        t, c = self.times, self.counts
        if len(c) >= 3:
            return sum(c[2:]) / max(t[-1] - t[2], 1e-9)
        return sum(c) / max(t[-1] - t[0], 1e-9) if c else 0.0


def generate_ids(model, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int = 64, *,
                 temperature=0.0, top_p=1.0, seed: int = 0, eos_ids: Sequence[int] | None = None,
                 pad_id: int = 0, keep_eos: bool = True, decoder: Decoder | None = None
                 ) -> list[list[int]]:
    """Token ids in, new token ids out (one list per prompt; EOS included unless keep_eos=False).
    Pass your own `decoder` to read its timings (`decoder.tokens_per_second()`) afterwards."""
    eos = model.cfg.eos_ids if eos_ids is None else eos_ids
    dec = decoder or Decoder(model, eos_ids=eos, pad_id=pad_id)
    out: list[list[int]] = [[] for _ in prompt_ids]
    for step in dec.stream(prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed):
        for row, t in enumerate(step):
            if t is not None:
                out[row].append(t)
    if not keep_eos:
        out = [[t for t in r if t not in set(dec.eos_ids)] for r in out]
    return out


def tokenizer_eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids = set(model.cfg.eos_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def generate(model, tokenizer, prompts: str | list[str], max_new_tokens: int = 64, temperature=0.0,
             top_p=1.0, seed: int = 0) -> list[dict]:
    """Prompts (tokenized as `tokenizer(prompt)`, BOS from the tokenizer) -> one dict per prompt:
    text, token_ids (new only), prompt_tokens, new_tokens, tokens_per_second."""
    expect_model(model, "generate")
    expect_tokenizer(tokenizer, "generate")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"generate: expected a prompt string or a list of them, got {type(prompts).__name__} "
                        "(token ids go to generate_ids)")
    prompt_ids = [list(tokenizer(p)["input_ids"]) for p in prompts]
    for p, ids in zip(prompts, prompt_ids):
        if not ids:
            raise ValueError(f"prompt {p!r} tokenizes to no tokens (and the tokenizer adds no BOS)")
    eos = tokenizer_eos_ids(model, tokenizer)
    dec = Decoder(model, eos_ids=eos, pad_id=pad_id(tokenizer))
    new = generate_ids(model, prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p,
                       seed=seed, decoder=dec)
    rate = dec.tokens_per_second()
    results = []
    for ids, toks in zip(prompt_ids, new):
        results.append({
            "text": tokenizer.decode([t for t in toks if t not in eos], skip_special_tokens=True),
            "token_ids": toks, "prompt_tokens": len(ids), "new_tokens": len(toks),
            # steady decode rate of the whole batch (compilation and prefill excluded; see Decoder)
            "tokens_per_second": rate,
        })
    return results


# --------------------------------------------------------------------------------------------------
# Loading a checkpoint (and an adapter) for generation, evaluation and serving
# --------------------------------------------------------------------------------------------------
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)  # --dtype of eval, generate and serve


def check_dtype(dtype: str) -> str:
    """dtype, if it is one of DTYPE_CHOICES (checked before anything is read: a bad flag is reported first)."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    return dtype


def resolve_dtype(dtype: str, model_dir, decoding: bool = True) -> str:
    """`--dtype auto` made concrete (other values as they are): what a checkpoint is held and computed in.
    On an accelerator, bfloat16. On a CPU a bfloat16 checkpoint stays bfloat16 (half the memory) for
    evaluation, and for decoding where the backend decodes bf16 fast (`backends.decodes_bf16`); everything
    else is computed in float32 there."""
    if check_dtype(dtype) != "auto":
        return dtype
    if jax.default_backend() != "cpu":
        return "bfloat16"
    raw = checkpoint.read_config(Path(model_dir))
    if raw.get("quantization_config") or checkpoint.stored_dtype(Path(model_dir)) != "bfloat16":
        return "float32"
    return "bfloat16" if not decoding or backends.decodes_bf16() else "float32"


def load_model(model_dir, adapter=None, dtype: str = "auto", allow_pickle: bool = False):
    """(model, tokenizer, model_dir): an HF or GPTQ checkpoint directory, with a PEFT adapter if given, held
    in `dtype` (`resolve_dtype`: "auto" picks what decodes fastest here). allow_pickle: also read pickled
    pytorch_model*.bin weights (tensors only)."""
    check_dtype(dtype)
    tokenizer = load_tokenizer(model_dir)  # first: a broken tokenizer is found in a second, not after the weights
    return load_weights(model_dir, adapter, dtype, allow_pickle), tokenizer, model_dir


def load_weights(model_dir, adapter=None, dtype: str = "auto", allow_pickle: bool = False, mesh=None,
                 rules=None, decoding: bool = True):
    """The model of `load_model` without its tokenizer (for callers that tokenize with `encode_fast`).
    With a mesh, each device reads only its blocks of the weights (`checkpoint.load(mesh=, rules=)`).
    decoding=False: "auto" chooses for evaluation (`resolve_dtype`). For decoding on one device, a GPTQ
    model's kernels are prepared for `qmatmul.default_route()` (the Pallas kernel on a GPU)."""
    dtype = resolve_dtype(dtype, model_dir, decoding)
    model = checkpoint.load(model_dir, dtype=DTYPES[dtype], allow_pickle=allow_pickle, mesh=mesh, rules=rules)
    if decoding and mesh is None:
        try:
            prepare_kernels(model, default_route())
        except QuantFormatError as e:  # groups that cannot be put in order: the reference reads them as they are
            warnings.warn(f"{model_dir}: {e}; decoding through the reference route instead")
    return load_adapter(model, adapter) if adapter is not None else model
