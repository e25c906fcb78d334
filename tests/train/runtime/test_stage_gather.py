"""A pipeline's full weights sent to rank 0 a part at a time (``gather_parts_to_rank0``): real gloo processes,
2 stages of 2 ranks each, every stage's tensors sharded over its own ranks as an N-D mesh holds them."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tests.helpers import run_ranks

SHAPES = {"a": (6, 4), "b": (10,), "c": (4, 2)}  # 96, 40 and 32 bytes of float32
MAX_BYTES = 100


def full(stage: int, name: str) -> torch.Tensor:
    shape = SHAPES[name]
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * stage + ord(name)


def rank_main(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from ladle.train.runtime.pipeline_stage import gather_parts_to_rank0, gather_to_rank0

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage, lead = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank() == 0
        tensors = {f"stage{stage}.{n}": distribute_tensor(full(stage, n), mesh["dp"], [Shard(0)]) for n in SHAPES}
        gathers = []

        @contextmanager
        def whole(tensor):
            gathers.append(tensor.to_local().numel())
            yield tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

        parts = [
            None if part is None else {k: v.numpy() for k, v in part.items()}
            for part in gather_parts_to_rank0(tensors, "cpu", MAX_BYTES, lead, whole)
        ]
        in_parts = len(gathers)
        merged = gather_to_rank0(tensors, "cpu", lead, whole)  # as N-D meshes send their adapters
        merged = None if merged is None else {k: v.numpy() for k, v in merged.items()}
        queue.put((rank, stage, parts, (in_parts, len(gathers)), merged))
    finally:
        dist.destroy_process_group()


def test_stages_reach_rank_0_a_part_at_a_time_and_whole():
    got = {rank: rest for rank, *rest in run_ranks(rank_main, 4)}
    expected = {f"stage{s}.{n}": full(s, n) for s in (0, 1) for n in SHAPES}
    stage0, parts, gathers, merged = got[0]
    # Every rank iterated the same parts; only rank 0 received anything.
    assert all(len(other[1]) == len(parts) for other in got.values())
    assert all(part is None for rank in (1, 2, 3) for part in got[rank][1])
    # Parts of at most MAX_BYTES (a larger tensor alone), in stage order, together the whole model.
    assert [sorted(p) for p in parts] == [
        ["stage0.a"],
        ["stage0.b", "stage0.c"],
        ["stage1.a"],
        ["stage1.b", "stage1.c"],
    ]
    for part in parts:
        assert len(part) == 1 or sum(v.nbytes for v in part.values()) <= MAX_BYTES
    received = {name: torch.from_numpy(v) for part in parts for name, v in part.items()}
    assert received.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(received[name], tensor), name
    # Each rank joined the gathers of its own stage's tensors only, the non-lead ranks included.
    assert stage0 == 0 and all(g == (len(SHAPES), 2 * len(SHAPES)) for _, _, g, _ in got.values())
    # As one part (adapters): the same tensors, on rank 0 only.
    assert merged.keys() == expected.keys() and all(got[rank][3] is None for rank in (1, 2, 3))
    for name, tensor in expected.items():
        assert torch.equal(torch.from_numpy(merged[name]), tensor), name
