"""glibc's malloc, set for XLA:CPU: huge pages for its large blocks, and freed blocks kept in the heap.

XLA:CPU allocates a training step's temporaries afresh every step, so how malloc maps, faults in and hands
back large blocks shows in the step's speed and in the process's peak memory:
  * `malloc_env`: the environment the `amdllm` command re-executes itself in, with glibc.malloc.hugetlb=1
    (glibc reads GLIBC_TUNABLES only when a process starts);
  * `keep_heap`: `amdllm finetune` keeps freed blocks in the heap once its step is compiled;
  * `hand_back_freed`: and hands back, once, a freed block the next step cannot reuse.
`amdllm doctor` reports what this process has (`huge_page_facts`).
"""
from __future__ import annotations

import ctypes
import os
import re
import sys

HUGETLB = "glibc.malloc.hugetlb"  # glibc >= 2.35: 1 = madvise(MADV_HUGEPAGE) on the large blocks malloc maps
# freed blocks stay in the heap: as tunables (a peer's environment in the benchmarks), and as what `keep_heap`
# sets through mallopt (glibc's malloc.h: M_MMAP_MAX -4, M_TRIM_THRESHOLD -1, whose -1 turns trimming off)
HEAP_KEPT = {"glibc.malloc.mmap_max": "0", "glibc.malloc.trim_threshold": str(64 << 30)}
HEAP_KEPT_MALLOPT = ((-4, 0), (-1, -1))
TOP_KEPT = 1 << 62  # malloc_trim's pad: the free top of the heap it leaves, here all of it (`hand_back_freed`)
TRAINING_COMMANDS = ("finetune",)  # the commands that run a training step: they keep freed blocks (`keep_heap`)
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
REEXEC_ENV = "AMDLLM_REEXEC"  # set in a command `amdllm` re-executed with HUGETLB: it never re-executes again


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library's glibc, e.g. (2, 36); None off glibc (macOS, musl)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):  # no confstr, the name unknown here, or None returned
        return None


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode: "always", "madvise" or "never"; None where not Linux."""
    try:
        with open(path) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def malloc_tunables(environ) -> dict[str, str]:
    """The glibc tunables GLIBC_TUNABLES ("name=value:name=value") names, name -> value."""
    items = (item.partition("=") for item in (environ.get("GLIBC_TUNABLES") or "").split(":"))
    return {name.strip(): value.strip() for name, _, value in items if name.strip()}


def appended_tunables(environ, tunables: dict[str, str]) -> str:
    """GLIBC_TUNABLES as `environ` has it, with `tunables` (name -> value) appended."""
    own = [t for t in (environ.get("GLIBC_TUNABLES") or "").split(":") if t]
    return ":".join(own + [f"{k}={v}" for k, v in tunables.items()])


def malloc_off(environ) -> bool:
    """Whether AMDLLM_HUGETLB=0 turns off what `amdllm` does to malloc (`malloc_env`, `keep_heap`)."""
    return (environ.get("AMDLLM_HUGETLB") or "").strip() == "0"


def malloc_hugetlb(environ) -> str | None:
    """The value GLIBC_TUNABLES gives glibc.malloc.hugetlb; None where unnamed."""
    return malloc_tunables(environ).get(HUGETLB)


def malloc_env(environ) -> dict | None:
    """The environment to re-execute the `amdllm` command in with the glibc malloc tunable it wants, or None
    where nothing changes: not Linux, AMDLLM_HUGETLB=0, already re-executed once (REEXEC_ENV), or the
    tunable named already (any value: the user's choice).

    glibc.malloc.hugetlb=1, every command, where glibc >= 2.35 and THP is "madvise" or "always": XLA:CPU
    allocates a training step's temporaries afresh every step; faulting them in 4 KB pages cost ~1 s of
    kernel time per 3.5 s step (the benchmark LoRA step on an older machine and code, both sides in the
    same environment: 0.96x PEFT without, 1.07x with; README, "CPU speed on Linux"). PyTorch does not
    always gain: the benchmarks run the peer in several environments (benchmarks/common.py).
    glibc reads the variable only when the process starts, hence a new process. (Freed blocks kept in the
    heap, which a training step also wants, are set later, by `keep_heap`.)"""
    if not sys.platform.startswith("linux") or environ.get(REEXEC_ENV) or malloc_off(environ):
        return None
    if (glibc_version() or (0, 0)) < (2, 35) or thp_mode() not in ("madvise", "always"):
        return None
    if HUGETLB in malloc_tunables(environ):
        return None
    return {**environ, "GLIBC_TUNABLES": appended_tunables(environ, {HUGETLB: "1"}), REEXEC_ENV: "1"}


def _heap_ours(environ) -> bool:
    """Whether `amdllm` may set how glibc's heap keeps freed blocks: glibc 2.26 or newer, not turned off by
    AMDLLM_HUGETLB=0, and neither HEAP_KEPT setting named in GLIBC_TUNABLES (the user's choice)."""
    return ((glibc_version() or (0, 0)) >= (2, 26) and not malloc_off(environ)
            and not any(k in malloc_tunables(environ) for k in HEAP_KEPT))


def keep_heap(environ=None) -> bool:
    """From now on keep the blocks this process frees in glibc's heap (HEAP_KEPT, set by mallopt), after
    handing the free pages the heap holds now back to the kernel (malloc_trim); True where done.
    `amdllm finetune` calls it once its step is compiled, before the first step.

    Why keep: malloc maps every block over 32 MB (its largest mmap threshold) afresh and unmaps it on free,
    so each training step faults its large temporaries in again (the 1B step: a [256, 128256] float32
    logits buffer); kept, the next step reuses them (the 1B step on a 2-core Zen 4: 47.6-54.1 -> 54.9-59.1
    tokens/s; docs/benchmark-history.md, "VDPBF16PS and the kept heap"). Why only now: kept from the start
    (as GLIBC_TUNABLES), the compiler's freed memory stays in the heap too. A kept heap can hold a freed
    block that no later request fits (`hand_back_freed` says why); the training loop hands its pages back
    once, after the first step. Not for a notebook's kernel, which would keep its peak for the rest of its
    life.
    Skipped (False): without glibc 2.26 or newer, with AMDLLM_HUGETLB=0, or where GLIBC_TUNABLES names
    either setting (the user's choice)."""
    if not _heap_ours(os.environ if environ is None else environ):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: glibc's malloc
        libc.malloc_trim(0)
        return all(libc.mallopt(param, value) == 1 for param, value in HEAP_KEPT_MALLOPT)
    except (OSError, AttributeError):
        return False


def hand_back_freed(environ=None) -> bool:
    """Hand the pages of the heap's free blocks back to the kernel, but not the free top of the heap
    (`malloc_trim` with a pad no heap reaches); True where done. The training loop calls it between its
    first and second step after `keep_heap`, and after each evaluation.

    Why: XLA:CPU takes a step's temporaries as one aligned block (the 1B bf16 step: 885 MB, from
    posix_memalign). glibc (2.36 here) serves an aligned request of n bytes from a free block of at least
    n + alignment + 32 bytes and hands the few bytes past the block back as a small free block. While that
    small block is held (by a later allocation, or in glibc's per-thread cache of small blocks, which does
    not merge), the freed block stays exactly n bytes, too small for the next step's same request. The
    second step then takes a new block and the first stays in the kept heap, resident and never used
    again: the 1B step's peak RSS was 4.85 GB in such runs and 4.02-4.10 GB in the others (2-core
    Intel Xeon, glibc 2.36; docs/benchmark-history.md, "session 39"). Handed back, the block costs
    nothing where it is not reused, and one page fault per page where it is.
    Skipped (False) where `keep_heap` would be."""
    if not _heap_ours(os.environ if environ is None else environ):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim(TOP_KEPT)
        return True
    except (OSError, AttributeError):
        return False


def huge_page_facts() -> dict:
    """glibc's huge-page malloc in this process (its GLIBC_TUNABLES; a change to os.environ after the start
    would not reach malloc, and /proc/self/environ is no witness: glibc 2.36 cuts it after the first
    tunable), the kernel's THP mode and the glibc version."""
    tunables = os.environ.get("GLIBC_TUNABLES")
    glibc = glibc_version()
    return {"malloc_hugetlb": malloc_hugetlb({"GLIBC_TUNABLES": tunables}) == "1", "glibc_tunables": tunables,
            "glibc": ".".join(map(str, glibc)) if glibc else None, "thp": thp_mode()}
