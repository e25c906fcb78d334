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


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.named_parameters() if v.requires_grad}


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
    """Gather every rank's RNG, then rank 0 writes the checkpoint and its marker."""
    from accelerate.utils import gather_object

    rngs = gather_object([rng_state()])
    if accelerator.is_main_process:
        payload = {
            "step": step,
            "model": trainable_state(accelerator.unwrap_model(model)),
            "optimizer": optimizer.state_dict(),
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
    """Restore the newest complete checkpoint into the (unwrapped) model, optimizer and scheduler."""
    steps = complete_steps(root)
    if not steps:
        return None
    payload = torch.load(io.BytesIO(storage.read_bytes(storage.join(step_dir(root, steps[-1]), "state.pt"))), weights_only=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in payload["model"].items():
            params[name].copy_(value)
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    set_rng_state(payload["rng"][rank])
    return ResumeState(step=payload["step"], losses=payload["losses"], eval_before=payload["eval_before"])
