"""What decides a trained model, as one fingerprint: the data (``prepare.fingerprint``), the base's weights and
every training setting that changes what is learned. Scheduled retraining skips a run only when the champion was
trained from the same fingerprint, so a new base with the same tokenizer, or a changed learning rate, retrains."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ladle.config import LadleConfig
from ladle.lifecycle.copies import base_signature

__all__ = ["base_signature", "fingerprint_of", "parts", "run_fingerprint"]

VERSION = "1"  # bump when the same inputs should fingerprint differently
HOW_IT_RUNS = {"eval_micro_batch_size", "checkpoint_every", "eval_every", "save_shard_mib", "preempt_grace_s"}
"""Training settings that change how a run proceeds, not what it learns (left out of the fingerprint)."""
TAG = "ladle.run_fingerprint"
"""The registered version's tag that holds it."""
PARTS_TAG = "ladle.run_fingerprint.parts"
"""The registered version's tag that holds what it is made of (``parts``, as JSON)."""


def parts(cfg: LadleConfig, data_fingerprint: str, base_dir: Path) -> dict:
    """What the fingerprint is made of: ``task``, the data's fingerprint, the base's signature and the training
    settings that decide the trained weights (``training.*`` but ``HOW_IT_RUNS``; LoRA and quantization
    included). Kept on each registered version (``PARTS_TAG``) so a later run can say what changed."""
    training = cfg.training.model_dump(mode="json", exclude=HOW_IT_RUNS)
    found = {"task": cfg.task, "data": data_fingerprint, "base": base_signature(base_dir), "training": training}
    if cfg.training.objective == "grpo":  # what the rewards' files say decides the weights as much as their names
        from ladle import rewards

        found["rewards"] = rewards.digest(rewards.bundle(cfg.training.rl.rewards), cfg.training.rl.rewards)
        if cfg.training.rl.environment:  # the environment's file, as the rewards' files
            from ladle.agents import environments

            entry = cfg.training.rl.environment
            found["environment"] = environments.digest(entry, environments.bundle(entry))
    return found


def fingerprint_of(payload: dict) -> str:
    text = f"ladle-run/{VERSION}/" + json.dumps(payload, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def run_fingerprint(cfg: LadleConfig, data_fingerprint: str, base_dir: Path) -> str:
    """Hash of ``parts``."""
    return fingerprint_of(parts(cfg, data_fingerprint, base_dir))


def flatten(settings: dict, prefix: str = "training.") -> dict:
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def what_changed(before: dict | None, now: dict) -> list[str]:
    """What differs between the ``parts`` a version was trained from (``before``; None: not recorded) and
    ``now``, in words: ``data``, ``base weights``, ``task``, and each training setting as ``name old -> new``."""
    if before is None:
        return ["the champion has no recorded inputs (registered before they were kept)"]
    changed = []
    if before.get("task") != now["task"]:
        changed.append(f"task {before.get('task')} -> {now['task']}")
    if before.get("data") != now["data"]:
        changed.append("data (files, tokenizer or data options)")
    if before.get("base") != now["base"]:
        changed.append("base weights")
    if before.get("rewards") != now.get("rewards"):
        changed.append("reward functions (their settings or files)")
    old, new = flatten(before.get("training") or {}), flatten(now["training"])
    changed += [
        f"{key} {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]
    return changed
