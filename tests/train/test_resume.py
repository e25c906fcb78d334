"""Resume is exact: continuing from a checkpoint reproduces the uninterrupted run's losses; a step whose loss is
not finite stops the run before it is applied, so the last checkpoint is still a good one to resume from.

The run's outputs are in S3 (the moto server): checkpoints are uploaded by every rank and read back in place
(``ladle.strategies.base.dcp_reader``). Local checkpoints are resumed by the strategy suite and the retry test."""

from __future__ import annotations

import pytest

from ladle.config import build_config
from ladle.platform import storage
from ladle.train.checkpoint import complete_steps, step_dir
from ladle.train.run import launch
from tests.helpers import train_spec


@pytest.mark.pipeline
def test_resume_from_checkpoint_in_s3_matches_uninterrupted_run(tiny_model, tmp_path, s3_server, monkeypatch):
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)  # the launched ranks inherit them
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "training": {
                "max_steps": 8,
                "lr": 3e-3,
                "checkpoint_every": 4,
                "micro_batch_size": 2,
                "global_batch_size": 8,
                "lora": {"dropout": 0.1},
            },
        },
        [],
    )  # dropout makes the RNG state matter; accumulation 2 exercises no_sync
    spec = train_spec(cfg, tmp_path).model_copy(update={"run_url": "s3://ladle/resume/ddp"})

    full = launch(spec)
    root = storage.join(spec.run_url, "checkpoints")
    assert complete_steps(root) == [4, 8]

    # Simulate a crash after step 4's checkpoint: step 8's checkpoint never completed.
    storage.remove(storage.join(step_dir(root, 8), "_COMPLETE"))
    storage.remove(storage.join(spec.run_url, "train_result.json"))
    resumed = launch(spec)

    assert resumed.resumed_from_step == 4
    assert resumed.train_losses[:4] == full.train_losses[:4]
    assert resumed.train_losses[4:] == pytest.approx(full.train_losses[4:], abs=1e-5)
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
