"""What a DeepSpeed rank imports: DeepSpeed itself, not the MLflow its autotuner would pull in."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import sys
from ladle.strategies.deepspeed import import_deepspeed

deepspeed = import_deepspeed()
assert callable(deepspeed.initialize) and callable(deepspeed.zero.Init)
assert "mlflow" not in sys.modules and "pandas" not in sys.modules, "DeepSpeed's import brought in mlflow"
from deepspeed.autotuning import autotuner
assert autotuner.has_mlflow is False
import mlflow  # rank 0 logs to MLflow afterwards: nothing was left blocked
from mlflow.tracking import MlflowClient
assert import_deepspeed() is deepspeed
print("ok", mlflow.__version__)
"""


def test_deepspeed_imports_without_mlflow_and_mlflow_imports_afterwards():
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("ok ")
