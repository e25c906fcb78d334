"""Run records of live servers: every ``python -m ladle.serve`` writes one when it starts serving and removes
it when it exits, so ``ladle servers`` can list them and ``ladle servers stop`` can drain and stop one,
whoever started it (the deploy stage with ``serve.keep_running``, or ``ladle serve``)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil

from ladle.assets import ladle_home


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
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    return path


def alive(record: dict) -> bool:
    """The recorded process still exists and is still a ladle server (pids are reused)."""
    try:
        return "ladle.serve" in " ".join(psutil.Process(record["pid"]).cmdline())
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
    os.killpg(record["pgid"], signal.SIGTERM) if record["pgid"] == record["pid"] else os.kill(
        record["pid"], signal.SIGTERM
    )
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not alive(record):
            (records_dir() / f"{record['pid']}.json").unlink(missing_ok=True)
            return "stopped"
        time.sleep(0.2)
    os.killpg(record["pgid"], signal.SIGKILL) if record["pgid"] == record["pid"] else os.kill(
        record["pid"], signal.SIGKILL
    )
    (records_dir() / f"{record['pid']}.json").unlink(missing_ok=True)
    return "killed"


def send(record: dict, sig: int) -> None:
    """Signal the server, and its whole process group when it leads one (MII's processes stop with it)."""
    try:
        if record["pgid"] == record["pid"]:
            os.killpg(record["pgid"], sig)
        else:
            os.kill(record["pid"], sig)
    except ProcessLookupError:
        pass
