"""``import deepspeed`` the lean way, for the planner (checking a rendered config with DeepSpeed's own model)
and the ranks alike."""

from __future__ import annotations

import sys
import types
from contextlib import redirect_stdout


def import_deepspeed():
    """``import deepspeed``, without the MLflow import its autotuner makes at module level, and logging to stderr.

    ``deepspeed/__init__`` imports ``deepspeed.autotuning.autotuner``, which imports mlflow (and with it
    pandas, protobuf and OpenTelemetry) whenever mlflow is installed, only to log autotuning experiments, which
    ladle never runs. Measured on each rank: +78 MiB resident and 0.83 s of CPU with it, +11 MiB and 0.10 s
    without. While DeepSpeed imports, ``import mlflow`` fails (the autotuner then records ``has_mlflow =
    False``); afterwards mlflow imports as usual, so rank 0 still logs to MLflow. Where mlflow is already
    imported, nothing is blocked (the import costs nothing more). Every function here that needs DeepSpeed
    imports it through this, so a rank's first import is this one whoever calls first.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    block = "mlflow" not in sys.modules
    if block:
        sys.modules["mlflow"] = None  # an import of a module set to None raises ImportError
    try:
        # DeepSpeed's logger writes to whatever sys.stdout is when it is created, during this import. Made while
        # stdout points at stderr, its messages (e.g. "Setting accelerator to CPU" on a host without a GPU) go
        # to stderr, so a `--json` command's stdout holds only its JSON. Ranks send both streams to one pipe.
        with redirect_stdout(sys.stderr):
            import deepspeed
    finally:
        if block and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    stand_in_for_muon()
    return deepspeed


MUON = "deepspeed.runtime.zero.muon"


def stand_in_for_muon() -> None:
    """Let DeepSpeed's ZeRO optimizers ask whether the optimizer is Muon without importing Muon.

    At ``deepspeed.initialize`` ZeRO-3's optimizer imports ``MuonWithAuxAdam`` for an ``isinstance`` check,
    and ZeRO-1/2's gradient partitioning imports ``muon_update`` every step, calling it only for Muon's
    parameters. Importing either applies ``torch.compile`` to DeepSpeed's Newton-Schulz kernels, which
    imports inductor's compiler, functorch's partitioners and networkx. Measured on a one-rank ZeRO-3
    initialize and step on a CPU (after the optimizer's own dynamo import): +52 MiB resident and 0.77 s of CPU
    per rank, for an optimizer ladle never builds (its ranks step a torch AdamW, or DeepSpeedCPUAdam with
    offload). Stand-in modules answer the same: nothing is a ``MuonWithAuxAdam``, and ``muon_update``
    raises if DeepSpeed ever reaches it, which it does only for a Muon optimizer.
    """
    if f"{MUON}.original_muon" in sys.modules or f"{MUON}.muon_optimizer" in sys.modules:
        return  # something imported the real Muon already: nothing left to save

    def muon_update(*args, **kwargs):
        raise RuntimeError("DeepSpeed reached Muon's update, but ladle builds no Muon optimizer")

    note = "ladle's stand-in: no optimizer ladle builds is Muon (ladle.strategies.deepspeed_import.stand_in_for_muon)."
    optimizer = types.ModuleType(f"{MUON}.muon_optimizer", note)
    optimizer.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {"__doc__": "Never instantiated in a ladle rank."})
    original = types.ModuleType(f"{MUON}.original_muon", note)
    original.muon_update = muon_update
    sys.modules[optimizer.__name__], sys.modules[original.__name__] = optimizer, original
