"""Local ports and child processes: what the launcher, the server deploy and the Prefect API share."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from ladle.errors import LadleError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_run(count: int, tries: int = 50) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1 that nothing listens on now."""
    for _ in range(tries):
        first = free_port()
        if first + count < 65536 and all(port_free(first + i) for i in range(1, count)):
            return first
    raise LadleError(f"no {count} consecutive free ports on 127.0.0.1 after {tries} tries; free some ports.")


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` of 127.0.0.1 now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except (OSError, OverflowError):
            return False
        return True


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0, group: bool = False) -> None:
    """Bounded, escalating shutdown: SIGTERM, wait ``grace_s``, SIGKILL, wait.

    Args:
        group: signal the process's whole session (it was started with
            ``start_new_session=True``), so its children stop with it.
    """
    if proc.poll() is not None:
        return
    send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    try:
        send(signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    if group:  # children that ignored SIGTERM and outlived their leader
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def exited(pid: int) -> bool:
    """The process is gone (reaped here when it is this process's child, so no zombie is left)."""
    import psutil

    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:  # not ours: gone once it no longer runs (a zombie waits for its own parent)
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True


KILL_WAIT_S = 30.0
"""Seconds a SIGKILLed process is waited for before it is reported and left (the kernel ends it when it can)."""


def stop_pid(pid: int, grace_s: float, group: bool = False) -> str:
    """``stop_process`` for a process known only by its pid (one another process started, e.g. from a run record).

    Returns:
        ``stopped`` (it exited within ``grace_s`` of SIGTERM), ``killed``, or ``unkillable`` when it has not gone
        ``KILL_WAIT_S`` after SIGKILL (a process in uninterruptible sleep: a hung NFS read, a wedged driver call),
        which is logged instead of waited on for ever.
    """

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig) if group else os.kill(pid, sig)

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if exited(pid):
            return "stopped"
        time.sleep(0.1)
    send(signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while not exited(pid):
        if time.monotonic() > deadline:
            print(
                f"ladle: process {pid} is still there {KILL_WAIT_S:g} s after SIGKILL; not waiting for it", flush=True
            )
            return "unkillable"
        time.sleep(0.1)
    return "killed"


def running(process) -> bool:
    """The process runs (a zombie has ended: only its parent has not reaped it)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_all(processes: list, grace_s: float = 10.0) -> int:
    """SIGTERM every process, SIGKILL what is left after ``grace_s``; returns how many were running. The list is
    taken whole first: a launcher killed before its children would leave them to init, out of reach."""
    import psutil

    alive = [p for p in processes if running(p)]
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill() if grace_s <= 0 else process.terminate()
    _, left = psutil.wait_procs(alive, timeout=max(grace_s, 0.1))
    for process in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(left, timeout=10)
    return len(alive)


def other_threads() -> list[str]:
    """The names of this process's threads but the calling one (Linux; none elsewhere). A fork copies only the
    calling thread: a lock another thread held (an allocator's, a pool's) would never be released in the rank."""
    try:
        tasks = [t for t in os.listdir("/proc/self/task") if int(t) != threading.get_native_id()]
        return [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks]
    except OSError:
        return []
