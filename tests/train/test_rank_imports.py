"""What a DeepSpeed rank imports: DeepSpeed itself, not the MLflow its autotuner would pull in, nor the compiled
kernels of a Muon optimizer ladle never builds."""

from __future__ import annotations

import os
import subprocess
import sys


def run_python(code: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (nothing imported yet), asserting it exits 0."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


CHECK = """
import sys
from ladle.strategies.deepspeed_import import import_deepspeed

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
    done = run_python(CHECK, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.stdout.splitlines()[-1].startswith("ok ")


MUON_CHECK = """
import os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import torch
import torch.distributed as dist
from ladle.strategies.deepspeed_import import import_deepspeed

deepspeed = import_deepspeed()
import deepspeed.ops

# As a ladle rank on a CPU does (cpu_without_shm_kernel): no JIT build of the shared-memory all-reduce kernel,
# which took ~20 s of this test on a machine without a torch_extensions cache.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
dist.init_process_group("gloo", rank=0, world_size=1)
for stage in (3, 2):  # ZeRO-3 asks at initialize, ZeRO-1/2 at every step
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config, dist_init_required=False
    )
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
compiled = [m for m in ("torch._inductor.compile_fx", "torch._functorch.partitioners", "networkx") if m in sys.modules]
assert not compiled, f"Muon's compiled kernels were imported after all: {compiled}"
from deepspeed.runtime.zero.muon.original_muon import muon_update
try:
    muon_update(None, None)
except RuntimeError as exc:
    assert "no Muon optimizer" in str(exc)
else:
    raise AssertionError("the stand-in muon_update returned")
print("ok")
"""


def test_zero_ranks_never_import_muons_compiled_kernels():
    """DeepSpeed's ZeRO optimizers import Muon only to ask whether the optimizer is one; ladle's stand-in
    answers no, so a ZeRO-3 and a ZeRO-2 engine initialise and step without inductor's compiler."""
    from ladle.platform.processes import free_port

    done = run_python(MUON_CHECK, str(free_port()), env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.stdout.splitlines()[-1] == "ok"


LOG_CHECK = """
from ladle.strategies.deepspeed_import import import_deepspeed

import_deepspeed()
from deepspeed.accelerator import get_accelerator

get_accelerator()  # without DS_ACCELERATOR on a host without CUDA, DeepSpeed warns that it picked the CPU
"""


def test_deepspeed_logs_to_stderr_so_json_stdout_stays_clean():
    """`ladle run --json` promises JSON on stdout; DeepSpeed's logger, made at import, wrote there."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = run_python(LOG_CHECK, env=env)
    assert "Setting accelerator to CPU" in done.stderr
    assert done.stdout == ""
