"""`amdllm doctor`: which backend JAX really uses, the devices and their memory, versions, and warnings.

The failure this exists for: on a ROCm (or CUDA) machine `pip install jax` gives a CPU-only JAX, which
runs everything — slowly — without a word. So the check is split in two:
  * `collect_facts()` gathers plain facts (device nodes, env vars, versions, what JAX and PyTorch see);
  * `diagnose(facts)` is a pure function from those facts to warnings, so tests can feed any machine
    ("/dev/kfd exists, torch.version.hip = '6.2', JAX backend cpu") and check the advice.
"""
from __future__ import annotations

import glob
import importlib.metadata as md
import importlib.util
import os
import platform
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
    if "amdllm_backend" in r:  # what `amdllm doctor` adds (amdllm.backends.describe)
        b = r["amdllm_backend"]
        parts = ", ".join(f"{k.replace('_', ' ')} {'on' if v else 'off'}" for k, v in b.items() if k != "backend")
        lines.append(f"amdllm backend: {b.get('backend', '?')}" + (f" ({parts})" if parts else ""))
    set_env = {k: v for k, v in r["env"].items() if v is not None}
    lines.append("env: " + (", ".join(f"{k}={v}" for k, v in set_env.items()) or "(none of the JAX/ROCm variables set)"))
    lines += [f"WARNING: {m}" for m in r["warnings"]] or ["no warnings"]
    return "\n".join(lines)
