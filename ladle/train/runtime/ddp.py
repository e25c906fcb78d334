"""The worker side of ``ladle.strategies.ddp``: wrap, step, gather and save (the strategy there decides; this applies)."""

from __future__ import annotations

from typing import Any

from ladle.train.runtime.base import Runtime


class DDPRuntime(Runtime):
    """The worker side of ``DDP`` (``ladle.strategies.ddp``): what a rank does with the model."""

    def accelerator_kwargs(self, plan) -> dict[str, Any]:
        from accelerate.utils import DistributedDataParallelKwargs

        opts = plan.strategy_options
        ddp = DistributedDataParallelKwargs(
            bucket_cap_mb=opts.get("bucket_cap_mb", 25),
            find_unused_parameters=opts.get("find_unused_parameters", False),
            gradient_as_bucket_view=opts.get("gradient_as_bucket_view", True),
        )
        return {"kwargs_handlers": [ddp]}

    def wrap(self, accelerator, model, make_optimizer, plan, pending=None):
        if pending is not None:
            pending.fill(model, accelerator.device)  # a full replica on every rank
        return accelerator.prepare(model, make_optimizer(model))

    def check_applied(self, accelerator, model, plan) -> dict:
        from torch.nn.parallel import DistributedDataParallel

        if plan.world_size > 1 and not isinstance(model, DistributedDataParallel):
            raise RuntimeError(
                f"strategy ddp planned for {plan.world_size} ranks but the model is {type(model).__name__}"
            )
        report = {"wrapper": type(model).__name__, "parameter_share": 1.0}
        if isinstance(model, DistributedDataParallel):
            wanted = plan.strategy_options.get("gradient_as_bucket_view", True)
            if model.gradient_as_bucket_view != wanted:
                raise RuntimeError(f"ddp: gradient_as_bucket_view={wanted} planned, the wrapper has the opposite")
            report["gradients"] = "views into the all-reduce buckets" if wanted else "a copy beside the buckets"
        return report
