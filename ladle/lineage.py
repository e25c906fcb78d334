"""What decides a trained model, as one fingerprint: the data (``prepare.fingerprint``), the base's weights and
every training setting that changes what is learned. Scheduled retraining skips a run only when the champion was
trained from the same fingerprint, so a new base with the same tokenizer, or a changed learning rate, retrains."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ladle.config import LadleConfig

VERSION = "1"  # bump when the same inputs should fingerprint differently
HOW_IT_RUNS = {"eval_micro_batch_size", "checkpoint_every", "eval_every", "save_shard_mib"}
"""Training settings that change how a run proceeds, not what it learns (left out of the fingerprint)."""
SAMPLE = 1 << 16
TAG = "ladle.run_fingerprint"
"""The registered version's tag that holds it."""


def base_signature(base_dir: Path) -> str:
    """The base's ``config.json`` and, per weight file, its name, its size and three 64 KiB samples (the start,
    which holds a safetensors file's header of names, dtypes and shapes; the middle; the end). Reading whole
    weights would take minutes for a 70B base; any retrained or re-quantized checkpoint differs in these."""
    digest = hashlib.sha256((base_dir / "config.json").read_bytes())
    for file in sorted([*base_dir.glob("*.safetensors"), *base_dir.glob("*.bin")]):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as handle:
            for offset in sorted({0, max(size // 2 - SAMPLE // 2, 0), max(size - SAMPLE, 0)}):
                handle.seek(offset)
                digest.update(handle.read(SAMPLE))
    return digest.hexdigest()


def run_fingerprint(cfg: LadleConfig, data_fingerprint: str, base_dir: Path) -> str:
    """Hash of the data's fingerprint, the base's signature, ``task`` and the training settings that decide
    the trained weights (``training.*`` but ``HOW_IT_RUNS``; LoRA and quantization included)."""
    training = cfg.training.model_dump(mode="json", exclude=HOW_IT_RUNS)
    payload = {"task": cfg.task, "data": data_fingerprint, "base": base_signature(base_dir), "training": training}
    text = f"ladle-run/{VERSION}/" + json.dumps(payload, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]
