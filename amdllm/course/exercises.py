"""check("03.1", answer, model_dir=...): says whether an exercise's answer is right, in the notebook.

The right answer is computed here, from the lesson's own model and the package, never stored, so a
check holds on any model a lesson runs on. A wrong answer gets a hint, not the answer; the worked
solutions are in notebooks/solutions/. Exercises whose answer is a judgement (what helps, and why)
have no check: their solutions print the numbers to judge by.
"""
import functools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from amdllm import course
from amdllm.config import LlamaConfig, get_preset
from amdllm.io.checkpoint import TensorSource
from amdllm.parallel import plan
from amdllm.quant.calibrate import paper_bytes

TARGETS_ALL = "q,k,v,o,gate,up,down"
PRESET_MESHES = {"fsdp": {"fsdp": 8}, "tp": {"tensor": 2, "data": 4}, "fsdp_tp": {"fsdp": 4, "tensor": 2},
                 "dp": {"data": 8}}


@dataclass(frozen=True)
class Exercise:
    form: str                              # what the answer looks like, shown while it is None
    truth: Callable[[Path | None], Any]    # the right answer, computed from the lesson's model
    same: Callable[[Any, Any], bool]       # answer, truth -> right?
    hint: str                              # shown for a wrong answer


def _dir(model_dir) -> Path:
    return Path(model_dir) if model_dir else course.default_model_dir()


def _cfg(model_dir) -> LlamaConfig:
    return LlamaConfig.from_json(_dir(model_dir) / "config.json")


def _close(a, b, rel=0.005) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=rel)
    except (TypeError, ValueError):
        return False


def _words(a, b) -> bool:
    """Each expected word is in the answer's matching item (case and extra words do not matter)."""
    try:
        return len(a) == len(b) and all(any(w in str(x).lower() for w in ws) for x, ws in zip(a, b))
    except TypeError:
        return False


def _pairs(same_first: Callable, same_second: Callable) -> Callable:
    def same(a, b):
        try:
            return len(a) == 2 and same_first(a[0], b[0]) and same_second(a[1], b[1])
        except TypeError:
            return False
    return same


def _by_key(a, b) -> bool:
    return isinstance(a, dict) and set(a) == set(b) and all(_close(a[k], b[k]) for k in b)


@functools.lru_cache(maxsize=1)  # a fact of this machine: one doctor run per kernel
def _doctor(_):
    out = subprocess.run([sys.executable, "-m", "amdllm.cli", "doctor", "--json"], capture_output=True,
                         text=True, check=True).stdout
    report = json.loads(out)
    return report["backend"], len(report["jax"]["devices"])


@functools.lru_cache(maxsize=1)
def _xla_flag(_):
    """Device counts of two fresh CPU processes: the flag set before JAX starts, and set after."""
    code = ("import os, jax; {} jax.numpy.zeros(1); {} print(jax.device_count())")
    flag = "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4';"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    run = lambda c: int(subprocess.run([sys.executable, "-c", c], env=env, capture_output=True, text=True,
                                       check=True).stdout.strip())
    return run(code.format(flag, "")), run(code.format("", flag))


def _largest(model_dir):
    src = TensorSource(_dir(model_dir))
    sizes = {n: math.prod(src.shape(n)) * src.dtype(n).itemsize for n in src.names()}
    big = max(sizes, key=sizes.get)
    return big, sizes[big]


def _presets(model_dir):
    """(the rules preset with the fewest weight bytes per device on 8 devices, the one that needs no
    communication of the weights). Ties are listed together."""
    cfg = _cfg(model_dir)
    per = {r: plan.weight_bytes(cfg, {"data": 1, "fsdp": 1, "tensor": 1} | m, r, "float32")
           for r, m in PRESET_MESHES.items()}
    least = min(per.values())
    return tuple(sorted(r for r, b in per.items() if b == least)), "dp"


def _fewest_70b(_):
    shape = dict(lora_rank=16, batch_size=8, seq_len=4096, dtype="bfloat16")
    c70 = get_preset("llama-3.1-70b")
    return tuple(plan.fewest_devices(c70, 192, remat=r, most=64, **shape) for r in (False, True))


