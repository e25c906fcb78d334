"""Resumable checkpoints, written so that a crash never leaves one that looks complete.

A checkpoint is ``<run>/checkpoints/step-NNNNNNNN/state.pt`` plus the store's
``_COMPLETE`` marker, written last. It holds the trainable weights, optimizer
and scheduler state, every rank's RNG state and the loss history; the data
position is the step number itself (see ``ladle.train.schedule``).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import torch

from ladle import storage

KEEP_LAST = 2


@dataclass
class ResumeState:
    step: int
    losses: list[float]
    eval_before: float


def step_dir(root: str, step: int) -> str:
    return storage.join(root, f"step-{step:08d}")


def complete_steps(root: str) -> list[int]:
    """Steps with a complete checkpoint under ``root``, ascending."""
    steps = []
    for name in storage.list_dirs(root):
        if name.startswith("step-") and name[5:].isdigit() and storage.is_complete(storage.join(root, name)):
            steps.append(int(name[5:]))
    return sorted(steps)


def state_options(trainable_only: bool = True, **extra):
    """Full (unsharded) state, gathered to CPU on rank 0: the same checkpoint layout
    whatever the strategy (DDP replica or FSDP2 shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only, **extra)


def inner(optimizer):
    """The torch optimizer under accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(accelerator, root: str, step: int, model, optimizer, scheduler, losses, eval_before) -> None:
    """Gather the full trainable state and every rank's RNG (collectives), then rank 0 writes."""
    from accelerate.utils import gather_object
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rngs = gather_object([rng_state()])
    model_state, optim_state = get_state_dict(model, inner(optimizer), options=state_options())
    if accelerator.is_main_process:
        payload = {
            "step": step,
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "rng": rngs,
            "losses": losses,
            "eval_before": eval_before,
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        target = step_dir(root, step)
        storage.remove(target)  # a partial folder from a crashed attempt
        storage.write_bytes(storage.join(target, "state.pt"), buffer.getvalue())
        storage.mark_complete(target)
        for old in complete_steps(root)[:-KEEP_LAST]:
            storage.remove(step_dir(root, old))
    accelerator.wait_for_everyone()


def load_latest(root: str, model, optimizer, scheduler, rank: int) -> ResumeState | None:
    """Restore the newest complete checkpoint into the wrapped model, optimizer and scheduler (all ranks)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    steps = complete_steps(root)
    if not steps:
        return None
    payload = torch.load(io.BytesIO(storage.read_bytes(storage.join(step_dir(root, steps[-1]), "state.pt"))), weights_only=False)
    set_state_dict(model, inner(optimizer), model_state_dict=payload["model"], optim_state_dict=payload["optimizer"],
                   options=state_options(strict=False))  # fmt: skip
    scheduler.load_state_dict(payload["scheduler"])
    set_rng_state(payload["rng"][rank])
    return ResumeState(step=payload["step"], losses=payload["losses"], eval_before=payload["eval_before"])
