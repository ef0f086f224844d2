"""How a dataset's texts become token windows, for perplexity and for GPTQ calibration, by a named protocol:

  amdllm  (the default; docs/cli.md): the texts joined with blank lines and tokenized once; consecutive
          windows (the last partial one kept); calibration draws windows at random starts.
  gptq    the GPTQ paper's code (IST-DASLab/gptq `datautils.py`), rule by dataset: wikitext2 (joined
          with blank lines, full windows; random starts for calibration) and c4 (1,100 documents joined, the
          first 256 windows; calibration draws a document long enough, then one window in it)."""
from __future__ import annotations

import random
from typing import Callable, Sequence

import numpy as np

from amdllm.infer.evaluate import windows as amdllm_windows
from amdllm.quant.calibrate import calibration_windows, check_samples

PROTOCOLS = ("amdllm", "gptq")
C4_EVAL_DOCS, C4_EVAL_WINDOWS = 1100, 256
Encode = Callable[[str], Sequence[int]]


class ProtocolError(ValueError):
    """Texts that cannot give the windows asked for (too short); the message says how many there are."""


def _check(protocol: str, rule: str) -> None:
    if protocol not in PROTOCOLS:
        raise ProtocolError(f"--protocol {protocol!r}: expected one of {PROTOCOLS}")
    if rule not in ("wikitext2", "c4"):
        raise ProtocolError(f"rule {rule!r}: expected 'wikitext2' or 'c4'")


def eval_windows(texts: list[str], encode: Encode, seq_len: int, protocol: str = "amdllm",
                 rule: str = "wikitext2") -> tuple[list[np.ndarray], dict]:
    """(windows, report) of `texts` for perplexity. report: protocol, rule, tokens, windows, dropped."""
    _check(protocol, rule)
    if protocol == "amdllm":
        ids = np.asarray(encode("\n\n".join(texts)), np.int32)
        wins = amdllm_windows(ids, seq_len)
    else:
        joined = "\n\n".join(texts) if rule == "wikitext2" else " ".join(texts[:C4_EVAL_DOCS])
        ids = np.asarray(encode(joined), np.int32)
        if rule == "c4":
            ids = ids[:C4_EVAL_WINDOWS * seq_len]
        wins = [ids[i * seq_len:(i + 1) * seq_len] for i in range(len(ids) // seq_len)]
    if not wins:
        raise ProtocolError(f"the texts give {len(ids)} tokens, too few for one window of {seq_len} by the "
                            f"{protocol} protocol; pass a smaller --seq-len or a longer dataset")
    used = int(sum(len(w) for w in wins))
    return wins, {"protocol": protocol, "rule": rule if protocol == "gptq" else None,
                  "text_tokens": int(len(ids)), "windows": len(wins), "window_tokens": seq_len,
                  "dropped_tokens": int(len(ids)) - used}


def calib_windows(texts: list[str], encode: Encode, samples: int, seq_len: int, seed: int = 0,
                  protocol: str = "amdllm", rule: str = "c4") -> tuple[np.ndarray, dict]:
    """([samples, seq_len] int32 windows, report) for GPTQ calibration."""
    _check(protocol, rule)
    if protocol == "amdllm":
        wins = calibration_windows(encode("\n\n".join(texts)), samples, seq_len, seed)
        return wins, {"protocol": protocol, "rule": None, "samples": samples, "seed": seed}
    rng = random.Random(seed)  # the reference's random.seed(seed): the same Mersenne Twister sequence
    if rule == "wikitext2":
        ids = np.asarray(encode("\n\n".join(texts)), np.int32)
        if len(ids) <= seq_len:
            raise ProtocolError(f"the texts give {len(ids)} tokens; a calibration window needs more than {seq_len}")
        check_samples(samples, len(ids) - seq_len, seq_len)
        starts = [rng.randint(0, len(ids) - seq_len - 1) for _ in range(samples)]
        return (np.stack([ids[i:i + seq_len] for i in starts]),
                {"protocol": protocol, "rule": rule, "samples": samples, "seed": seed})
    # C4: a document is drawn until one has more than seq_len tokens. One that cannot (fewer UTF-8 bytes
    # than seq_len, give or take the special tokens) is never tokenized; none that can is an error, not a hang.
    if not any(len(t.encode()) + 2 > seq_len for t in texts):
        raise ProtocolError(f"no document of the {len(texts)} is long enough for a calibration window of "
                            f"{seq_len} tokens; pass a smaller --seq-len")
    out, draws, limit = [], 0, 1000 * samples
    for _ in range(samples):
        while True:
            draws += 1
            if draws > limit:
                raise ProtocolError(f"{limit} documents drawn and too few had more than {seq_len} tokens; pass "
                                    "a smaller --seq-len")
            doc = np.asarray(encode(texts[rng.randint(0, len(texts) - 1)]), np.int32)
            if len(doc) > seq_len:
                break
        i = rng.randint(0, len(doc) - seq_len - 1)
        out.append(doc[i:i + seq_len])
    return np.stack(out), {"protocol": protocol, "rule": rule, "samples": samples, "seed": seed,
                           "documents_drawn": draws}
