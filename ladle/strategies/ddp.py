"""DDP: every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

from typing import Any

from ladle.strategies.base import Strategy


class DDP(Strategy):
    name = "ddp"
    summary = "data parallel, full replica per rank, gradients all-reduced"

    def validate(self, cfg, topo, world_size: int) -> list[str]:
        return []

    def accelerator_kwargs(self, plan) -> dict[str, Any]:
        from accelerate.utils import DistributedDataParallelKwargs

        opts = plan.strategy_options
        ddp = DistributedDataParallelKwargs(
            bucket_cap_mb=opts.get("bucket_cap_mb", 25),
            find_unused_parameters=opts.get("find_unused_parameters", False),
        )
        return {"kwargs_handlers": [ddp]}

    def wrap(self, accelerator, model, make_optimizer, plan):
        return accelerator.prepare(model, make_optimizer(model))

    def check_applied(self, accelerator, model, plan) -> dict:
        from torch.nn.parallel import DistributedDataParallel

        if plan.world_size > 1 and not isinstance(model, DistributedDataParallel):
            raise RuntimeError(
                f"strategy ddp planned for {plan.world_size} ranks but the model is {type(model).__name__}"
            )
        return {"wrapper": type(model).__name__, "parameter_share": 1.0}
