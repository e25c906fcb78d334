"""FSDP2's and ZeRO-3's all-gathers on gloo (CPU hosts) without gloo's second copy of every gathered unit.

FSDP2 copies this rank's shards into its slot of a flat output buffer and all-gathers into that buffer. Gloo's
all-gather does not write the output it is given: it receives every rank's part into a flat buffer of its own,
then copies it out, so each gather holds the unit twice. Traced on the memory-truth test's model (FSDP2, LoRA,
2 ranks): a rank's peak sits inside the backward's prefetch all-gather, with the layer being differentiated,
the prefetched layer's output and gloo's copy of it alive at once.

Here every rank broadcasts its slot of FSDP2's buffer in place (gloo's broadcast sends and receives the tensor
it is given, a contiguous slice here), one broadcast per rank: the bytes each rank sends and receives are those
of the all-gather, and no second buffer exists. The broadcasts run before the call returns; on a CPU host the
collective and the compute share the cores, so FSDP2's prefetch has little to overlap anyway.
NCCL writes the output in place already: GPU runs keep FSDP2's own all-gather.

ZeRO-3 gathers the same way (a flat buffer, this rank's partition copied into its slot, then
``all_gather_into_tensor``), and gloo makes the same second copy; DeepSpeed has no hook for its gather, so its
module-level ``_dist_allgather_fn`` is replaced for the run (``use_in_place_gather_for_zero3``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin


def all_gather_in_place(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None):
    """Gather every rank's ``input_tensor`` into the flat ``output_tensor`` (rank r's at slot r), one broadcast
    per rank in place; returns once done."""
    group = group if group is not None else dist.group.WORLD
    part = input_tensor.numel()
    for rank in range(dist.get_world_size(group)):
        slot = output_tensor.narrow(0, rank * part, part)
        if rank == dist.get_rank(group) and slot.data_ptr() != input_tensor.data_ptr():
            slot.copy_(input_tensor.reshape(-1))  # FSDP2 and DeepSpeed pass their view of this slot; else copied in
        dist.broadcast(slot, src=dist.get_global_rank(group, rank), group=group)


class InPlaceAllGather(DefaultAllocMixin, AllGather):
    """FSDP2's ``AllGather`` (its own buffer allocation) as one in-place broadcast per rank
    (``set_custom_all_gather``)."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        all_gather_in_place(output_tensor, input_tensor, group)
        return None  # done: FSDP2 waits only on a returned Work


def use_in_place_gather(modules, device: torch.device) -> int:
    """Give each FSDP2 module on a CPU (gloo) run the in-place all-gather; returns how many got it."""
    if device.type != "cpu":
        return 0
    for module in modules:
        module.set_custom_all_gather(InPlaceAllGather())
    return len(modules)


class Finished:
    """The handle of a collective that has completed: what DeepSpeed's gather handles wait on."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


def use_in_place_gather_for_zero3(device: torch.device) -> bool:
    """On a CPU (gloo) run, ZeRO-3's parameter gathers broadcast in place; True when they do.

    DeepSpeed (0.16-0.19) sends every coalesced and per-parameter fetch through
    ``partition_parameters._dist_allgather_fn(input, output, group)`` and waits on the handle it returns. A
    DeepSpeed without that function keeps its own gather, and the run's ``sharding`` says so.
    """
    if device.type != "cpu":
        return False
    from deepspeed.runtime.zero import partition_parameters

    current = getattr(partition_parameters, "_dist_allgather_fn", None)
    if current is None:
        return False
    if getattr(current, "in_place", False):
        return True

    def gather(input_tensor, output_tensor, group=None):
        all_gather_in_place(output_tensor, input_tensor, group)
        return Finished()

    gather.in_place = True
    partition_parameters._dist_allgather_fn = gather
    return True
