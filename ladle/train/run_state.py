"""What one run installs on its model for the steps' forwards: the fused loss's head, the padding-free joiner and
the sequence-parallel group. It lives on the model it was installed on (``ladle_run``), not on a class, so a
second run in one process (a test, a notebook, an evaluate stage after training) never sees the first one's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ATTRIBUTE = "ladle_run"


@dataclass
class RunState:
    fused: Any = None  # ladle.train.kernels.FusedHead: the head computes the loss (training.kernels.fused_loss)
    joiner: Any = None  # ladle.train.padding_free.JoinRows: micro-batches joined (training.kernels.padding_free)
    ulysses: Any = None  # ladle.train.sequence_parallel.Ulysses: rows split over sp ranks (parallelism.dims.sp)


NOTHING = RunState()


def of(model) -> RunState:
    """The state installed on ``model`` or on the module a wrapper holds (DDP's and DeepSpeed's ``module``,
    peft's ``base_model`` and ``model``); nothing installed: the plain paths (a frozen empty state)."""
    seen = model
    for _ in range(8):
        state = vars(seen).get(ATTRIBUTE) if hasattr(seen, "__dict__") else None
        if state is not None:
            return state
        children = vars(seen).get("_modules", {}) if hasattr(seen, "__dict__") else {}
        seen = next((children[k] for k in ("module", "base_model", "model") if children.get(k) is not None), None)
        if seen is None:
            break
    return NOTHING


def on(model) -> RunState:
    """The state of ``model`` itself, made empty on first use (the installers fill it)."""
    state = vars(model).get(ATTRIBUTE)
    if state is None:
        state = RunState()
        vars(model)[ATTRIBUTE] = state
    return state
