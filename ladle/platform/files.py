"""Local files written whole or not at all.

A file that several processes may write at once (run records, caches, converted models' memos) is written to a
temporary file of this process's own beside it and renamed into place: a reader sees the old file or the new one,
never half of either, and two writers never write into one temporary file. A folder (a model, a copy of one) is
built the same way (``building``). What is costly to build (a converted model) is built by one process at a time
(``one_builder``): the others wait for it and use what it built.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def write_atomic(path: Path, data: str | bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` in one rename; returns ``path``.

    Args:
        mode: the file's permission bits (e.g. 0o600 for one holding a token), set before any byte is written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def building(target: Path) -> Iterator[Path]:
    """A folder of this process's own beside ``target`` to build it in, renamed into place when the block ends
    without error: a ``target`` that exists is always whole. When another process put ``target`` there first,
    theirs stays and this one is dropped; on an error nothing is left behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def one_builder(target: Path, deadline_s: float, poll_s: float = 0.2) -> Iterator[None]:
    """One process at a time inside the block for ``target``: an exclusive lock on ``.NAME.lock`` beside it.
    A process that finds it held waits, then (checking ``target`` again inside) uses what the holder built
    instead of building it a second time. The kernel releases the lock of a process that dies, so a builder
    killed halfway never blocks the next one (which finds no ``target`` and builds it).

    Raises:
        TimeoutError: the lock was still held after ``deadline_s`` (the message names the lock file).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    with open(lock, "a") as handle:
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process held {lock} for over {deadline_s:.0f} s") from None
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
