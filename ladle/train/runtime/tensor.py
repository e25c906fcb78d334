"""The worker side of ``ladle.strategies.tensor``: wrap, step, gather and save (the strategy there decides; this applies)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from ladle.train.runtime.base import Runtime


class TensorParallelRuntime(Runtime):
    """The worker side of ``TensorParallel`` (``ladle.strategies.tensor``): what a rank does with the model."""

    def load_kwargs(self, accelerator, plan) -> dict[str, Any]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,), mesh_dim_names=("tp",))
        return {"tp_plan": "auto", "device_mesh": mesh}

    def wrap(self, accelerator, model, make_optimizer, plan, pending=None):
        # loads_lazily is False: from_pretrained's tp_plan already gave each rank only its slices.
        model.to(accelerator.device)
        return model, make_optimizer(model)

    def check_applied(self, accelerator, model, plan) -> dict:
        from torch.distributed.tensor import DTensor, Shard

        params = list(model.parameters())
        sharded = [p for p in params if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)]
        if accelerator.num_processes > 1 and not sharded:
            raise RuntimeError("tp planned but no parameter is a sharded DTensor (the model has no tp_plan?)")
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        total = sum(p.numel() for p in params)
        return {
            "wrapper": "tp_plan",
            "tp_degree": accelerator.num_processes,
            "sharded_parameters": len(sharded),
            "parameter_share": local / total,
        }

    def hf_model(self, accelerator, model):
        from ladle.train.runtime.skeleton import meta_skeleton

        return meta_skeleton(model.config)

    def data_parallel(self, accelerator) -> tuple[int, int]:
        return 0, 1  # one replica: every rank reads the same rows

    def no_sync(self, accelerator, model):
        return nullcontext()
