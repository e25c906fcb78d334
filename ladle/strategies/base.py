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

    def configure(self, cfg: LadleConfig, plan: Plan) -> tuple[dict, list[str]]:
        """The strategy's launcher config (e.g. the DeepSpeed JSON), rendered from the plan, and the reasons
        for any value it resolved itself. Runs in the planner: no heavy imports."""
        return {}, []

    def before_launch(self, plan: Plan) -> None:
        """Last check in the launching process, where heavy imports are fine (e.g. DeepSpeed's config model).

        Raises:
            ValueError: the rendered launcher config is rejected.
        """

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

    def backward(self, accelerator, model, loss, boundary: bool) -> None:
        """Backward of one micro-batch; ``boundary`` marks the last one before the optimizer step."""
        accelerator.backward(loss)

    def optimizer_step(self, accelerator, model, optimizer, max_grad_norm: float) -> None:
        """Clip (when ``max_grad_norm`` > 0), step and zero the gradients."""
        if max_grad_norm > 0:
            accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, accelerator, model, trainable_only: bool) -> dict | None:
        """The unsharded state dict, gathered collectively (every rank calls this); complete on rank 0."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from ladle.train.checkpoint import state_options

        return get_model_state_dict(model, options=state_options(trainable_only=trainable_only))

    native_checkpoint = False
    """True: checkpoints are the engine's own per-rank files (``save_native``/``load_native``), resumable only
    by the same strategy and world size. False: ladle's strategy-neutral full state (ladle.train.checkpoint)."""

    def save_native(self, model, folder: str, tag: str) -> None:
        raise NotImplementedError(f"{self.name} writes strategy-neutral checkpoints")

    def load_native(self, model, folder: str, tag: str) -> None:
        raise NotImplementedError(f"{self.name} reads strategy-neutral checkpoints")
