"""FSDP2's all-gather on gloo: gloo's own all-gather against ladle's in-place broadcasts (``runtime.gloo_gather``).

    .venv/bin/python bench/gloo_gather.py

2 processes, one thread each; per unit size, the two alternate 3 times (10 gathers each) and the best
per-gather time of each is reported.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
SIZES_MIB = (1, 6, 24, 96)


def rank_main(rank: int, world: int, port: int, queue) -> None:
    from ladle.train.runtime.gloo_gather import InPlaceAllGather

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    in_place = InPlaceAllGather()
    rows = []
    for mib in SIZES_MIB:
        part = mib * 2**20 // 4 // world
        shard = torch.randn(part)
        best = {}
        for name in ("gloo all_gather", "in place") * 3:
            out = torch.empty(part * world)
            slot = out.narrow(0, rank * part, part)
            slot.copy_(shard)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(10):
                if name == "in place":
                    in_place(out, slot, dist.group.WORLD)
                else:
                    dist.all_gather_into_tensor(out, slot)
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - start) / 10 * 1000)
        rows.append({"unit_mib": mib, **{f"{k} ms": v for k, v in best.items()}})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    from common import save

    from ladle.platform.processes import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    for row in rows:
        print(row, flush=True)
    save("gloo_gather", {"rows": rows})


if __name__ == "__main__":
    main()
