"""Tensor parallelism through transformers' ``tp_plan``: each layer's weights split across ranks.

The base is loaded with ``tp_plan="auto"`` on a 1-D device mesh: the model's own
plan shards attention and MLP projections column- and row-wise as DTensors
(q/k/v and gate/up by output, o/down by input), so every rank holds a slice of
each layer and the collectives inside each block rebuild the full activations.
Every rank therefore sees the same rows: the run has one data-parallel replica
(world size = tensor-parallel degree).

LoRA is refused: peft's adapter adds a full-width product to the base layer's
local, sharded output. Attention and KV heads must divide by the degree.
"""

from __future__ import annotations

from ladle.sizing import memory
from ladle.strategies.base import Strategy
from ladle.strategies.catalog import register
from ladle.strategies.mesh import Dims


class TensorParallel(Strategy):
    runtime = "ladle.train.runtime.tensor:TensorParallelRuntime"
    """Where its worker side is (``ladle.train.runtime``): imported by the worker only."""
    name = "tp"
    loads_lazily = False  # transformers' tp_plan loading reads each rank's slices itself
    summary = "tensor parallel (transformers tp_plan on a DTensor mesh): every layer's weights split across ranks"

    # -- planner side --------------------------------------------------------

    def data_parallel_degree(self, world_size: int, options) -> int:
        return 1  # every rank of the group reads the same rows

    def model_states(self, job, options) -> memory.ModelStates:
        """The decoder layers' projections are split over the ranks with their gradients and optimizer
        state; the embeddings and head are kept whole on each rank (the upper bound: the head's output is
        gathered). Nothing is gathered whole, unlike ZeRO-3."""
        s = job.shape
        per_rank = s.layer_params * s.layers // job.world + s.embedding_params
        return memory.ddp(per_rank)

    def pairs_refusal(self, options) -> str | None:
        return (
            "tensor-parallel heads redistribute their output in hooks and the fused loss is not checked with them; "
            "the pair loss's per-token log-probabilities have not been composed with that layout"
        )

    def validate(self, cfg, topo, target) -> list[str]:
        world_size = target.world_size
        problems = []
        if cfg.training.lora.enabled:
            problems.append(
                "training.lora.enabled = true with parallelism.strategy = tp: peft's LoRA layers cannot wrap "
                "tensor-parallel (sharded) projections. Set training.lora.enabled=false, or use fsdp2/zero3."
            )
        if world_size < 2:
            problems.append(
                "parallelism.strategy = tp: tensor parallelism needs at least 2 processes. Use ddp for one."
            )
        return problems

    def dims(self, options, world_size: int, nodes: int) -> Dims:
        return Dims(tp=world_size)

    def validate_model(self, cfg, model: dict, world_size: int) -> list[str]:
        problems = []
        heads = model.get("num_attention_heads")
        kv = model.get("num_key_value_heads") or heads
        for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            if value and value % world_size:
                problems.append(
                    f"parallelism.strategy = tp over {world_size} ranks: the model's {field} = {value} does not "
                    f"divide by {world_size}. Use a tensor-parallel degree that divides it (--gpus N) or fsdp2."
                )
        return problems


register(TensorParallel())
