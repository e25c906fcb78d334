"""Merge stage: fold the LoRA adapter into the base and write a standalone model.

The result is a plain Hugging Face folder (safetensors + tokenizer) that loads
without peft. A full fine-tune has nothing to merge; its saved model is copied
through unchanged so every later stage sees the same shape of output.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field

from ladle import storage
from ladle.train.spec import TrainResult


class MergedModel(BaseModel):
    url: str = Field(description="Folder of the merged model in the artifact store.")
    sha256: str = Field(description="Hash of the merged weights file(s).")
    parameters: int


def merge_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path) -> int:
    """``merge_and_unload`` the adapter into the base (float32) and save it; returns the parameter count."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)
    return sum(p.numel() for p in merged.parameters())


def count_saved(folder: Path) -> int:
    """Parameters stored in a folder's safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            total += sum(_prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (not iterable)
    return total


def _prod(shape) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def weights_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        digest.update(file.read_bytes())
    return digest.hexdigest()


def merge(base_dir: Path, result: TrainResult, run_url: str) -> MergedModel:
    """Merge the trained adapter (or pass the full model through) into ``<run>/merged``."""
    url = storage.join(run_url, "merged")
    with tempfile.TemporaryDirectory(prefix="ladle-merge-") as tmp:
        out = Path(tmp) / "merged"
        if result.adapter_url:
            adapter = storage.download_dir(result.adapter_url, Path(tmp) / "adapter")
            params = merge_adapter(base_dir, adapter, out)
        else:
            storage.download_dir(result.model_url, out)
            params = count_saved(out)
        storage.remove(url)
        storage.upload_dir(out, url)
        return MergedModel(url=url, sha256=weights_hash(out), parameters=params)
