"""Small file helpers shared by every writer: nothing is ever left half-written."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; on success it is renamed over `path` (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual 0644 like open() does
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def read_json(path: str | os.PathLike, error: type[Exception] = ValueError):
    """Parse a JSON file; invalid JSON raises `error` with a message naming the file."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None


class OutputError(ValueError):
    """An output path that would overwrite an input or an earlier result; the message names the flag."""


def check_output_dir(out: str | os.PathLike, inputs=(), *, command: str, overwrite: bool = False,
                     flag: str = "--out", allowed: bool = False) -> Path:
    """Refuse to write into `out` when it is one of `inputs` (always), or when it exists and is not an
    empty directory, unless `overwrite` (or `allowed`: the caller continues what is there, e.g. a resume).
    Called before anything is loaded, so a wrong path costs nothing."""
    out = Path(out)
    for src in inputs:
        if src is not None and Path(src).exists() and out.resolve() == Path(src).resolve():
            raise OutputError(f"{flag} {out}: is an input directory ({src}); {command} never writes over its "
                              "input")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out}: exists and is not a directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not (overwrite or allowed):
        raise OutputError(f"{flag} {out}: exists and is not empty ({', '.join(held[:4])}"
                          f"{', ...' if len(held) > 4 else ''}); pass --overwrite to replace what it holds")
    return out
