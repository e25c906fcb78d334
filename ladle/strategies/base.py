"""The strategy interface: validate, render launcher arguments, wrap the model.

A strategy is one small class. ``validate`` runs in the planner (no process or
GPU touched); ``launcher_args`` renders its part of the ``accelerate launch``
argv; ``wrap`` runs inside each training process. Adding a strategy is adding a
class and registering it in ``ladle.strategies``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ladle.config import LadleConfig
    from ladle.plan import Plan
    from ladle.topology import Topology


class Strategy(ABC):
    name: str
    summary: str

    @abstractmethod
    def validate(self, cfg: LadleConfig, topo: Topology, world_size: int) -> list[str]:
        """Problems that stop this strategy on this machine (field = value: why. fix.)."""

    @abstractmethod
    def launcher_args(self, plan: Plan) -> list[str]:
        """Arguments for ``accelerate launch`` that select this strategy."""

    @abstractmethod
    def accelerator_kwargs(self, plan: Plan) -> dict[str, Any]:
        """Keyword arguments for ``accelerate.Accelerator`` in the worker."""

    @abstractmethod
    def wrap(self, accelerator, model, make_optimizer: Callable, plan: Plan):
        """Distribute ``model``, then build its optimizer with ``make_optimizer(model)``
        (after sharding, so the optimizer holds shards); returns both."""

    @abstractmethod
    def check_applied(self, accelerator, model, plan: Plan) -> dict:
        """Raise if what runs is not what was planned (no silent fallback); return what was verified."""

    def no_sync(self, accelerator, model):
        """Context that skips gradient synchronisation on accumulation micro-steps."""
        return accelerator.no_sync(model)
