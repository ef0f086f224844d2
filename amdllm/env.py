"""`amdllm doctor`: which backend JAX really uses, the devices and their memory, versions, and warnings.

The failure this exists for: on a ROCm (or CUDA) machine `pip install jax` gives a CPU-only JAX, which
runs everything — slowly — without a word. So the check is split in two:
  * `collect_facts()` gathers plain facts (device nodes, env vars, versions, what JAX and PyTorch see);
  * `diagnose(facts)` is a pure function from those facts to warnings, so tests can feed any machine
    ("/dev/kfd exists, torch.version.hip = '6.2', JAX backend cpu") and check the advice.
Also here: `malloc_env`, whether the `amdllm` command re-executes itself with glibc malloc tunables (huge
pages), and `keep_heap`, how `amdllm finetune` keeps freed blocks in the heap once its step is compiled.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.metadata as md
import importlib.util
import os
import platform
import re
import shutil
import sys

PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers", "peft", "tokenizers",
            "safetensors")
ENV_VARS = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS",
            "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS", "HSA_OVERRIDE_GFX_VERSION")
GPU_FIX = ("install the JAX GPU plugin that matches your jaxlib version — ROCm: "
           "`pip install jax[rocm]` (the jax-rocm*-plugin and jax-rocm*-pjrt wheels, same version as "
           "jaxlib) or run in the `rocm/jax` container; CUDA: `pip install jax[cuda12]` — then check "
           "that `python -c 'import jax; print(jax.devices())'` lists the GPUs")
HUGETLB = "glibc.malloc.hugetlb"  # glibc >= 2.35: 1 = madvise(MADV_HUGEPAGE) on the large blocks malloc maps
# freed blocks stay in the heap: as tunables (a peer's environment in the benchmarks), and as what `keep_heap`
# sets through mallopt (glibc's malloc.h: M_MMAP_MAX -4, M_TRIM_THRESHOLD -1, whose -1 turns trimming off)
HEAP_KEPT = {"glibc.malloc.mmap_max": "0", "glibc.malloc.trim_threshold": str(64 << 30)}
HEAP_KEPT_MALLOPT = ((-4, 0), (-1, -1))
TOP_KEPT = 1 << 62  # malloc_trim's pad: the free top of the heap it leaves, here all of it (`hand_back_freed`)
TRAINING_COMMANDS = ("finetune",)  # the commands that run a training step: they keep freed blocks (`keep_heap`)
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
REEXEC_ENV = "AMDLLM_REEXEC"  # set in a command `amdllm` re-executed with HUGETLB: it never re-executes again


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _gpu_plugins() -> dict[str, str]:
    """Installed JAX GPU plugin distributions (jax-rocm7-plugin, jax-cuda12-pjrt, ...) -> version."""
    out = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(("jax-rocm", "jax-cuda", "jaxlib-rocm")):
            out[name] = dist.version
    return out


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _jax_facts() -> dict:
    import jax  # here, not at the top: `doctor` must still report when importing JAX itself is what fails
    f: dict = {"backend": None, "platform_version": None, "devices": [], "error": None}
    try:
        f["backend"] = jax.default_backend()
        devs = jax.devices()
    except Exception as e:  # a broken plugin raises here; that is itself the diagnosis
        f["error"] = f"{type(e).__name__}: {e}"
        return f
    try:
        f["platform_version"] = devs[0].client.platform_version
    except Exception:
        pass
    for d in devs:
        info = {"id": d.id, "platform": d.platform, "kind": getattr(d, "device_kind", ""),
                "memory_bytes": None, "memory_in_use_bytes": None}
        try:
            stats = d.memory_stats() or {}
            info["memory_bytes"] = stats.get("bytes_limit")
            info["memory_in_use_bytes"] = stats.get("bytes_in_use")
        except Exception:  # CPU devices have no memory stats
            pass
        f["devices"].append(info)
    return f


def _torch_facts() -> dict:
    """What PyTorch sees, if it is installed. `torch.cuda.is_available()` only counts devices (no
    context is created, no memory allocated); ROCm builds of PyTorch answer through the same API."""
    if importlib.util.find_spec("torch") is None:
        return {"installed": False}
    try:
        import torch  # optional: only if installed (find_spec above)
        return {"installed": True, "version": torch.__version__, "hip": getattr(torch.version, "hip", None),
                "cuda": getattr(torch.version, "cuda", None), "gpu_available": bool(torch.cuda.is_available()),
                "gpu_count": int(torch.cuda.device_count()) if torch.cuda.is_available() else 0}
    except Exception as e:
        return {"installed": True, "error": f"{type(e).__name__}: {e}"}


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
    (`malloc_trim` with a pad no heap reaches); True where done. The training loop calls it once, between
    its first and second step after `keep_heap`.

    Why: XLA:CPU takes a step's temporaries as one aligned block (the 1B bf16 step: 885 MB, from
    posix_memalign). glibc (2.36 here) serves an aligned request of n bytes from a free block of at least
    n + alignment + 32 bytes and hands the few bytes past the block back; where a small allocation that
    outlives the step takes them, the freed block is exactly n bytes, too small for the next step's same
    request. The second step then takes a new block and the first stays in the kept heap, resident and never
    used again: the 1B step's peak RSS was 4.85 GB in such runs and 4.02-4.10 GB in the others (2-core
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


def _huge_page_facts() -> dict:
    """glibc's huge-page malloc in this process (its GLIBC_TUNABLES; a change to os.environ after the start
    would not reach malloc, and /proc/self/environ is no witness: glibc 2.36 cuts it after the first
    tunable), the kernel's THP mode and the glibc version."""
    tunables = os.environ.get("GLIBC_TUNABLES")
    glibc = glibc_version()
    return {"malloc_hugetlb": malloc_hugetlb({"GLIBC_TUNABLES": tunables}) == "1", "glibc_tunables": tunables,
            "glibc": ".".join(map(str, glibc)) if glibc else None, "thp": thp_mode()}


