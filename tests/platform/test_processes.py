"""Shutdown helpers the suite relies on: bounded and escalating, so no process outlives a test."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from ladle.platform.processes import stop_process

STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    stop_process(proc, grace_s=0.5)
    assert proc.returncode == -9


def test_a_group_is_stopped_with_its_children():
    spawn = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", spawn], start_new_session=True)
    deadline = time.monotonic() + 10
    while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = psutil.Process(parent.pid).children()[0]
    stop_process(parent, grace_s=0.5, group=True)
    child.wait(timeout=10)
    assert not child.is_running()
