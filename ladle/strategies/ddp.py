"""DDP: every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

import dataclasses

from pydantic import Field

from ladle import sizing
from ladle.section import Section
from ladle.sizing import memory
from ladle.strategies.base import Candidate, Strategy, gathered_for_save
from ladle.strategies.catalog import register


class DDPOptions(Section):
    bucket_cap_mb: int = Field(25, ge=1, description="DDP gradient bucket size in MiB.")
    find_unused_parameters: bool = Field(False, description="Let DDP tolerate parameters without gradients.")
    gradient_as_bucket_view: bool = Field(
        True,
        description="Gradients are views into DDP's all-reduce buckets, so a rank holds one copy of them, not two "
        "(the gradients and the reducer's flat buckets). false: torch's default layout, a second copy.",
    )


def grads_in_buckets(job, options) -> bool:
    """Whether a rank's gradients live in the reducer's buckets (views into them), not beside them."""
    return job.world > 1 and options.gradient_as_bucket_view


def second_copy(job, options) -> bool:
    """Whether a rank holds the gradients twice at its peak: beside the reducer's buckets with
    ``gradient_as_bucket_view`` off; with it on, while accumulating (zero_grad sets the views to None, the
    no_sync micro-batches accumulate into fresh tensors, and only the synchronising backward points the
    gradients at the buckets again)."""
    return job.world > 1 and (not options.gradient_as_bucket_view or job.microbatches > job.world)


BROADCAST_BUCKET = 250 * 2**20  # DDP's _sync_module_states bucket


def broadcast_bytes(job) -> int:
    """What DDP's wrap holds while it broadcasts rank 0's weights (``_sync_module_states``): the tensors in
    module order, in buckets closed once they reach 250 MiB (so a bucket can exceed it by its last tensor); a
    bucket of several tensors travels as a flat copy (a single tensor as it is), two buckets in flight.
    Measured on the 128k-vocabulary bench shape: the layers and the head made one 677 MiB bucket, and the
    rank's resident memory rose 675 MiB above its weights."""
    flat, count, size = [], 0, 0
    for tensor in sizing.tensor_sizes(job.shape):
        count, size = count + 1, size + tensor * job.dtype_bytes
        if size >= BROADCAST_BUCKET:
            flat.append(size if count > 1 else 0)
            count, size = 0, 0
    flat.append(size if count > 1 else 0)
    return max(a + b for a, b in zip(flat, [*flat[1:], 0], strict=True))


class DDP(Strategy):
    runtime = "ladle.train.runtime.ddp:DDPRuntime"
    """Where its worker side is (``ladle.train.runtime``): imported by the worker only."""
    name = "ddp"
    summary = "data parallel, full replica per rank, gradients all-reduced"
    options_model = DDPOptions
    options_section = "ddp"
    compiles_blocks = whole_forward = plain_head = autocast = fuses_lora = True
    fallback = True  # the least communication, when nothing can be sized

    def validate(self, cfg, topo, target) -> list[str]:
        return []

    def candidates(self, job, interconnect, cfg) -> list[Candidate]:
        if job.world == 1:
            why = "one device: no communication"
        elif job.lora:
            why = "adapter gradients are tiny, so one all-reduce per step is the least communication"
        else:
            why = "a full replica fits, and one gradient all-reduce is the least communication"
        return [Candidate(self, 0, why)]

    def model_states(self, job, options) -> memory.ModelStates:
        """A full replica. With more than one rank the reducer's flat buckets hold the gradients
        (``gradient_as_bucket_view``); ``second_copy`` says when a second copy sits beside them."""
        params = job.shape.params
        states = memory.fp32(params) if job.dtype_bytes == 4 else memory.ddp(params)
        if not second_copy(job, options):
            return states
        buckets = job.dtype_bytes * params
        return memory.ModelStates(states.weights, states.gradients + buckets, states.optimizer, states.gathered)

    def estimate(self, job, options):
        """A LoRA run's reducer holds flat buckets of the trained gradients too (the adapters', and those of a
        modules_to_save copy, which can be as large as the head): a second copy when ``second_copy``."""
        est = super().estimate(job, options)
        if not job.lora or not second_copy(job, options):
            return est
        return dataclasses.replace(est, gradients=est.gradients + job.dtype_bytes * job.shape.trainable)

    def save_bytes(self, job, options, states) -> int:
        """With the gradients in the reducer's buckets, zero_grad frees nothing: it sets the views to None, and
        the buckets stay allocated (the next backward points the gradients at them again).

        zero_grad keeps torch's set_to_none=True. Zeroing the views in place instead (set_to_none=False, which
        would let accumulation micro-batches add into the buckets) raised the next forward/backward's peak by
        838 MiB on the 0.38B bench model's full fine-tune (7 798 against 6 960 MiB, traced phase by phase)."""
        if not grads_in_buckets(job, options):
            return super().save_bytes(job, options, states)
        return gathered_for_save(job)

    def load_bytes(self, job, options, states) -> int:
        """Loading reads one tensor at a time; once it is done, wrapping broadcasts rank 0's weights
        (``broadcast_bytes``): the larger of the two transients, beside the weights."""
        read = job.shape.largest_tensor * job.dtype_bytes
        return super().load_bytes(job, options, states) - read + max(read, broadcast_bytes(job))


register(DDP())
