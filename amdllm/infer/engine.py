"""The serving engine: one worker thread, continuous batching of queued requests on a shared KV cache.

Every row writes its next token at the same slot, so one jitted step serves the batch; a new request is
prefilled alone into a free row, left-aligned to end just before that slot, and joins the next step.
Each row keeps its own RoPE positions, so a request gets the same tokens alone or in a crowd (tested
against `generate`). The cache grows by powers of two, shifts left when its tail is short, and a step
runs only the active rows (rounded up to a power of two). Sampling is `generate`'s, key schedule
included. The worker talks to the HTTP layer through callbacks (`Request.emit`)."""
from __future__ import annotations

import collections
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from amdllm.infer.batch_cache import HeldCache, pad_slots, put_row, roll_slots, row_of
from amdllm.infer.decode import inference_run, last_logits, sample_rows, sampling_mode, step_logits
from amdllm.model import KVCache, to_pure
from amdllm import backends
from amdllm.model.fast import init_cache, layer_slices
from amdllm.io.tokenizer import pad_id as tokenizer_pad_id

log = logging.getLogger("amdllm.infer.engine")
MIN_PREFILL_BUCKET = 16
MIN_CACHE_SLOTS = 256


@dataclass
class Request:
    """One generation. `emit(kind, payload)` is called from the worker thread:
    ("delta", {"text", "token_ids"}) any number of times, then exactly one ("done", {...}) or ("error", msg)."""
    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[str, object], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Row:
    req: Request
    start: int                 # first cache slot of the prompt (for shifting)
    pos: int                   # RoPE position of the next token fed
    key: np.ndarray            # PRNG key data [2] uint32
    stream: "TextStream"
    out_ids: list[int] = field(default_factory=list)
    pending: int = 0           # last sampled token, fed at the next step
    pending_eos: int = -1      # the EOS token that ended the row
    unsent: list[int] = field(default_factory=list)  # token ids whose text is held back so far


class TextStream:
    """Incremental detokenization with stop strings: `push(ids) -> (delta, stopped)`, `flush()`."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.text, self.sent = "", 0

    def push(self, ids: list[int]) -> tuple[str, bool]:
        self.text = self.tok.decode(ids, skip_special_tokens=True)
        if self.stop:
            lo = max(0, self.sent - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
            if hits:  # cut at the first stop string: it and what follows are never sent
                self.text = self.text[:min(hits)]
                return self._take(len(self.text)), True
        safe = len(self.text)
        if self.text.endswith("\ufffd"):  # a multi-byte character cut in half: wait for its rest
            safe = len(self.text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that may be the start of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        return self._take(max(safe, self.sent)), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return delta


def _pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the buckets that bound how often a step compiles."""
    return 1 << (max(n, 1) - 1).bit_length()