def collect_facts() -> dict:
    """Every fact `diagnose` looks at, as plain JSON-able data."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host_memory_bytes": _host_memory(),
        "cpu_count": os.cpu_count(),
        "versions": {p: _version(p) for p in PACKAGES},
        "jax_gpu_plugins": _gpu_plugins(),
        "jax": _jax_facts(),
        "torch": _torch_facts(),
        "system": {
            "dev_kfd": os.path.exists("/dev/kfd"),
            "dev_kfd_rw": os.access("/dev/kfd", os.R_OK | os.W_OK),
            "dev_dri_render": sorted(glob.glob("/dev/dri/renderD*")),
            "dev_nvidia": sorted(p for p in glob.glob("/dev/nvidia*") if p[len("/dev/nvidia"):].isdigit()),
            "opt_rocm": os.path.isdir("/opt/rocm"),
            "rocm_smi": shutil.which("rocm-smi") or shutil.which("amd-smi"),
            "nvidia_smi": shutil.which("nvidia-smi"),
        },
        "huge_pages": _huge_page_facts(),
        "env": {k: os.environ.get(k) for k in ENV_VARS},
    }


def jax_gpu_kind(platform_version: str | None) -> str | None:
    """'rocm' or 'cuda' from a PJRT client's platform_version string, else None."""
    v = (platform_version or "").lower()
    return "rocm" if ("rocm" in v or "hip" in v) else "cuda" if "cuda" in v else None


def backend_name(facts: dict) -> str:
    """cpu | gpu (rocm) | gpu (cuda) | tpu | ... : what JAX actually computes on."""
    j = facts["jax"]
    b = j.get("backend") or "unknown"
    if b == "gpu":
        kind = jax_gpu_kind(j.get("platform_version"))
        return f"gpu ({kind})" if kind else "gpu"
    return b


