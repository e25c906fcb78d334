"""Writing a full fine-tune's weights from sharded ranks, one file at a time.

``save_pretrained(state_dict=...)`` wants the whole state dict on rank 0: a full
fine-tune of a 70B model under FSDP2 or ZeRO-3 would gather 140 GB of bf16
weights into rank 0's host memory beside its optimizer states. Here the weights
are grouped, in the model's parameter order, into parts of at most
``training.save_shard_mib``; every rank gathers one part at a time (a collective
for sharded parameters, one tensor after another) and rank 0 writes it as a
safetensors file before the next part is gathered. Saving adds one part plus the
tensor being gathered to rank 0's memory, whatever the model's size.

The folder is what ``save_pretrained`` writes: ``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``;
``config.json`` with ``dtype`` and ``architectures`` set from the saved model;
``generation_config.json``. Tied weights are written once, under the name the
model's ``all_tied_weights_keys`` does not list as a tie target (the name
``save_pretrained`` keeps).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def output_name(name: str) -> str:
    """A parameter's name in the saved model: without compile, activation-checkpoint or FSDP wrapper parts."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def full_numel(tensor: torch.Tensor) -> int:
    """Elements of the whole tensor: a DTensor's global size, a ZeRO-3 partition's ``ds_numel``."""
    return int(getattr(tensor, "ds_numel", tensor.numel()))


def model_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the saved model holds, by output name, in the model's order: each parameter once (tied weights
    under their source's name) and the persistent buffers."""
    targets = set(getattr(module, "all_tied_weights_keys", None) or {})
    by_id: dict[int, list[str]] = {}
    params: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        name = output_name(name)
        by_id.setdefault(id(param), []).append(name)
        params[name] = param
    dropped = set()
    for names in by_id.values():
        if len(names) > 1:
            kept = [n for n in names if n not in targets] or names[:1]
            dropped.update(n for n in names if n != kept[0])
    out = {name: tensor for name, tensor in params.items() if name not in dropped}
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                out[output_name(f"{prefix}.{name}" if prefix else name)] = buffer
    return out


def gather_parts(module, whole, keep: bool, max_bytes: int) -> Iterator[dict | None]:
    """``module``'s weights in parts of at most ``max_bytes``, each tensor made whole by the ``whole`` context
    (a collective for sharded ones: every rank iterates); CPU copies where ``keep``, None elsewhere."""
    tensors = model_tensors(module)
    sizes = [(name, full_numel(t) * t.element_size()) for name, t in tensors.items()]
    for names in group(sizes, max_bytes):
        part = {}
        for name in names:
            with whole(tensors[name]) as full:
                if keep:
                    part[name] = full.detach().to("cpu", copy=True)
        yield part if keep else None


def group(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive names in parts of at most ``max_bytes`` (a tensor larger than that is a part of its own)."""
    parts: list[list[str]] = []
    used = max_bytes
    for name, size in sizes:
        if used + size > max_bytes:
            parts.append([])
            used = 0
        parts[-1].append(name)
        used += size
    return parts


class ShardWriter:
    """Rank 0's side: each part written as a safetensors file as soon as it is complete, renamed to Hugging
    Face's ``-0000i-of-0000N`` layout (with the index) once the count is known."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.dtypes: dict[torch.dtype, int] = {}

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        sizes = [(name, t.numel() * t.element_size()) for name, t in tensors.items()]
        for names in group(sizes, self.max_bytes):
            path = self.folder / f"part-{len(self.files):05d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in names}, path, metadata={"format": "pt"})
            self.files.append((path, names))
            for name in names:
                tensor = tensors[name]
                self.total += tensor.numel() * tensor.element_size()
                if tensor.is_floating_point():
                    self.dtypes[tensor.dtype] = self.dtypes.get(tensor.dtype, 0) + tensor.numel()

    def finish(self) -> str:
        """Name the files, write the index; returns the dtype most of the floating-point weights are stored in."""
        if not self.files:
            raise RuntimeError("saving the model: no tensors were gathered")
        count = len(self.files)
        if count == 1:
            self.files[0][0].rename(self.folder / "model.safetensors")
        else:
            weight_map = {}
            for i, (path, names) in enumerate(self.files, start=1):
                final = f"model-{i:05d}-of-{count:05d}.safetensors"
                path.rename(self.folder / final)
                weight_map.update(dict.fromkeys(names, final))
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
        return str(max(self.dtypes, key=self.dtypes.get)).removeprefix("torch.")


def write_model_files(hf_model, parts: Iterable[dict | None], folder: Path, max_bytes: int, main: bool) -> None:
    """On the ``main`` rank: the weights from ``parts`` (dicts of whole CPU tensors, one at a time), then
    ``config.json`` and ``generation_config.json`` as ``save_pretrained`` writes them. Other ranks iterate
    ``parts`` (the gathers are collective) and write nothing."""
    writer = ShardWriter(folder, max_bytes)
    for part in parts:
        if main:
            writer.add(part)
            part.clear()  # the next part is gathered without this one alive
    if not main:
        return
    dtype = writer.finish()
    config = hf_model.config
    config.dtype = dtype
    config.architectures = [type(hf_model).__name__.removeprefix("FSDP")]  # fully_shard renames the class
    config.save_pretrained(folder)
    if hf_model.can_generate():
        hf_model.generation_config.save_pretrained(folder)
