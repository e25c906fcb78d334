"""FSDP2's in-place all-gather for gloo (``runtime.gloo_gather``) against gloo's own all-gather: real processes,
the whole world and a sub-group whose ranks are not the global ones (HSDP's shard groups)."""

from __future__ import annotations

import torch

from tests.helpers import run_ranks


def rank_main(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    from ladle.train.runtime.gloo_gather import InPlaceAllGather

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tail = dist.new_group([1, 2])  # every rank makes it; ranks 1 and 2 are its 0 and 1
        results = {}
        for name, group in (("world", dist.group.WORLD), ("tail", tail)):
            if rank not in dist.get_process_group_ranks(group):
                continue
            size, mine = dist.get_world_size(group), dist.get_rank(group)
            part = 5
            shard = torch.arange(part, dtype=torch.float32) + 100 * rank
            expected = torch.empty(part * size)
            dist.all_gather_into_tensor(expected, shard, group=group)
            out = torch.full((part * size,), float("nan"))
            slot = out.narrow(0, mine * part, part)
            slot.copy_(shard)  # as FSDP2's copy-in does: the input is this rank's slot of the output
            assert InPlaceAllGather()(out, slot, group) is None
            loose = torch.full((part * size,), float("nan"))
            InPlaceAllGather()(loose, shard.clone(), group)  # an input outside the output is copied in
            results[name] = (out.numpy(), loose.numpy(), expected.numpy())
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def test_in_place_gather_equals_gloo_all_gather_on_the_world_and_a_sub_group():
    got = dict(run_ranks(rank_main, 3))
    assert sorted(got) == [0, 1, 2] and "tail" not in got[0] and "tail" in got[1]
    for rank, results in got.items():
        for name, (out, loose, expected) in results.items():
            ranks = [0, 1, 2] if name == "world" else [1, 2]
            assert torch.equal(torch.from_numpy(expected), torch.cat([torch.arange(5.0) + 100 * r for r in ranks]))
            assert torch.equal(torch.from_numpy(out), torch.from_numpy(expected)), (rank, name)
            assert torch.equal(torch.from_numpy(loose), torch.from_numpy(expected)), (rank, name)
