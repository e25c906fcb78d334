"""Registry of strategies: the only place strategy names map to code."""

from __future__ import annotations

from ladle.strategies.base import Strategy
from ladle.strategies.ddp import DDP
from ladle.strategies.fsdp2 import FSDP2

REGISTRY: dict[str, Strategy] = {s.name: s for s in (DDP(), FSDP2())}


def get(name: str) -> Strategy:
    """The registered strategy called ``name``.

    Raises:
        KeyError: no such strategy (the planner validates names before this).
    """
    return REGISTRY[name]
