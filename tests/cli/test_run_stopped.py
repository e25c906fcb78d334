"""``ladle run`` stopped with SIGTERM (a scheduler, systemd, ``kill``) in the middle of training: it exits 143 and
leaves nothing behind, neither the training ranks nor the temporary Prefect API server it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.pipeline


def descendants(proc: psutil.Process) -> dict[int, psutil.Process]:
    found = {}
    with contextlib.suppress(psutil.Error):
        for child in proc.children(recursive=True):
            found[child.pid] = child
    return found


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_sigterm_mid_training_stops_the_ranks_and_the_prefect_server(tmp_path):
    cli = subprocess.Popen(
        [str(Path(sys.executable).with_name("ladle")), "run", "tiny-cpu", "--set", f"output={tmp_path / 'out'}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # no configured API: the run starts its own temporary server, which must not outlive it
        env={
            **{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        },
    )
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 100
        while not any(p.name().startswith("ladle-rank") for p in seen.values() if alive(p)):
            assert cli.poll() is None, f"ladle run ended before training: {cli.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no training rank appeared in 100 s"
            seen |= descendants(psutil.Process(cli.pid))
            time.sleep(0.2)
        seen |= descendants(psutil.Process(cli.pid))
        kinds = {" ".join(p.cmdline()[1:]) for p in seen.values() if alive(p)}
        assert any("prefect.server.api.server:create_app" in k for k in kinds), f"no temporary Prefect server: {kinds}"
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) == 128 + signal.SIGTERM
        _, left = psutil.wait_procs(list(seen.values()), timeout=20)
        assert not [p for p in left if alive(p)], f"left running: {[p.pid for p in left]}"
        assert "Traceback" not in cli.stderr.read()
    finally:
        for proc in [psutil.Process(cli.pid), *seen.values()] if cli.poll() is None else seen.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()
