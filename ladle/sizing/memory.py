"""Per-rank memory of model states (weights, gradients, optimizer), by strategy.

Bytes per parameter with mixed-precision AdamW, the layout DeepSpeed assumes:
16-bit weights (2), 16-bit gradients (2), and 16 bytes of fp32 state (32-bit
gradient copy 4, master weights 4, Adam moments 8). What a strategy shards is
divided by the ranks it is sharded over; what is offloaded moves to host
memory. Where DeepSpeed publishes an estimator (ZeRO-2, ZeRO-3), these
figures agree with it (tested). Activations and logits are not modelled here.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_16 = 2
GRAD_16 = 2
FP32_STATES = 16  # fp32 gradient copy 4 + master weights 4 + Adam m 4 + Adam v 4
HOST_BUFFER = 1.5  # DeepSpeed's additional_buffer_factor for pinned host buffers


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank on the device, and bytes per node in host memory."""

    weights: int
    gradients: int
    optimizer: int
    gathered: int  # parameters (and gradients) of the largest layer, materialised whole during compute
    host: int = 0

    @property
    def device(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.gathered


def ddp(params: int) -> ModelStates:
    """Full replica per rank: nothing is sharded."""
    return ModelStates(WEIGHT_16 * params, GRAD_16 * params, FP32_STATES * params, 0)


def zero1(params: int, ranks: int) -> ModelStates:
    """Optimizer states sharded; 16-bit weights and gradients replicated."""
    return ModelStates(WEIGHT_16 * params, GRAD_16 * params, FP32_STATES * params // ranks, 0)


def zero2(params: int, gpus_per_node: int, nodes: int = 1, offload_optimizer: bool = False) -> ModelStates:
    """Gradients and optimizer states sharded over all ranks; offload moves the fp32 states to the host."""
    ranks = gpus_per_node * nodes
    if offload_optimizer:
        host = int(params * max(4 * ranks, FP32_STATES) * HOST_BUFFER)
        return ModelStates(WEIGHT_16 * params, 0, 0, 0, host)
    host = int(params * 4 * gpus_per_node * HOST_BUFFER)  # fp32 weights staged per process while loading
    return ModelStates(WEIGHT_16 * params, 0, int((GRAD_16 + FP32_STATES) * params / ranks), 0, host)


def zero3(
    params: int,
    largest_layer: int,
    gpus_per_node: int,
    nodes: int = 1,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> ModelStates:
    """Weights, gradients and optimizer states all sharded; the largest layer is gathered whole (16-bit weight + gradient)."""
    ranks = gpus_per_node * nodes
    gathered = (WEIGHT_16 + GRAD_16) * largest_layer
    if offload_optimizer and offload_params:
        return ModelStates(0, 0, 0, gathered, int(params * (WEIGHT_16 + FP32_STATES) / nodes * HOST_BUFFER))
    if offload_optimizer:
        return ModelStates(
            int(WEIGHT_16 * params / ranks), 0, 0, gathered, int(params * FP32_STATES / nodes * HOST_BUFFER)
        )
    host = int(largest_layer * 4 * gpus_per_node * HOST_BUFFER)
    return ModelStates(0, 0, int((WEIGHT_16 + FP32_STATES) * params / ranks), gathered, host)


def lora(params: int, trainable: int, ranks: int = 1, shard_base: bool = False) -> ModelStates:
    """LoRA: a frozen 16-bit base, states only for what is trained (the adapters and any ``modules_to_save``
    copies); under FSDP2/ZeRO-3 (``shard_base``) both are sharded over ``ranks``."""
    r = ranks if shard_base else 1
    return ModelStates(
        WEIGHT_16 * params // r + WEIGHT_16 * trainable // r, GRAD_16 * trainable // r, FP32_STATES * trainable // r, 0
    )


def fp32(params: int, ranks: int = 1) -> ModelStates:
    """A float32 run (CPU): 4-byte weights and gradients, torch AdamW's two 4-byte moments, all divided over
    ``ranks`` (no master copy: the weights are their own)."""
    return ModelStates(4 * params // ranks, 4 * params // ranks, 8 * params // ranks, 0)
