"""Resume is exact: a run told to stop checkpoints the step it finished and continuing from there reproduces the
uninterrupted run's losses; a step whose loss is not finite stops the run before it is applied, so the last
checkpoint is still a good one to resume from.

The run's outputs are in S3 (the moto server): checkpoints are uploaded by every rank and read back in place
(``ladle.strategies.base.dcp_reader``). Local checkpoints are resumed by the strategy suite and the retry test."""

from __future__ import annotations

import pytest

from ladle.config import build_config
from ladle.platform import storage
from ladle.train.checkpoint import complete_steps
from ladle.train.run import launch
from tests.helpers import train_spec


@pytest.mark.pipeline
def test_a_run_told_to_stop_checkpoints_its_step_in_s3_and_resumes_as_if_uninterrupted(
    tiny_model, tmp_path, s3_server, monkeypatch
):
    """SIGTERM to the launcher mid-run (what a cluster sends before it preempts a job): every rank finishes its
    step, they write a checkpoint of it to S3 together (no periodic checkpoint is asked for), the run exits 75
    (``TrainingPreempted`` naming the step), and a second launch resumes there and ends with the uninterrupted
    run's losses: no step lost, nothing repeated."""
    import os
    import signal

    from ladle.train.run import TrainingPreempted

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)  # the launched ranks inherit them
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "training": {
                "max_steps": 8,
                "lr": 3e-3,
                "micro_batch_size": 2,
                "global_batch_size": 8,
                "lora": {"dropout": 0.1},
            },
        },
        [],
    )  # dropout makes the RNG state matter; accumulation 2 exercises no_sync
    full = launch(train_spec(cfg, tmp_path).model_copy(update={"run_url": "s3://ladle/resume/whole"}))
    spec = train_spec(cfg, tmp_path).model_copy(update={"run_url": "s3://ladle/resume/preempted"})

    from ladle.train import run as runs

    started = []
    real_start = runs.start_launcher
    monkeypatch.setattr(
        runs, "start_launcher", lambda argv, spec: started.append(real_start(argv, spec)) or started[-1]
    )

    def stop_at_first_step(event: dict) -> None:
        if event["event"] == "step" and event["step"] == 1:
            os.kill(started[-1].pid, signal.SIGTERM)  # the launcher alone, as a scheduler's stop reaches it

    with pytest.raises(TrainingPreempted) as told:
        launch(spec, on_progress=stop_at_first_step)
    step = told.value.step
    assert 1 <= step < 8, step
    assert complete_steps(storage.join(spec.run_url, "checkpoints")) == [step]
    assert not storage.exists(storage.join(spec.run_url, "train_result.json"))

    resumed = launch(spec)
    assert resumed.resumed_from_step == step
    assert resumed.train_losses[:step] == full.train_losses[:step]
    assert resumed.train_losses[step:] == pytest.approx(full.train_losses[step:], abs=1e-5)
    assert resumed.eval_loss_after == pytest.approx(full.eval_loss_after, abs=1e-5)


def test_a_loss_that_turns_nan_stops_the_run_before_its_step_is_applied(tmp_path):
    """An absurd learning rate makes the second step's loss NaN: the rank stops there with the step, the value
    and the fix named, instead of training on to NaN weights and a NaN model (every rank checks the loss all of
    them agree on, so a run of several stops on every rank at once)."""
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 64},
            "parallelism": {"strategy": "ddp", "cpu_processes": 1},
            "training": {"max_steps": 4, "lr": 1e30, "micro_batch_size": 2, "global_batch_size": 2},
        },
        [],
    )
    with pytest.raises(Exception) as stopped:
        launch(train_spec(cfg, tmp_path))
    said = str(stopped.value)
    assert "the training loss of step" in said and "its gradients were not applied" in said, said[-2000:]
    assert "Lower training.lr" in said
    assert not (tmp_path / "run" / "adapter").exists()  # no model was written from NaN weights
