"""The strategy interface: validate, render launcher arguments, wrap the model.

A strategy is one small class. ``validate`` runs in the planner (no process or
GPU touched); ``launcher_args`` renders its part of the ``accelerate launch``
argv; ``wrap`` runs inside each training process. Adding a strategy is adding a
class and registering it in ``ladle.strategies``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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
        return None  # most strategies render nothing that needs a second check

    def launcher_args(self, plan: Plan) -> list[str]:
        """Arguments for ``accelerate launch`` that select this strategy."""
        if plan.world_size == 1:
            return ["--cpu"] if plan.device == "cpu" else []
        # `--cpu --num_processes N` starts ONE process; --multi_gpu (torchrun underneath) starts N, and
        # the worker selects gloo with cpu=True. Every strategy is applied by ladle in the worker.
        return ["--multi_gpu"]

    def accelerator_kwargs(self, plan: Plan) -> dict[str, Any]:
        """Keyword arguments for ``accelerate.Accelerator`` in the worker."""
        return {}

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
    """True: checkpoints are the engine's own per-rank files, resumable only by the same strategy and world
    size. False: the strategy-neutral full state, which any strategy of this kind resumes from."""

    def save_state(self, model, optimizer, folder: str, tag: str) -> dict:
        """Checkpoint the model and optimizer (collective): native strategies write their files under
        ``folder/tag`` on every rank; the default gathers the full trainable state and returns it for
        ``state.pt`` (complete on rank 0)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from ladle.train.checkpoint import inner, state_options

        model_state, optim_state = get_state_dict(model, inner(optimizer), options=state_options())
        return {"model": model_state, "optimizer": optim_state}

    def load_state(self, model, optimizer, payload: dict, folder: str | None, tag: str) -> None:
        """Restore what ``save_state`` wrote: ``payload`` is ``state.pt``; ``folder`` holds the checkpoint's
        files (None when the strategy writes none)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from ladle.train.checkpoint import inner, state_options

        set_state_dict(
            model,
            inner(optimizer),
            model_state_dict=payload["model"],
            optim_state_dict=payload["optimizer"],
            options=state_options(strict=False),
        )

    def forward_backward(
        self, accelerator, model, data, batch: list[int], plan: Plan, denominator: int, loss_fn
    ) -> float:
        """Forward and backward of this rank's share of the global ``batch`` (row indices).

        ``loss_fn(model, data, rows, device)`` returns the summed token loss of ``rows`` and their
        token count. Returns this rank's summed (unscaled) loss, for logging.
        """
        from contextlib import nullcontext

        from ladle.train import schedule

        rank, replicas = self.data_parallel(accelerator)
        micros = schedule.micro_batches(batch, rank, replicas, plan.micro_batch_size)
        local_sum = 0.0
        for m, rows in enumerate(micros):
            sync = m == len(micros) - 1
            with self.no_sync(accelerator, model) if not sync else nullcontext():
                loss, _ = loss_fn(model, data, rows, accelerator.device)
                # Data-parallel reductions average gradients over replicas; scale so the result is the global token mean.
                self.backward(accelerator, model, loss * replicas / denominator, boundary=sync)
            local_sum += loss.item()
        # Ranks of one replica computed the same loss: count it once in the all-rank sum.
        return local_sum * replicas / accelerator.num_processes

    def evaluate(self, accelerator, model, data, micro: int, loss_fn) -> float:
        """Token-weighted loss over all rows of ``data``, the same on every rank.

        Every rank runs the same number of forward passes: a sharded model's
        forward is a collective (FSDP2 and ZeRO-3 gather each layer), so a rank
        with one row fewer would leave the others waiting forever. A rank out of
        rows runs its last batch again and does not count it.
        """
        import torch

        rank, replicas = self.data_parallel(accelerator)
        rows = len(data["input_ids"])
        mine = list(range(rank, rows, replicas))
        most = -(-rows // replicas)  # rows of the fullest rank
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        with torch.no_grad():
            for start in range(0, most, micro):
                chunk = mine[start : start + micro]
                loss, count = loss_fn(model, data, chunk or mine[-micro:] or [0], accelerator.device)
                if chunk:
                    total += torch.tensor([loss.item(), count], dtype=torch.float64, device=accelerator.device)
        total = accelerator.reduce(total, reduction="sum")  # every rank of a replica adds the same totals
        return float(total[0] / max(total[1], 1))

    def data_parallel(self, accelerator) -> tuple[int, int]:
        """This rank's data-parallel index and the number of replicas (ranks reading different rows)."""
        return accelerator.process_index, accelerator.num_processes

    def load_kwargs(self, accelerator, plan: Plan) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments (e.g. a tensor-parallel plan and mesh)."""
        return {}

    def validate_model(self, model: dict, world_size: int) -> list[str]:
        """Problems with this model's shape for this strategy (the planner has the config.json)."""
        return []

    def hf_model(self, accelerator, model):
        """The Hugging Face (or peft) model object whose ``save_pretrained`` writes the output."""
        return accelerator.unwrap_model(model)
