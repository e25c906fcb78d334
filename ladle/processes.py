"""Local ports and child processes: what the launcher, the server deploy and the Prefect API share."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
