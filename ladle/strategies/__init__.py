"""Registry of strategies: the only place strategy names map to code."""

from __future__ import annotations

from ladle.strategies.base import Strategy
from ladle.strategies.ddp import DDP
from ladle.strategies.deepspeed import ZeRO, ZeROPlusPlus
from ladle.strategies.fsdp2 import FSDP2
from ladle.strategies.pipeline import Pipeline
from ladle.strategies.tensor import TensorParallel

REGISTRY: dict[str, Strategy] = {
    s.name: s for s in (DDP(), ZeRO(1), ZeRO(2), ZeRO(3), ZeROPlusPlus(), FSDP2(), Pipeline(), TensorParallel())
}


def options_section(name: str) -> str | None:
    """The ``parallelism.*`` config section holding a strategy's options (None: it has none)."""
    return "deepspeed" if name.startswith("zero") else None if name == "tp" else name


def get(name: str) -> Strategy:
    """The registered strategy called ``name``.

    Raises:
        KeyError: no such strategy (the planner validates names before this).
    """
    return REGISTRY[name]
