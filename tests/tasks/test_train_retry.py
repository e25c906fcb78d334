"""Resuming, at every level it happens:

- a rank killed mid-run: the Prefect train task retries and resumes from the last complete checkpoint;
- killed again, the flow run fails; a second flow run on the same run folder (what `--run-id` / the
  `run_id` parameter names) resumes from the newest checkpoint and ends exactly where an uninterrupted run does;
- an interrupted launch (a Prefect cancel raises in the flow-run process) stops every rank, none is orphaned.
"""

from __future__ import annotations

import signal
import threading
import time

import psutil
import pytest
from prefect import flow

from ladle.config import build_config
from ladle.lifecycle.tracking import start_run
from ladle.platform import storage
from ladle.tasks.train import train_task
from ladle.train.checkpoint import complete_steps
from ladle.train.run import launch
from tests.helpers import train_spec

pytestmark = pytest.mark.pipeline


@flow
def train_only(cfg, plan, dataset, base_dir, run_url, track):
    return train_task(cfg, plan, dataset, base_dir, run_url, track)


def is_worker(proc: psutil.Process) -> bool:
    """A training process of ours: the launcher or a rank it forked, whose command line ends ``-m ladle.train.worker
    SPEC`` (a child that has just exited is not: its command line is gone). Not a fork server whose preload list
    names the module (``tests/warm_launch.py``)."""
    try:
        return "-m ladle.train.worker " in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def kill_a_rank_after_checkpoints(run_url: str, steps: list[int], killed: list) -> None:
    """For each of ``steps``: wait for a complete checkpoint at that step or later, then SIGKILL one training process.

    "Or later": only the newest two checkpoints are kept, so on a loaded machine a step may be written and
    pruned between two looks.
    """
    deadline = time.monotonic() + 300
    for step in steps:
        while time.monotonic() < deadline:
            if any(done >= step for done in complete_steps(storage.join(run_url, "checkpoints"))):
                workers = [p for p in psutil.Process().children(recursive=True) if is_worker(p)]
                if workers and workers[-1].pid not in killed:
                    workers[-1].send_signal(signal.SIGKILL)
                    killed.append(workers[-1].pid)
                    break
            time.sleep(0.05)


def workers_alive() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True) if is_worker(p)]


class Interrupt(BaseException):
    """What Prefect raises in a flow-run process it cancels (a BaseException, like its TerminationSignal)."""


def retry_config(tmp_path):
    return build_config(
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


def test_a_killed_rank_is_retried_by_the_train_task_from_its_last_checkpoint(prefect_harness, tmp_path, tiny_model):
    """One rank killed after the step-4 checkpoint: the Prefect train task retries, the retry resumes from that
    checkpoint and the run completes (that a resumed run ends exactly where an uninterrupted one does is
    tests/train/test_resume.py's, on S3; the whole scenario, retries spent and a second flow run, is the test below)."""
    cfg = retry_config(tmp_path)
    spec = train_spec(cfg, tmp_path, "runs/clean")
    run_url = str(tmp_path / "runs" / "killed")
    killed: list = []
    killer = threading.Thread(target=kill_a_rank_after_checkpoints, args=(run_url, [4], killed), daemon=True)
    killer.start()
    track = start_run(cfg, None, "retry-once-test")
    result = train_only(cfg, spec.plan, spec.dataset, spec.base_dir, run_url, track)
    killer.join(timeout=5)
    assert len(killed) == 1, f"killed {killed}"
    assert 4 <= result.resumed_from_step < 20 and result.steps == 20
    assert workers_alive() == []


# slow: a killed rank's retry is proven in make test by the test above, and a resumed run ending exactly where an
# uninterrupted one does by tests/train/test_resume.py; this adds the retries spent, a second flow run on the same
# run folder, and an interrupted launch leaving no rank behind (tests/cli/test_run_stopped.py stops a whole run).
@pytest.mark.slow
def test_killed_rank_retries_then_a_second_flow_run_resumes_exactly(prefect_harness, tmp_path, tiny_model):
    cfg = retry_config(tmp_path)
    spec = train_spec(cfg, tmp_path, "runs/clean")
    plan, dataset = spec.plan, spec.dataset
    track = start_run(cfg, None, "retry-test")
    run_url = str(tmp_path / "runs" / "killed")

    # Flow run 1: killed after step 4 (the task retries and resumes), killed again after step 12 (retries spent).
    killed: list = []
    killer = threading.Thread(target=kill_a_rank_after_checkpoints, args=(run_url, [4, 12], killed), daemon=True)
    killer.start()
    first = train_only(cfg, plan, dataset, spec.base_dir, run_url, track, return_state=True)
    killer.join(timeout=5)
    assert len(killed) == 2, f"killed {killed}"
    assert first.is_failed()
    assert max(complete_steps(storage.join(run_url, "checkpoints"))) >= 12  # the retry got past its resume point

    # Flow run 2, same run folder: resumes from the newest complete checkpoint.
    second = train_only(cfg, plan, dataset, spec.base_dir, run_url, track)
    assert second.resumed_from_step >= 12

    # The uninterrupted reference, after an interrupted launch that must leave no rank behind.
    def interrupt_at_step_2(event: dict) -> None:
        if event.get("event") == "step" and event["step"] >= 2:
            raise Interrupt()

    with pytest.raises(Interrupt):
        launch(spec, on_progress=interrupt_at_step_2)
    assert workers_alive() == []
    reference = launch(spec)
    assert second.train_losses == pytest.approx(reference.train_losses, abs=1e-5)
