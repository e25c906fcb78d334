"""The training modules' warm start (``tests/warm_launch.py``) behaves as the real one where ``launch`` looks: the
launcher's output and exit code come back, and stopping it stops it and every rank."""

from __future__ import annotations

import time

import psutil

from ladle.platform.processes import free_port, stop_process
from ladle.train.run import worker_env, write_spec
from tests.helpers import strategy_spec
from tests.warm_launch import WarmLauncher


def test_a_refused_launch_reports_its_message_and_exit_code(tmp_path):
    spec = strategy_spec("ddp", tmp_path)
    proc = WarmLauncher(["--multi_gpu", "--num_processes", "2", "-m", "not.the.worker", "x.json"], worker_env(spec))
    output = proc.stdout.read()
    assert proc.wait(timeout=60) == 2
    assert "ladle launch: refused: it starts only `-m ladle.train.worker`" in output, output


def test_stopping_a_warm_launcher_stops_its_ranks(tmp_path):
    spec = strategy_spec("ddp", tmp_path, "training.max_steps=1000")
    argv = spec.plan.launcher_argv([str(write_spec(spec, str(tmp_path)))], port=free_port())
    proc = WarmLauncher(argv[3:], worker_env(spec))
    launcher = psutil.Process(proc.pid)
    deadline = time.monotonic() + 100
    while len(ranks := [p for p in launcher.children() if p.name().startswith("ladle-rank")]) < 2:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no two ranks in 100 s"
        time.sleep(0.1)
    stop_process(proc, grace_s=20, group=True)
    assert proc.returncode is not None
    _, left = psutil.wait_procs([launcher, *ranks], timeout=20)
    assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], left
