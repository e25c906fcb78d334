"""N-D meshes on CUDA (NCCL, bf16): FSDP2 x TP and PP x FSDP2 against one GPU. Needs at least 2 GPUs for
tp=2 / pp=2 and 4 for the 2-D meshes; skipped where there are fewer (a 1-GPU machine runs none of it)."""

from __future__ import annotations

import pytest

from tests.helpers import strategy_spec, visible_gpus

pytestmark = [pytest.mark.gpu]
FULL = ("training.lora.enabled=false", "training.dtype=bfloat16", "training.global_batch_size=8")


@pytest.mark.parametrize(
    ("gpus", "dims", "mesh"),
    [
        (2, ["parallelism.dims.tp=2"], {"tp": 2}),
        (2, ["parallelism.dims.pp=2"], {"pp": 2}),
        (4, ["parallelism.dims.tp=2"], {"dp_shard": 2, "tp": 2}),
        (4, ["parallelism.dims.pp=2"], {"pp": 2, "dp_shard": 2}),
    ],
)
def test_mesh_matches_one_gpu(gpus, dims, mesh, tmp_path, tiny_model):
    if (have := visible_gpus()) < gpus:
        pytest.skip(f"needs {gpus} GPUs, this session sees {have}")
    from ladle.machine.topology import probe
    from ladle.train.run import launch

    one = launch(strategy_spec("ddp", tmp_path / "one", "parallelism.gpus=1", *FULL, topo=probe()))
    spec = strategy_spec("nd", tmp_path / "nd", f"parallelism.gpus={gpus}", *FULL, *dims, topo=probe())
    assert (spec.plan.device, spec.plan.backend, spec.plan.world_size) == ("cuda", "nccl", gpus)
    result = launch(spec)
    assert {k: v for k, v in result.sharding["mesh"].items() if v > 1} == mesh
    # bf16 compute: the first loss agrees to bf16's precision, not float32's
    assert result.train_losses[0] == pytest.approx(one.train_losses[0], rel=1e-2)
    assert result.eval_loss_after < result.eval_loss_before
