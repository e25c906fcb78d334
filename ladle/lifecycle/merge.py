"""Merge stage: fold the LoRA adapter into the base and write a standalone model.

The result is a plain Hugging Face folder (safetensors + tokenizer) that loads
without peft. A full fine-tune has nothing to merge; its saved model is copied
through unchanged so every later stage sees the same shape of output.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field

from ladle.platform import storage
from ladle.train.spec import TrainResult


class MergedModel(BaseModel):
    url: str = Field(description="Folder of the merged model in the artifact store.")
    sha256: str = Field(description="Hash of the merged weights file(s).")
    parameters: int
    adapter_url: str | None = Field(None, description="The LoRA adapter it was merged from (null: a full fine-tune).")
    adapter_sha256: str | None = Field(None, description="Hash of the adapter's weights file.")
    base_signature: str | None = Field(None, description="Signature of the base the adapter was trained on.")
    weights_dtype: str = Field("float32", description="The dtype the weights were trained in.")


def merge_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path, dtype: str = "float32") -> int:
    """Fold a LoRA adapter into the base, streaming: one base shard file at a time, written as it is finished.

    Each output file mirrors a base file (same name and tensors, and the base's index when it has one), so
    memory holds one base shard plus the adapter, never the whole model: a 70B base in 5 GB shards merges in
    ~10 GB of RAM instead of 280 GB. ``W + (alpha / r) * B @ A`` is computed in float32 per tensor and stored in
    ``dtype`` (the training dtype: bf16 weights stay bf16); ``modules_to_save`` tensors replace the base's.
    Writes config.json (with the stored dtype), generation_config.json and the adapter's tokenizer; returns
    the parameter count.

    Raises:
        ValueError: an adapter this merge cannot fold exactly (DoRA, per-module rank/alpha patterns,
            fan-in-fan-out layers, LoRA biases), named with the setting.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from ladle.train.loading import Checkpoint

    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    settings = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    for key, unsupported in (
        ("use_dora", True),
        ("fan_in_fan_out", True),
        ("lora_bias", True),
        ("rank_pattern", "non-empty"),
        ("alpha_pattern", "non-empty"),
    ):
        value = settings.get(key)
        if (unsupported is True and value is True) or (unsupported == "non-empty" and value):
            raise ValueError(f"merge: adapter setting {key} = {value} is not supported by the streaming merge")
    r = settings["r"]
    scale = settings["lora_alpha"] / (math.sqrt(r) if settings.get("use_rslora") else r)
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as f:
        adapter = {key.removeprefix("base_model.model."): f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    pairs = {key.removesuffix(".lora_A.weight") for key in adapter if key.endswith(".lora_A.weight")}
    replaced = {key for key in adapter if ".lora_" not in key}
    unknown = [k for k in adapter if ".lora_" in k and not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if unknown:
        raise ValueError(f"merge: adapter tensor {unknown[0]} is not a LoRA linear weight; cannot fold it")
    out_dtype = getattr(torch, dtype)
    base = Checkpoint(base_dir)
    by_file: dict[Path, list[str]] = {}
    for name, file in base.files.items():
        by_file.setdefault(file, []).append(name)
    missing = [p + ".weight" for p in pairs if p + ".weight" not in base] + [k for k in replaced if k not in base]
    if missing:
        raise ValueError(f"merge: the adapter changes {missing[0]}, which the base {base_dir} does not have")
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for file, names in by_file.items():
        shard = {}
        for name in names:
            module = name.removesuffix(".weight")
            if name in replaced:
                tensor = adapter[name]
            elif module in pairs and name.endswith(".weight"):
                weight = base.read(name).float()
                lora_a, lora_b = adapter[module + ".lora_A.weight"].float(), adapter[module + ".lora_B.weight"].float()
                tensor = weight.addmm_(lora_b, lora_a, alpha=scale)
            else:
                tensor = base.read(name)
            shard[name] = tensor.to(out_dtype).contiguous()
            total += tensor.numel()
        save_file(shard, out_dir / file.name, metadata={"format": "pt"})
        del shard
    index = base_dir / "model.safetensors.index.json"
    if index.exists():
        layout = json.loads(index.read_text(encoding="utf-8"))
        size = sum((out_dir / f.name).stat().st_size for f in by_file)
        (out_dir / index.name).write_text(
            json.dumps({"metadata": {"total_size": size}, "weight_map": layout["weight_map"]}, indent=2),
            encoding="utf-8",
        )
    config = AutoConfig.from_pretrained(base_dir)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if (base_dir / "generation_config.json").exists():
        GenerationConfig.from_pretrained(base_dir).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out_dir)
    return total


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


def merge(base_dir: Path, result: TrainResult, run_url: str) -> MergedModel:
    """Merge the trained adapter (or pass the full model through) into ``<run>/merged``."""
    url = storage.join(run_url, "merged")
    with tempfile.TemporaryDirectory(prefix="ladle-merge-") as tmp:
        out = Path(tmp) / "merged"
        if result.adapter_url:
            adapter = storage.download_dir(result.adapter_url, Path(tmp) / "adapter")
            params = merge_adapter(base_dir, adapter, out, result.weights_dtype)
        else:
            storage.download_dir(result.model_url, out)
            params = count_saved(out)
        storage.remove(url)
        storage.upload_dir(out, url)
        adapter_fields = {}
        if result.adapter_url:
            from ladle.lifecycle.lineage import base_signature

            adapter_fields = {
                "adapter_url": result.adapter_url,
                "adapter_sha256": storage.weights_hash(adapter),
                "base_signature": base_signature(Path(base_dir)),
            }
        return MergedModel(
            url=url,
            sha256=storage.weights_hash(out),
            parameters=params,
            weights_dtype=result.weights_dtype,
            **adapter_fields,
        )
