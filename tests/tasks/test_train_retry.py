"""A rank killed mid-run: the Prefect train task retries and resumes exactly from the last complete checkpoint."""

from __future__ import annotations

import signal
import threading
import time

import psutil
import pytest
from prefect import flow

from ladle import storage
from ladle.config import build_config
from ladle.tasks.train import train_task
from ladle.tracking import start_run
from ladle.train.checkpoint import complete_steps
from ladle.train.run import launch
from tests.helpers import train_spec

pytestmark = pytest.mark.pipeline


@flow
def train_only(cfg, plan, dataset, run_url, track):
    return train_task(cfg, plan, dataset, run_url, track)


def is_worker(proc: psutil.Process) -> bool:
    """A training process of ours (a child that has just exited is not: its command line is gone)."""
    try:
        return "ladle.train.worker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def kill_a_rank_after_checkpoint(run_url: str, step: int, killed: list) -> None:
    """Wait for a complete checkpoint at ``step`` or later, then SIGKILL one training process.

    "Or later": only the newest two checkpoints are kept, so on a loaded machine ``step`` itself may be
    written and pruned between two looks.
    """
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if any(done >= step for done in complete_steps(storage.join(run_url, "checkpoints"))):
            workers = [p for p in psutil.Process().children(recursive=True) if is_worker(p)]
            if workers:
                workers[-1].send_signal(signal.SIGKILL)
                killed.append(workers[-1].pid)
                return
        time.sleep(0.05)


def test_killed_rank_is_retried_and_resumes_exactly(prefect_harness, tmp_path, tiny_model):
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "output": str(tmp_path),
            "training": {
                "max_steps": 20,
                "lr": 3e-3,
                "micro_batch_size": 2,
                "checkpoint_every": 4,
                "lora": {"dropout": 0.1},
            },
        },
        [],
    )
    spec = train_spec(cfg, tmp_path, "runs/clean")
    plan, dataset = spec.plan, spec.dataset
    track = start_run(cfg, None, "retry-test")
    run_url = str(tmp_path / "runs" / "killed")

    killed: list = []
    killer = threading.Thread(target=kill_a_rank_after_checkpoint, args=(run_url, 4, killed), daemon=True)
    killer.start()
    result = train_only(cfg, plan, dataset, run_url, track)
    killer.join(timeout=1)

    assert killed, "no training process was killed"
    assert result.resumed_from_step >= 4  # the retry found a complete checkpoint
    reference = launch(spec)
    assert result.train_losses == pytest.approx(reference.train_losses, abs=1e-5)
