"""One writer per output: an exclusive lock held for the lifetime of the command that writes it.

The lock is an OS advisory lock (`fcntl.flock`) on a hidden file beside the output,
`<parent>/.<name>.eyas-lock`: beside it rather than inside, because prepare, eval and export replace their
folder as a whole by a rename, and a lock inside would go with the old folder. The kernel drops a flock
when its process dies, so a killed run never leaves a stale lock; the file holds the holder's PID and
command for the message a second writer gets (exit 2), and is removed when the holder releases it.

`command_scope()` (entered by the CLI around every command) keeps the locks its command takes until the
command returns; taking a lock the process already holds is a no-op, so `eyas pipeline`'s stages, which run
in its process, write under the workdir lock the pipeline took. Outside a scope (a library call) `hold`
only checks that no other process holds the lock. Under torchrun only rank 0 takes it: the ranks of one
job write one folder together. Readers of a finished artifact ask `holder()` without taking anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

SUFFIX = ".eyas-lock"

_held: contextvars.ContextVar[dict[Path, int] | None] = contextvars.ContextVar("eyas_held_locks", default=None)
"""The locks the running command holds (lock file -> descriptor); None outside a command."""


def lock_file(path: str | Path) -> Path:
    """The lock file of the output `path` (symlinks resolved: two names of one folder share a lock)."""
    p = Path(path).expanduser().resolve()
    return p.parent / f".{p.name}{SUFFIX}"


def _other_rank() -> bool:
    """A torchrun rank other than 0: rank 0 holds the job's lock for all of them."""
    return os.environ.get("RANK", "0") not in ("", "0") and "LOCAL_RANK" in os.environ


@contextlib.contextmanager
def command_scope() -> Iterator[None]:
    """Hold the locks taken inside until the block ends (a nested scope joins the outer one)."""
    if _held.get() is not None:
        yield
        return
    held: dict[Path, int] = {}
    token = _held.set(held)
    try:
        yield
    finally:
        _held.reset(token)
        for lf, fd in reversed(list(held.items())):
            _release(lf, fd)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode() or "{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(info: dict[str, Any]) -> str:
    pid = info.get("pid", "unknown")
    cmd = info.get("command")
    return f"pid {pid}" + (f": {cmd}" if cmd else "")


def _open(lf: Path) -> int | None:
    """The lock file opened for writing, or None where it cannot be created (a read-only parent)."""
    try:
        lf.parent.mkdir(parents=True, exist_ok=True)
        return os.open(lf, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None


def hold(path: str | Path, *, option: str = "--out") -> None:
    """Take the exclusive lock of the output `path` for the running command; EyasError naming the output and
    the holder when another process writes it."""
    if _other_rank():
        return
    lf = lock_file(path)
    held = _held.get()
    if held is not None and lf in held:
        return
    tries = 20
    while True:
        fd = _open(lf)
        if fd is None:  # nowhere to put a lock file: the writer's own checks report the location
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            info = _read_holder(fd)
            os.close(fd)
            if info.get("pid") == os.getpid():  # this process holds it (taken outside this scope)
                return
            if not info and tries > 0:  # a holder that has not written itself yet, or a reader's brief probe
                tries -= 1
                time.sleep(0.05)
                continue
            raise EyasError(
                f"{option} {path} is being written by another eyas process ({_describe(info)}); wait for "
                f"it to finish (or stop it), or choose another {option}"
            ) from None
        try:
            same = os.stat(lf).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:  # (else the holder released and removed it between our open and flock: take the new file)
            break
        os.close(fd)
    info = {"pid": os.getpid(), "command": " ".join(["eyas", *sys.argv[1:]])[:500]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    if held is None:  # a library call: checked, not held
        _release(lf, fd)
    else:
        held[lf] = fd


def _release(lf: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        if os.stat(lf).st_ino == os.fstat(fd).st_ino:
            os.unlink(lf)  # while still held, so no one locks a file that is about to go
    os.close(fd)


def holder(path: str | Path) -> dict[str, Any] | None:
    """{"pid", "command"} of another process writing the output `path` now, else None (nothing is taken)."""
    lf = lock_file(path)
    try:
        fd = os.open(lf, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            info = _read_holder(fd)
            return None if info.get("pid") == os.getpid() else info or {"pid": "unknown"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def require_idle(path: str | Path, *, what: str) -> None:
    """Refuse to read `what` at `path` while another eyas process writes it: it is incomplete."""
    info = holder(path)
    if info is not None:
        raise EyasError(
            f"{what} {path} is incomplete: another eyas process is writing it now ({_describe(info)}); "
            "wait for it to finish, then rerun"
        )