def _lora_counts(targets, ranks):
    def truth(model_dir):
        cfg = _cfg(model_dir)
        return {r: sum(math.prod(s) for s, _ in plan.lora_shapes(cfg, r, targets).values()) for r in ranks}
    return truth


def _paper(model_dir):
    cfg = _cfg(model_dir)
    return {g: paper_bytes(cfg, 3, g)["total_bytes"] for g in (-1, 64, 32)}


def _accum(_):
    return "equal"


def _accum_same(a, _):
    try:
        l1, l2, diff = (float(x) for x in a)
    except (TypeError, ValueError):
        return False
    return abs(l1 - l2) < 1e-5 and diff < 1e-5


EXERCISES = {
    "00.1": Exercise("(backend, number of devices) as `amdllm doctor --json` reports them in a terminal",
                     _doctor, _pairs(lambda a, b: str(a).lower() == b, lambda a, b: a == b),
                     "read the JSON's `backend` and the length of its `jax.devices` list"),
    "00.3": Exercise("(devices with the flag set before the first computation, devices with it set after)",
                     _xla_flag, lambda a, b: tuple(a) == b if isinstance(a, (tuple, list)) else False,
                     "run both cases in a fresh process: the flag is read once, when the CPU backend starts"),
    "01.1": Exercise("(name of the largest tensor in the checkpoint, its bytes on disk as an int)", _largest,
                     _pairs(lambda a, b: a == b, _close),
                     "compare shape x dtype size over every name of `checkpoint.TensorSource(model_dir)`"),
    "02.1": Exercise("(rules preset with the fewest weight bytes per device on 8 devices, the preset that "
                     "needs no communication of the weights)", _presets,
                     _pairs(lambda a, b: str(a).lower() in b, lambda a, b: str(a).lower() == b),
                     "sum `bytes_per_device` of `sharding.sharding_table` for each preset on its 8-device mesh; "
                     "a preset that replicates every weight never moves one"),
    "02.3": Exercise("(fewest MI300X without remat, fewest with remat); None where no count up to 64 fits",
                     _fewest_70b, lambda a, b: isinstance(a, (tuple, list)) and tuple(a) == b,
                     "use `plan.fewest_devices(get_preset('llama-3.1-70b'), 192, remat=..., lora_rank=16, "
                     "batch_size=8, seq_len=4096, dtype='bfloat16')`"),
    "03.1": Exercise("{1: trained parameters at rank 1, 8: ..., 32: ...} with all seven targets",
                     _lora_counts(TARGETS_ALL, (1, 8, 32)), _by_key,
                     "each target of each layer adds A [in, r] and B [r, out]: r x (in + out) parameters"),
    "03.2": Exercise("{8: trained parameters at rank 8 with targets q,v only}", _lora_counts("q,v", (8,)),
                     _by_key, "q maps hidden -> heads x head_dim, v maps hidden -> kv_heads x head_dim"),
    "03.3": Exercise("(loss of 1 x 16 rows, loss of 2 x 8 rows, max difference of the updated factors)",
                     _accum, _accum_same,
                     "the loss must be normalised over the whole step's answer tokens, not per micro-batch"),
    "04.2": Exercise("{-1: bytes on paper at 3 bits, 64: ..., 32: ...} for the group sizes -1, 64, 32",
                     _paper, _by_key, "`quant.paper_bytes(cfg, 3, group_size)['total_bytes']`"),
    "05.1": Exercise("(the parameter that makes the continuations differ, what top_p=0.01 reduces to)",
                     lambda _: (("seed",), ("greedy", "argmax")), _words,
                     "temperature and top_p are the same for all three; and a tiny top_p keeps one token"),
}


def check(exercise: str, answer: Any = None, *, model_dir=None) -> bool | None:
    """Print whether `answer` to `exercise` ("03.1") is right for the lesson's model (`model_dir`, the
    course's model when None); return True or False, or None while the answer is still None."""
    if exercise not in EXERCISES:
        raise KeyError(f"no check for exercise {exercise!r}; checked ones: {', '.join(EXERCISES)}")
    ex = EXERCISES[exercise]
    if answer is None:
        print(f"{exercise}: no answer yet. Expected: {ex.form}.")
        return None
    ok = bool(ex.same(answer, ex.truth(model_dir)))
    print(f"{exercise}: right." if ok else f"{exercise}: not yet. Hint: {ex.hint}.")
    return ok
