"""The one loss: summed next-token cross-entropy over trained tokens, used by training, its eval and the
evaluate stage (so ``loss`` means the same number everywhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ladle.data.packing import IGNORE
from ladle.train import run_state


def token_loss(model, data: dict[str, torch.Tensor], rows: list[int], device) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over trained tokens of ``rows``, and their count."""
    ids, labels, positions = batch_rows(model, data, rows, device)
    fused = run_state.of(model).fused
    if fused is not None:  # the head computes the loss itself (``training.kernels.fused_loss``)
        return fused.run(model, ids, positions, labels), int((labels[:, 1:] != IGNORE).sum())
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    return token_cross_entropy(logits, labels)


def batch_rows(model, data: dict[str, torch.Tensor], rows: list[int], device) -> tuple[torch.Tensor, ...]:
    """The input ids, labels and position ids of ``rows``, on ``device``: one row of their real tokens where the
    run joins micro-batches (``training.kernels.padding_free``) and that computes less; this rank's slice of
    every row under sequence parallelism (labels shifted before the split: ``Ulysses.split``). What the run
    installed is read from ``model`` (``ladle.train.run_state``)."""
    index = torch.tensor(rows, dtype=torch.long)
    ids, labels, positions = (data[key][index] for key in ("input_ids", "labels", "position_ids"))
    state = run_state.of(model)
    joiner = state.joiner
    if joiner is not None and "real_tokens" in data:
        ids, labels, positions = joiner.join(ids, labels, positions, data["real_tokens"][index])
    ulysses = state.ulysses
    if ulysses is not None:
        ids, labels, positions = ulysses.split(ids, labels, positions)
    return ids.to(device), labels.to(device), positions.to(device)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy of ``logits`` against ``labels`` (batch x seq), and the trained count:
    ``labels[:, 1:]`` are the targets of the first positions (all of them for a sequence-parallel slice, whose
    labels carry one leading column; all but the last otherwise)."""
    targets = labels[:, 1:]
    # Upcast: the loss over the vocabulary is computed in float32 whatever the model dtype.
    loss = F.cross_entropy(
        logits[:, : targets.size(1)].float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return loss, int((targets != IGNORE).sum())