class Engine:
    """Owns the model, the batch cache and the worker thread. `submit(req)` is thread-safe."""

    def __init__(self, model, tokenizer, *, max_batch: int = 8, max_len: int | None = None,
                 eos_ids=None, pad_id: int | None = None, unstack: bool = False):
        cfg = model.cfg
        self.cfg, self.tokenizer = cfg, tokenizer
        self.B = int(max_batch)
        self.S = int(min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings))
        if self.B < 1 or self.S < 2:
            raise ValueError(f"max_batch must be >= 1 and max_len >= 2, got {self.B} and {self.S}")
        if eos_ids is None:
            eos_ids = set(cfg.eos_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        self.eos = frozenset(int(e) for e in eos_ids)
        self.pad = int(pad_id) if pad_id is not None else tokenizer_pad_id(tokenizer)
        # the weights as the backend's kernels read them (`backends.prepare`): per-layer ones keep a
        # per-layer cache. unstack=True: the step runs stacked weights as a loop over static slices instead
        # of a scan, as `Decoder(unstack=)` does on a GPU (benchmarks/gpu.py, serve_engine)
        self.unstack = bool(unstack)
        self.w = backends.prepare(*to_pure(model), rows=self.B)
        self.per_layer = self.w.per_layer and not self.unstack
        self.dtype = model.dtype
        self.held = HeldCache(self.dtype)
        self._build(model)
        self.cache = self._new_cache(self._slots(1))
        self.rows: list[_Row | None] = [None] * self.B
        self.c = 0  # next cache slot every active row writes
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: collections.deque[Request] = collections.deque()
        # what the tests and the benchmark read: batch sizes seen in decode steps
        self.stats = {"requests": 0, "decode_steps": 0, "tokens": 0, "max_batch_seen": 0, "cancelled": 0,
                      "batch_hist": collections.Counter(), "shifts": 0, "moves": 0,
                      "step_rows": collections.Counter()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="amdllm-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- compiled pure functions
    def _build(self, model):
        cfg, run = self.cfg, inference_run(model)

        def sample(logits, keys, k, temp, top_p, mode):
            # logits [B, V], keys [B, 2], k [B] token index per row -> [B]. generate's key schedule: a
            # request's token k draws with fold_in(fold_in(its key, k), 0), row 0 of a batch of one
            row_keys = jax.vmap(lambda key, i: jax.random.fold_in(jax.random.fold_in(key, i), 0))(keys, k)
            return sample_rows(logits, row_keys, temp, top_p, mode)

        held = self.held
        as_floats = lambda c: jax.tree.map(lambda x: held.release(x, self.dtype), c)  # noqa: E731
        as_held = lambda c: jax.tree.map(held.hold, c)  # noqa: E731

        def prefill(top, layers, cache, row, tokens, positions, seg, start, key, temp, top_p, mode):
            # one request into cache row `row`: tokens/positions/seg [1, P] left-padded, written at
            # slots [start, start+P); the row's other slots become invalid
            S = cache.valid.shape[1]
            sub = KVCache(as_floats(row_of(cache.k, row)), as_floats(row_of(cache.v, row)), jnp.zeros((1, S), bool))
            last, sub = last_logits(cfg, run, top, layers, tokens, positions, seg, sub, start)   # [1, V]
            cache = KVCache(put_row(cache.k, as_held(sub.k), row), put_row(cache.v, as_held(sub.v), row),
                            jax.lax.dynamic_update_slice(cache.valid, sub.valid, (row, 0)))
            tok = sample(last, key[None], jnp.zeros((1,), jnp.int32), temp, top_p, mode)
            return tok[0], cache

        def step(top, layers, cache, tok, pos, active, c, keys, k, temp, top_p, mode):
            # tok/pos/active/k/temp/top_p [n]: the cache's first n rows; every row writes slot c; inactive
            # rows stay invalid
            n = tok.shape[0]
            if self.unstack:
                layers = layer_slices(layers)
            sub = KVCache(as_floats(row_of(cache.k, 0, n)), as_floats(row_of(cache.v, 0, n)), cache.valid[:n])
            logits, sub = step_logits(cfg, run, top, layers, tok, pos, active, sub, c)     # [n, V]
            cache = KVCache(put_row(cache.k, as_held(sub.k), 0), put_row(cache.v, as_held(sub.v), 0),
                            jax.lax.dynamic_update_slice(cache.valid, sub.valid, (0, 0)))
            return sample(logits, keys, k, temp, top_p, mode), cache

        def move(cache, src, dst):  # row src's slots into row dst
            valid = jax.lax.dynamic_slice_in_dim(cache.valid, src, 1)
            return KVCache(put_row(cache.k, row_of(cache.k, src), dst), put_row(cache.v, row_of(cache.v, src), dst),
                           jax.lax.dynamic_update_slice(cache.valid, valid, (dst, 0)))

        def shift(cache, m):  # move every row's slots m to the left; wrapped-in slots are invalid
            S = cache.valid.shape[1]
            valid = jnp.roll(cache.valid, -m, axis=1) & (jnp.arange(S) < S - m)[None]
            return KVCache(roll_slots(cache.k, -m), roll_slots(cache.v, -m), valid)

        # the cache is donated (XLA updates it in place); mode (decode.sampling_mode) is static
        self._prefill = jax.jit(prefill, donate_argnums=(2,), static_argnames=("mode",))
        self._step = jax.jit(step, donate_argnums=(2,), static_argnames=("mode",),
                             compiler_options=backends.compiler_options("decode", cfg.hidden_size))
        self._shift = jax.jit(shift, donate_argnums=(0,))
        self._move = jax.jit(move, donate_argnums=(0,))
        self._grow = jax.jit(lambda cache, n: KVCache(pad_slots(cache.k, n), pad_slots(cache.v, n),
                                                      jnp.pad(cache.valid, [(0, 0), (0, n)])),
                             static_argnums=(1,), donate_argnums=(0,))

    def _slots(self, n: int) -> int:
        """The cache length for n slots: a power of two, at least MIN_CACHE_SLOTS, at most max_len."""
        return min(self.S, max(MIN_CACHE_SLOTS, _pow2(n)))

    def _new_cache(self, slots: int) -> KVCache:
        c = init_cache(self.cfg, self.B, slots, self.dtype, per_layer=self.per_layer or self.unstack)
        return KVCache(jax.tree.map(self.held.hold, c.k), jax.tree.map(self.held.hold, c.v), c.valid)

    def _reserve(self, n: int) -> None:
        """Make the cache at least n slots long (rows keep their slots: new ones are added at the end)."""
        have = self.cache.valid.shape[1]
        if n > have:
            self.cache = self._grow(self.cache, self._slots(n) - have)

    # ---------------------------------------------------------------- public API
    def submit(self, req: Request) -> None:
        if not req.prompt_ids:
            raise ValueError("the prompt has no tokens")
        if len(req.prompt_ids) + req.max_tokens > self.S:
            raise ValueError(f"prompt ({len(req.prompt_ids)}) + max_tokens ({req.max_tokens}) exceeds "
                             f"the context of {self.S} tokens")
        if self._stop.is_set():
            raise RuntimeError("the engine is stopped")
        self.inbox.put(req)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

    def warmup(self) -> None:
        """Compile the decode step and the smallest prefill now rather than on the first request."""
        done = threading.Event()
        self.submit(Request([self.pad], 2, lambda kind, _: kind != "delta" and done.set()))
        done.wait(600)

    # ---------------------------------------------------------------- worker
    def _run(self):
        while not self._stop.is_set():
            try:
                active = any(r is not None for r in self.rows)
                self._drain_inbox(block=not active and not self.waiting)
                self._admit()
                if any(r is not None for r in self.rows):
                    self._decode()
                elif self.waiting:  # nothing runs and the head still does not fit: cannot happen
                    self._fail(self.waiting.popleft(), "request does not fit the cache")
            except Exception as e:  # a model error fails the requests in flight, not the server
                log.exception("engine step failed")
                for i, r in enumerate(self.rows):
                    if r is not None:
                        self._fail(r.req, f"generation failed: {type(e).__name__}: {e}")
                        self.rows[i] = None
                self.cache = self._new_cache(self._slots(1))
                self.c = 0

    def _drain_inbox(self, block: bool):
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if item is not None:
                    self.waiting.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self):
        while self.waiting and None in self.rows:
            req = self.waiting[0]
            if req.cancelled.is_set():
                self.waiting.popleft()
                self.stats["cancelled"] += 1
                continue
            if not self._place(req):
                return  # first in, first served: later requests wait behind the head
            self.waiting.popleft()

    def _place(self, req: Request) -> bool:
        P = len(req.prompt_ids)
        Pb = max(P, min(max(MIN_PREFILL_BUCKET, _pow2(P)), self.S - req.max_tokens))
        active = [r for r in self.rows if r is not None]
        if not active:
            self.c = 0
            if self.cache.valid.shape[1] > self._slots(1):  # idle: give back what a long request took
                self.cache = self._new_cache(self._slots(1))
        c = max(self.c, Pb)

        # a row with g tokens out writes max_tokens - g more slots (c, c+1, ...); the newcomer will have
        # 1 token out of its prefill
        rest = max([r.req.max_tokens - len(r.out_ids) for r in active] + [req.max_tokens - 1])

        def need(c):
            return c + rest <= self.S
        if not need(c):
            m = min([r.start for r in active] + [c - Pb])
            if m > 0 and need(c - m):
                self.cache = self._shift(self.cache, jnp.int32(m))
                self.stats["shifts"] += 1
                for r in active:
                    r.start -= m
                self.c -= m
                c -= m
            else:
                return False
        self.c = c
        self._reserve(c + rest)
        row = self.rows.index(None)
        toks = np.full((1, Pb), self.pad, np.int32)
        seg = np.zeros((1, Pb), np.int32)
        toks[0, Pb - P:], seg[0, Pb - P:] = req.prompt_ids, 1
        positions = np.maximum(np.cumsum(seg, axis=1) - 1, 0).astype(np.int32)
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        key = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
        tok, self.cache = self._prefill(self.w.top, self.w.for_rows(Pb) if self.per_layer else self.w.stacked, self.cache,
                                        jnp.int32(row), toks, positions, seg, jnp.int32(c - Pb), key,
                                        np.float32([req.temperature]), np.float32([req.top_p]),
                                        mode=sampling_mode(req.temperature, req.top_p))
        self.rows[row] = _Row(req, start=c - Pb, pos=P, key=key, stream=TextStream(self.tokenizer, req.stop))
        self.stats["requests"] += 1
        self._accept(row, int(tok))
        return True

    def _compact(self):
        """Move the last active rows into the free rows before them: the active rows become the first n."""
        while True:
            active = [i for i, r in enumerate(self.rows) if r is not None]
            holes = [i for i in range(len(active)) if self.rows[i] is None]
            if not holes:
                return
            src, dst = active[-1], holes[0]
            self.cache = self._move(self.cache, jnp.int32(src), jnp.int32(dst))
            self.rows[dst], self.rows[src] = self.rows[src], None
            self.stats["moves"] += 1

    def _decode(self):
        self._compact()
        n = sum(r is not None for r in self.rows)
        nb = min(self.B, _pow2(n))  # the rows this step runs
        tok, pos, act, k = (np.full(nb, self.pad, np.int32), np.zeros(nb, np.int32), np.zeros(nb, bool),
                            np.zeros(nb, np.int32))
        keys, temp, top_p = np.zeros((nb, 2), np.uint32), np.zeros(nb, np.float32), np.ones(nb, np.float32)
        for i, r in enumerate(self.rows[:nb]):
            if r is not None:
                tok[i], pos[i], act[i], k[i], keys[i] = r.pending, r.pos, True, len(r.out_ids), r.key
                temp[i], top_p[i] = r.req.temperature, r.req.top_p
        nxt, self.cache = self._step(self.w.top, self.w.layers if self.per_layer else self.w.stacked, self.cache, tok, pos, act, jnp.int32(self.c),
                                     keys, k, temp, top_p, mode=sampling_mode(temp, top_p))
        nxt = np.asarray(nxt)  # the one device->host copy per step
        self.c += 1
        n = int(act.sum())
        self.stats["decode_steps"] += 1
        self.stats["batch_hist"][n] += 1
        self.stats["step_rows"][nb] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], n)
        for i, r in enumerate(self.rows):
            if r is not None:
                r.pos += 1
                self._accept(i, int(nxt[i]))

    def _accept(self, row: int, token: int):
        """Record one sampled token for a row; emit text; finish the row on EOS, stop string or limit."""
        r = self.rows[row]
        req = r.req
        if req.cancelled.is_set():  # its client went away: the row is free for the next request
            self.rows[row] = None
            self.stats["cancelled"] += 1
            return
        self.stats["tokens"] += 1
        if token in self.eos:
            r.pending_eos = token
            return self._finish(row, "stop", eos=True)
        r.out_ids.append(token)
        r.unsent.append(token)
        r.pending = token
        delta, stopped = r.stream.push(r.out_ids)
        if delta:
            req.emit("delta", {"text": delta, "token_ids": r.unsent})
            r.unsent = []
        if stopped:
            return self._finish(row, "stop")
        if len(r.out_ids) >= req.max_tokens:
            return self._finish(row, "length")

    def _finish(self, row: int, reason: str, eos: bool = False):
        r = self.rows[row]
        self.rows[row] = None
        tail = r.stream.flush()  # text held back as a possible stop-string start, or a cut character
        if tail or r.unsent:
            r.req.emit("delta", {"text": tail, "token_ids": r.unsent})
        n_out = len(r.out_ids) + (1 if eos else 0)  # the EOS token was generated too
        ids = r.out_ids + ([r.pending_eos] if eos else [])  # like generate: token_ids include the EOS
        r.req.emit("done", {"finish_reason": reason, "text": r.stream.text, "token_ids": ids,
                            "prompt_tokens": len(r.req.prompt_ids), "completion_tokens": n_out})

    @staticmethod
    def _fail(req: Request, msg: str):
        req.emit("error", msg)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())
