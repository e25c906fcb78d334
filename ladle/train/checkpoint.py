"""Resumable checkpoints, written so that a crash never leaves one that looks complete.

A checkpoint is ``<run>/checkpoints/step-NNNNNNNN/`` with ``state.pt`` and the
store's ``_COMPLETE`` marker, written last. ``state.pt`` holds the scheduler
state, every rank's RNG state, the loss history and the strategy's ``format``;
the data position is the step number itself (see ``ladle.train.schedule``).
Where the weights and optimizer state go is the strategy's choice
(``Runtime.save_state``), and no strategy gathers them on one rank: strategy-neutral
ones (DDP, FSDP2, tensor parallel) write a torch distributed checkpoint of the
trainable state under ``engine/``, each rank its own shards, which any such
strategy resumes from at any world size; native ones (DeepSpeed's per-rank engine
files, one file per pipeline stage, N-D's stage modules) write their own files
there too, so they resume only with the same strategy and world size. The caller
passes the plan's strategy runtime (``ladle.train.runtime``).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field

import torch

from ladle.platform import storage

KEEP_LAST = 2
NATIVE_TAG = "engine"  # the folder a strategy's checkpoint files (DCP or native) live in


@dataclass
class ResumeState:
    step: int
    losses: list[float]
    eval_before: float
    extra: dict = field(default_factory=dict)  # the objective's own running figures (grpo: its first reward, ...)


def step_dir(root: str, step: int) -> str:
    return storage.join(root, f"step-{step:08d}")


def complete_steps(root: str) -> list[int]:
    """Steps with a complete checkpoint under ``root``, ascending."""
    steps = []
    for name in storage.list_dirs(root):
        if name.startswith("step-") and name[5:].isdigit() and storage.is_complete(storage.join(root, name)):
            steps.append(int(name[5:]))
    return sorted(steps)


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


def save(
    accelerator, root: str, step: int, model, optimizer, scheduler, losses, eval_before, plan, runtime, extra=None
) -> None:
    """Gather every rank's RNG and the training state (collectives), then mark the step complete. ``extra``: the
    objective's running figures a resumed run reports as the uninterrupted one would (plain numbers only).

    Every rank writes and uploads its own files (a DCP checkpoint, or the strategy's native ones) before
    rank 0 writes ``state.pt`` and the marker.
    """
    import tempfile

    from accelerate.utils import gather_object

    target = step_dir(root, step)
    rngs = gather_object([rng_state()])
    payload = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "rng": rngs,
        "losses": losses,
        "eval_before": eval_before,
        "extra": dict(extra or {}),
        "strategy": plan.strategy,
        "world_size": plan.world_size,
        "format": checkpoint_format(runtime),
    }
    if accelerator.is_main_process:
        storage.remove(target)  # a partial folder from a crashed attempt
    accelerator.wait_for_everyone()
    with tempfile.TemporaryDirectory(prefix="ladle-ckpt-") as tmp:
        payload.update(runtime.save_state(model, optimizer, tmp, NATIVE_TAG))
        storage.upload_dir(tmp, target, complete=False)  # each rank its own files
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        storage.write_bytes(storage.join(target, "state.pt"), buffer.getvalue())
        storage.mark_complete(target)
        for old in complete_steps(root)[:-KEEP_LAST]:
            storage.remove(step_dir(root, old))
    accelerator.wait_for_everyone()


def checkpoint_format(runtime) -> str:
    """``native``: the strategy's own files (same strategy and world size to resume); ``dcp``: a strategy-neutral
    torch distributed checkpoint."""
    return "native" if runtime.strategy.native_checkpoint else "dcp"


def load_latest(accelerator, root: str, model, optimizer, scheduler, plan, runtime) -> ResumeState | None:
    """Restore the newest complete checkpoint into the wrapped model, optimizer and scheduler (all ranks);
    ``runtime`` is the plan's strategy's, which reads its own files.

    Raises:
        RuntimeError: the checkpoint was written in a native format by another strategy or world size.
    """
    steps = complete_steps(root)
    if not steps:
        return None
    target = step_dir(root, steps[-1])
    # weights_only: whoever can write to the store must not run code on the training hosts.
    payload = torch.load(io.BytesIO(storage.read_bytes(storage.join(target, "state.pt"))), weights_only=True)
    fmt = payload.get("format", "full")
    if fmt == "full":
        raise RuntimeError(
            f"checkpoint {target} holds the gathered full state of an earlier ladle version, which this version "
            "no longer reads (it writes per-rank shards). Start a new run (another output folder or run name)."
        )
    wanted = checkpoint_format(runtime)
    same_run_shape = payload.get("strategy") == plan.strategy and payload.get("world_size") == plan.world_size
    if fmt != wanted or (fmt == "native" and not same_run_shape):
        raise RuntimeError(
            f"checkpoint {target} was written by {payload.get('strategy')} on {payload.get('world_size')} rank(s) "
            f"({fmt} format); this run is {plan.strategy} on {plan.world_size}. Resume with the same strategy and "
            "world size, or start a new run (another output folder or run name)."
        )
    runtime.load_state(model, optimizer, payload, target, NATIVE_TAG)  # it reads what it needs from there
    scheduler.load_state_dict(payload["scheduler"])
    rngs = payload["rng"]  # one per rank that wrote it; a DCP checkpoint may resume on more ranks
    set_rng_state(rngs[accelerator.process_index % len(rngs)])
    return ResumeState(
        step=payload["step"],
        losses=payload["losses"],
        eval_before=payload["eval_before"],
        extra=dict(payload.get("extra") or {}),
    )
