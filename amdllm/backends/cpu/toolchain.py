"""How the CPU backend's C++ source becomes a loadable library: compiled on first use with the host's C++
compiler into a per-machine cache (`$AMDLLM_CACHE/native`, default ~/.cache/amdllm/native)."""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib


HEADERS = (Path(__file__).with_name("pool.h"),)  # included by rows.cc
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def cpu_flags() -> list[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it cannot be read): -march=native code
    built on one CPU may not run on another that shares the cache directory."""
    try:
        return next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        return []


def cache_dir() -> Path:
    root = os.environ.get("AMDLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "amdllm")
    return Path(root) / "native"


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library_name(cxx: str, source: Path) -> str:
    """The built library's file name: one per source (and the headers it includes), jaxlib, compiler and
    CPU (-march=native code may not run on another CPU that shares the cache directory)."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), *(h.read_bytes() for h in HEADERS), jaxlib.__version__.encode(),
                 cxx.encode(), " ".join(FLAGS).encode(), platform.machine().encode(),
                 " ".join(sorted(cpu_flags())).encode()):
        key.update(part)
        key.update(b"\0")
    return f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path) -> Path:
    """The compiled library's path, compiled now if it is not in the cache. Raises RuntimeError with the
    reason (one line) where it cannot be built."""
    if platform.system() != "Linux":
        raise RuntimeError(f"built on Linux only, this is {platform.system()}")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, g++, c++ or clang++)")
    out = cache_dir() / library_name(cxx, source)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # same directory: the rename is atomic
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
            raise RuntimeError(f"{Path(cxx).name} failed on {source.name}: {first}")
        os.replace(tmp, out)  # several processes building at once: each renames a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
