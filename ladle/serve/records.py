"""Run records of live servers: every ``python -m ladle.serve`` writes one when it starts serving and removes
it when it exits, so ``ladle servers`` can list them and ``ladle servers stop`` can drain and stop one,
whoever started it (the deploy stage with ``serve.keep_running``, or ``ladle serve``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil

from ladle.assets import ladle_home
from ladle.platform.files import write_atomic
from ladle.platform.processes import stop_pid


def records_dir() -> Path:
    return ladle_home() / "served" / "running"


def write(url: str, model: str, backend: str, model_dir: str) -> Path:
    """Record this process as a live server; returns the record's path."""
    folder = records_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{os.getpid()}.json"
    record = {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "url": url,
        "model": model,
        "backend": backend,
        "model_dir": model_dir,
        "started_at": time.time(),
    }
    return write_atomic(path, json.dumps(record))


def alive(record: dict | None, marker: str = "ladle.serve") -> bool:
    """The recorded process still exists and is still a ladle server (pids are reused)."""
    if not record:
        return False
    try:
        process = psutil.Process(record["pid"])
        return process.status() != psutil.STATUS_ZOMBIE and marker in " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def running() -> list[dict]:
    """Live servers, oldest first; records of servers that died without cleaning up are removed."""
    out = []
    for path in sorted(records_dir().glob("*.json")) if records_dir().is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if alive(record):
            out.append(record)
        else:
            path.unlink(missing_ok=True)
    return sorted(out, key=lambda r: r["started_at"])


def stop(record: dict, grace_s: float) -> str:
    """SIGTERM the server's process group (it drains in-flight requests), SIGKILL after ``grace_s``.

    Returns:
        ``stopped`` or ``killed``.
    """
    outcome = stop_pid(record["pid"], grace_s, group=record["pgid"] == record["pid"])
    (records_dir() / f"{record['pid']}.json").unlink(missing_ok=True)
    return outcome


def send(record: dict, sig: int) -> None:
    """Signal the server, and its whole process group when it leads one (MII's processes stop with it)."""
    try:
        if record["pgid"] == record["pid"]:
            os.killpg(record["pgid"], sig)
        else:
            os.kill(record["pid"], sig)
    except ProcessLookupError:
        pass
