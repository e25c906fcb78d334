"""The same pipeline on CUDA (NCCL when more than one GPU). Skipped without CUDA."""

from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, needs_gpus, run_cli
from tests.pipeline import checks

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(),
]


def test_pipeline_on_one_gpu(tmp_path):
    done = run_cli(
        "run",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        "--gpus",
        "1",
        "--json",
        "--set",
        f"output={tmp_path}",
        "--set",
        "training.max_steps=30",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["world_size"], summary["strategy"]) == (1, "ddp")
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    checks.check_mlflow(summary, 30, "tiny-cpu", world_size=1)
