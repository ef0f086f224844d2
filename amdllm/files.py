"""Small file helpers shared by every writer: nothing is ever left half-written."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
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
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if e.filename is None:  # a failed write() names no file (disk full, file too large): name ours
            raise OSError(e.errno, f"{e.strerror or e} while writing", str(path)) from None
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike):
    """Yield an empty staging directory beside `out`; on success it takes `out`'s place whole (an earlier
    `out` is removed only then), on failure it is removed and `out` is untouched. A failed write names
    the file as it would have been in `out`. Staging left by a killed process is removed first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    restore_swapped(out)
    remove_stale([*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")])
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if e.filename and Path(e.filename).is_relative_to(staging):
            raise OSError(e.errno, e.strerror, str(out / Path(e.filename).relative_to(staging))) from None
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def restore_swapped(out: Path) -> Path | None:
    """A writer killed between its two renames (`out` to `.old-PID`, staging to `out`) left `out` missing
    and the earlier result aside: put that back, so it is neither lost nor taken for a leftover. Only a
    dead writer's; returns the restored path, or None."""
    if out.exists() or out.is_symlink():
        return None
    for old in sorted(out.parent.glob(f".{out.name}.old-*")):
        pid = old.name.rsplit("-", 1)[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            os.replace(old, out)
            return out
    return None


def remove_stale(staging) -> None:
    """Remove the staging directories (named `...-PID`) whose process is no longer running: what a
    killed writer left. A live process's staging is its own business."""
    for left in staging:
        pid = left.name.rsplit("-", 1)[1]
        if not (pid.isdigit() and pid_alive(int(pid))):
            shutil.rmtree(left, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (ours counts): staging of a live process is not a leftover."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def read_text(path: str | os.PathLike, error: type[Exception] = ValueError) -> str:
    """A UTF-8 text file; a byte that is not UTF-8 raises `error` naming the file, line and byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{path}:{line}: byte 0x{data[e.start]:02x} is not UTF-8 (expected UTF-8 text)") from None


def check_text(s: str, where: str, error: type[Exception] = ValueError) -> str:
    """`s` if it is text UTF-8 can hold; a lone surrogate (JSON's "\\ud800", an undecodable byte of a
    command line) raises `error` naming `where` and the character."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise error(f"{where}: character {e.start + 1} is a lone surrogate (U+{ord(s[e.start]):04X}), not "
                    "text (expected UTF-8 text)") from None
    return s


def read_json(path: str | os.PathLike, error: type[Exception] = ValueError):
    """Parse a JSON file; invalid JSON (or UTF-8) raises `error` with a message naming the file."""
    try:
        return json.loads(read_text(path, error))
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None


class OutputError(ValueError):
    """An output path that would overwrite an input or an earlier result; the message names the flag."""


@contextlib.contextmanager
def output_lock(out: str | os.PathLike, command: str, flag: str = "--out"):
    """Hold `out` for one command: a second command into the same directory is refused at once, before it
    checks or writes anything (two finetunes would both pass the emptiness check, then mix their
    checkpoints and replace each other's adapter). The lock is a hidden file beside `out`, kept after the
    run: removing it would let a process that opened it meanwhile lock a file nobody else sees."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{out.name}.amdllm-lock"
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise OutputError(f"{flag} {out}: another amdllm command ({holder}) is writing it; wait for it to "
                              f"finish or choose another {flag}") from None
        f.seek(0)
        f.truncate()
        f.write(f"amdllm {command}, pid {os.getpid()}")
        f.flush()
        try:
            yield out
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_output_dir(out: str | os.PathLike, inputs=(), *, command: str, overwrite: bool = False,
                     flag: str = "--out", allowed: bool = False) -> Path:
    """Refuse `out` when it is, holds, or lies inside any of `inputs` ((flag, path) pairs: every file or
    directory the command reads; always, --overwrite or not), or when it exists and is not an empty
    directory, unless `overwrite` (or `allowed`: the caller continues what is there, e.g. a resume).
    Called before anything is loaded, so a wrong path costs nothing. An earlier result that a killed
    writer left aside is put back first (`restore_swapped`), and the rules apply to it."""
    out = Path(out)
    restore_swapped(out)
    where = out.resolve()
    for name, src in inputs:
        if src is None or not Path(src).exists():
            continue
        read = Path(src).resolve()
        if where == read or where in read.parents or read in where.parents:
            how = "is" if where == read else "holds" if where in read.parents else "lies inside"
            raise OutputError(f"{flag} {out}: {how} an input ({name} {src}); {command} never writes over its "
                              f"input, into it or around it: choose a {flag} apart from what it reads")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out}: exists and is not a directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not (overwrite or allowed):
        raise OutputError(f"{flag} {out}: exists and is not empty ({', '.join(held[:4])}"
                          f"{', ...' if len(held) > 4 else ''}); pass --overwrite to replace what it holds")
    return out
