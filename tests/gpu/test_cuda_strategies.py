"""Each strategy that can run on one GPU trains there on CUDA (NCCL). Skipped without CUDA."""

from __future__ import annotations

import pytest

from tests.helpers import needs_gpus, strategy_spec

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(),
]


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "zero++", "fsdp2"])
def test_strategy_trains_on_one_gpu(name, tmp_path, tiny_model):
    from ladle.machine.topology import probe
    from ladle.train.run import launch

    spec = strategy_spec(name, tmp_path, "parallelism.gpus=1", "training.global_batch_size=4", topo=probe())
    assert (spec.plan.device, spec.plan.backend, spec.plan.world_size) == ("cuda", "nccl", 1)
    result = launch(spec)
    assert (result.strategy, result.world_size) == (name, 1)
    assert result.eval_loss_after < result.eval_loss_before
    assert result.peak_memory_mib > 0  # the CUDA allocator's peak


@pytest.mark.parametrize(
    ("name", "offload"),
    [
        ("zero2", "parallelism.deepspeed.offload_optimizer=cpu"),
        ("zero3", "parallelism.deepspeed.offload_optimizer=cpu"),
        ("fsdp2", "parallelism.fsdp2.cpu_offload=true"),
    ],
)
def test_offload_trains_on_one_gpu(name, offload, tmp_path, tiny_model):
    """Optimizer offload runs: DeepSpeed builds its own AdamW (DeepSpeedCPUAdam, compiled on first use) from
    the rendered config; FSDP2's CPUOffloadPolicy keeps the loaded shards on the host."""
    from ladle.machine.topology import probe
    from ladle.train.run import launch

    spec = strategy_spec(name, tmp_path, "parallelism.gpus=1", "training.global_batch_size=4", offload, topo=probe())
    if name.startswith("zero"):
        assert spec.plan.launcher_config["optimizer"]["type"] == "AdamW"
    result = launch(spec)
    assert result.eval_loss_after < result.eval_loss_before