def diagnose(facts: dict) -> list[str]:
    """Facts -> warnings (each one sentence of problem plus the fix). Pure: no I/O."""
    w: list[str] = []
    j, s, t, env = facts["jax"], facts["system"], facts.get("torch", {}), facts.get("env", {})
    if j.get("error"):
        w.append(f"JAX could not list its devices ({j['error']}): a GPU plugin is probably installed but "
                 f"broken or mismatched; {GPU_FIX}.")
    system_gpu = [what for what, present in (
        ("/dev/kfd (AMD ROCm)", s.get("dev_kfd")), ("/dev/nvidia* (NVIDIA)", bool(s.get("dev_nvidia"))))
        if present]
    if t.get("gpu_available"):
        flavour = f"ROCm/HIP {t['hip']}" if t.get("hip") else f"CUDA {t.get('cuda')}"
        system_gpu.append(f"PyTorch ({flavour}, {t.get('gpu_count', '?')} device(s))")
    if j.get("backend") == "cpu" and system_gpu:
        w.append("a GPU is visible to the system or to PyTorch (" + ", ".join(system_gpu) + ") but JAX runs "
                 "on the CPU — the silent CPU fallback: everything will work, 10-100x slower. Fix: "
                 + GPU_FIX + ". If you meant to use the CPU, set JAX_PLATFORMS=cpu to silence this.")
    if s.get("dev_kfd") and not s.get("dev_kfd_rw"):
        w.append("/dev/kfd exists but this user cannot open it: add the user to the `video` and `render` "
                 "groups (or pass --device=/dev/kfd --device=/dev/dri to docker).")
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        if env.get(var) is not None and env[var].strip() in ("", "-1"):
            w.append(f"{var}={env[var]!r} hides every GPU; unset it to use them.")
    jaxlib = facts.get("versions", {}).get("jaxlib")
    for name, ver in facts.get("jax_gpu_plugins", {}).items():
        if jaxlib and ver and ver.split(".")[:3] != jaxlib.split(".")[:3]:
            w.append(f"{name} {ver} does not match jaxlib {jaxlib}: JAX will ignore the plugin and fall "
                     f"back to the CPU; install matching versions (pip install 'jax[rocm]=={jaxlib}').")
    if j.get("backend") == "gpu" and t.get("gpu_available") and env.get("XLA_PYTHON_CLIENT_PREALLOCATE") is None:
        w.append("JAX preallocates 75% of GPU memory at start-up; when PyTorch shares the GPU set "
                 "XLA_PYTHON_CLIENT_PREALLOCATE=false (or XLA_PYTHON_CLIENT_MEM_FRACTION=0.5).")
    return w


def doctor() -> dict:
    """The full report: facts, the backend in one word, and the warnings."""
    facts = collect_facts()
    return {"backend": backend_name(facts), **facts, "warnings": diagnose(facts)}


def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def format_report(r: dict) -> str:
    j = r["jax"]
    lines = [f"JAX backend: {r['backend']}" + (f"  ({j['platform_version']})" if j.get("platform_version") else "")]
    for d in j["devices"]:
        mem = _gib(d["memory_bytes"]) if d["memory_bytes"] is not None else f"host RAM {_gib(r['host_memory_bytes'])}"
        lines.append(f"  device {d['id']}: {d['platform']} {d['kind']}  memory {mem}")
    lines.append(f"python {r['python']} on {r['platform']}, {r['cpu_count']} CPUs")
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items() if v))
    if r["jax_gpu_plugins"]:
        lines.append("JAX GPU plugins: " + ", ".join(f"{k} {v}" for k, v in r["jax_gpu_plugins"].items()))
    t = r["torch"]
    if t.get("installed") and "version" in t:
        lines.append(f"PyTorch {t['version']}: hip={t['hip']} cuda={t['cuda']} gpu_available={t['gpu_available']}")
    s = r["system"]
    lines.append(f"system: /dev/kfd={s['dev_kfd']} render nodes={len(s['dev_dri_render'])} "
                 f"/dev/nvidia*={len(s['dev_nvidia'])} /opt/rocm={s['opt_rocm']} rocm-smi={s['rocm_smi']}")
    h = r.get("huge_pages") or {}
    tunables = f"GLIBC_TUNABLES={h['glibc_tunables']}" if h.get("glibc_tunables") else "GLIBC_TUNABLES unset"
    lines.append(f"huge pages: malloc {'on' if h.get('malloc_hugetlb') else 'off'} ({tunables}), "
                 f"transparent huge pages {h.get('thp')}, glibc {h.get('glibc')}")
    set_env = {k: v for k, v in r["env"].items() if v is not None}
    lines.append("env: " + (", ".join(f"{k}={v}" for k, v in set_env.items()) or "(none of the JAX/ROCm variables set)"))
    lines += [f"WARNING: {m}" for m in r["warnings"]] or ["no warnings"]
    return "\n".join(lines)
