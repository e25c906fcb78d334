"""Deterministic data order: which packed rows each rank reads at each step.

The order depends only on (seed, epoch), so a resumed run that knows its step
reads exactly the rows an uninterrupted run would have read. Every rank gets
the same number of micro-batches per step (the epoch's tail that does not fill
a global batch is skipped), so no rank waits at an epoch end.
"""

from __future__ import annotations

import math
import random


def steps_per_epoch(rows: int, global_batch: int) -> int:
    return rows // global_batch


def total_steps(rows: int, global_batch: int, max_steps: int, epochs: float) -> int:
    """``max_steps`` when set, else ``epochs`` passes (rounded up)."""
    if max_steps > 0:
        return max_steps
    return max(1, math.ceil(epochs * steps_per_epoch(rows, global_batch)))


def global_batch_rows(step: int, rows: int, global_batch: int, seed: int) -> list[int]:
    """Row indices of the whole global batch at ``step`` (0-based)."""
    per_epoch = steps_per_epoch(rows, global_batch)
    epoch, position = divmod(step, per_epoch)
    order = list(range(rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[position * global_batch : (position + 1) * global_batch]


def rows_visited(steps: int, rows: int, global_batch: int, seed: int) -> list[int]:
    """Every row index some step in ``range(steps)`` reads, sorted: part of the first epoch when the run ends
    within it, else all rows (each epoch's tail that fills no batch is read in another epoch's order)."""
    per_epoch = steps_per_epoch(rows, global_batch)
    if steps >= per_epoch:
        return list(range(rows))
    return sorted(row for step in range(steps) for row in global_batch_rows(step, rows, global_batch, seed))


def micro_batches(batch: list[int], rank: int, world: int, micro: int) -> list[list[int]]:
    """This rank's micro-batches of a global batch: micro-step m takes slot (m * world + rank)."""
    accum = len(batch) // (world * micro)
    return [batch[(m * world + rank) * micro : (m * world + rank + 1) * micro] for m in range(accum)]
