"""Sharded loading: build the model without its weights, then give each rank only what it holds.

``from_pretrained`` reads every weight into every process before any strategy
can shard it: eight ranks of a 70B base would need 1.1 TB of host memory before
FSDP2 or ZeRO-3 frees anything. Here the architecture is built with no storage
behind its parameters (the meta device; ``deepspeed.zero.Init`` for ZeRO-3,
chosen by the strategy's ``empty_model``), LoRA is added and initialised, the
strategy shards or splits the skeleton, and only then are the weights read:
each rank reads the region of each tensor that it holds (FSDP2's dim-0 shard, a
tensor-parallel slice, a pipeline stage's layers, a whole tensor for a replica) straight from the
checkpoint's safetensors, one tensor at a time, with the file mapped only while
that tensor is read. A rank's load peak is its share of the model plus one
tensor.

Names: a parameter of the (peft-wrapped) model maps to its checkpoint tensor by
dropping peft's wrapper parts (``base_model.model.``, ``.base_layer``,
``.original_module``, ``.modules_to_save.default``), so ``modules_to_save``
copies load the base's values. LoRA weights are not in the checkpoint: they are
initialised by peft before sharding, with the seed reset first, identically in
every loading path, so a sharded run starts from the same adapter as a
replicated one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

ADAPTER = "default"  # the adapter name ladle gives peft
PEFT_PARTS = (".base_layer", ".original_module", f".modules_to_save.{ADAPTER}")


def checkpoint_name(name: str) -> str:
    """The checkpoint tensor a (peft-wrapped) model's parameter or buffer loads from."""
    name = name.removeprefix("base_model.model.")
    for part in PEFT_PARTS:
        name = name.replace(part, "")
    return name


def is_adapter(name: str) -> bool:
    """LoRA weights, which the checkpoint does not hold."""
    return ".lora_" in name


# safetensors' dtype names -> torch, for the direct reads below (anything else goes through safetensors itself).
STORED_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header


@dataclass(frozen=True)
class Stored:
    """Where one tensor lies in its safetensors file (from the file's header)."""

    file: Path
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # byte offset of its first element in the file

    def rows(self, first: int, count: int) -> tuple[int, int]:
        """(byte offset, byte count) of rows ``first`` .. ``first + count`` along dim 0 (row-major storage)."""
        row = STORED_DTYPES[self.dtype].itemsize * math.prod(self.shape[1:])
        return self.start + first * row, count * row


def read_header(file: Path) -> dict[str, Stored]:
    """The tensors of one safetensors file: an 8-byte little-endian header length, a JSON header giving each
    tensor's dtype, shape and byte range relative to the data that follows it (the format's specification)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(min(size, MAX_HEADER_BYTES)))
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
            raise ValueError(
                f"{file} is not a readable safetensors file (its header does not parse: {exc}); re-save the "
                "model with save_pretrained(..., safe_serialization=True)"
            ) from None
    data = 8 + size
    return {
        name: Stored(file, entry["dtype"], tuple(entry["shape"]), data + entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    }


class Checkpoint:
    """The safetensors files of a Hugging Face model folder, read tensor by tensor (or row range by row range).

    A read lands in memory once. Where it can, it is a plain file read straight into the destination tensor:
    safetensors' own reads map the file, and the mapped pages count in the process's resident memory until the
    file closes, on top of the copy made from them (a 32k x 1k float32 embedding's half: 62 MiB mapped + 62 MiB
    copied + 62 MiB cloned). Everything else (another dtype, a column slice, a device tensor) copies from
    safetensors' mapped view into the destination, the file open only for that tensor.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({self.folder / file for file in weight_map.values()})
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{self.folder} holds no safetensors weights: sharded loading reads tensors lazily from "
                    "safetensors. Save the base with save_pretrained(..., safe_serialization=True)."
                )
        self.tensors: dict[str, Stored] = {}
        for file in files:
            self.tensors.update(read_header(file))
        self.files = {name: stored.file for name, stored in self.tensors.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name`` (only ``region``, one slice per leading dimension, when given), in its stored dtype."""
        stored = self.tensors[name]
        shape = region_shape(stored.shape, region)
        dtype = STORED_DTYPES.get(stored.dtype)
        if dtype is None:
            return self._from_mapped(name, region, None)
        return self.read_into(name, torch.empty(shape, dtype=dtype), region)

    def read_into(self, name: str, out: torch.Tensor, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Copy tensor ``name`` (or its ``region``) into ``out``, converting to ``out``'s dtype and device."""
        stored = self.tensors[name]
        rows = leading_rows(stored.shape, region)
        direct = (
            rows is not None
            and out.device.type == "cpu"
            and out.is_contiguous()
            and STORED_DTYPES.get(stored.dtype) == out.dtype
            and tuple(out.shape) == region_shape(stored.shape, region)
        )
        if not direct:
            return self._from_mapped(name, region, out)
        offset, size = stored.rows(*rows)
        buffer = memoryview(out.detach().view(-1).view(torch.uint8).numpy())
        with open(stored.file, "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < size:
                got = f.readinto(buffer[done:size])
                if not got:
                    raise RuntimeError(
                        f"sharded loading: {stored.file} ends inside tensor {name}; the file is cut short"
                    )
                done += got
        return out

    def _from_mapped(self, name: str, region: tuple[slice, ...] | None, out: torch.Tensor | None) -> torch.Tensor:
        """Through safetensors: its view of the tensor (or region) in the mapped file, copied into ``out`` (a new
        tensor when None) before the file closes."""
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            view = f.get_tensor(name) if region is None else f.get_slice(name)[region]
            return view.clone() if out is None else out.copy_(view)


def region_shape(shape: tuple[int, ...], region: tuple[slice, ...] | None) -> tuple[int, ...]:
    """The shape of ``region`` (slices with unit step over the leading dimensions) of a tensor of ``shape``."""
    if region is None:
        return tuple(shape)
    sliced = tuple(len(range(*part.indices(size))) for part, size in zip(region, shape, strict=False))
    return sliced + tuple(shape[len(region) :])


def leading_rows(shape: tuple[int, ...], region: tuple[slice, ...] | None) -> tuple[int, int] | None:
    """(first row, row count) when ``region`` is contiguous in storage (all of the tensor, or a range of rows
    along dim 0 with every later dimension whole); None for anything else (a column slice)."""
    if not shape:
        return (0, 1) if region is None else None
    if region is None:
        return 0, shape[0]
    first, stop, step = region[0].indices(shape[0])
    later = all(part.indices(size) == (0, size, 1) for part, size in zip(region[1:], shape[1:], strict=False))
    if step != 1 or not later:
        return None
    return first, max(stop - first, 0)


@dataclass
class Pending:
    """What an empty model still needs: the checkpoint for base weights, and values kept aside (initialised
    LoRA weights, buffers) that materialising the skeleton would otherwise wipe."""

    checkpoint: Checkpoint
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def read_into(self, name: str, out: torch.Tensor, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Copy the model's tensor ``name`` (or its ``region``) into ``out``: a kept value, else the checkpoint's."""
        if name in self.values:
            value = self.values[name]
            return out.copy_(value if region is None else value[region])
        key = checkpoint_name(name)
        if key not in self.checkpoint:
            raise RuntimeError(
                f"sharded loading: the model's {name} has no tensor {key} in {self.checkpoint.folder}; the base "
                "checkpoint does not match its config.json"
            )
        return self.checkpoint.read_into(key, out, region)

    def fill(self, module: torch.nn.Module, device, prefix: str = "") -> int:
        """Allocate ``module``'s storage on ``device`` and read every parameter and buffer into it (whole tensors,
        or each DTensor's local region); returns the elements this rank now holds."""
        tied = tied_groups(module)
        module.to_empty(device=device)
        retie(module, tied)
        held = 0
        with torch.no_grad():
            for name, tensor in named_tensors(module):
                local, region = local_region(tensor)
                if local.numel():
                    self.read_into(prefix + name, local, region)
                held += local.numel()
        return held


def tied_groups(module: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (a tied embedding and head), first name first."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(module: torch.nn.Module, groups: list[list[str]]) -> None:
    """Make each group one parameter again. ``to_empty`` from the meta device gives every module a new
    parameter of its own (a meta tensor's storage cannot be swapped in place), which unties a tied pair:
    the head would then be read from a checkpoint tensor that a tied model does not have."""
    for first, *others in groups:
        param = module.get_parameter(first)
        for other in others:
            owner, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, attr, param)


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once) and buffers, by name."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """This rank's storage of ``tensor`` and the region of the full tensor it holds (None: all of it).

    The region is what torch's own DTensor layout says (``compute_local_shape_and_global_offset``, as its
    distributed checkpoint uses): FSDP2's dim-0 shard (``torch.chunk`` arithmetic, see ``shard_range``), tensor
    parallelism's row or column slice, and FSDP2 over tensor parallelism (``_StridedShard``) alike.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor, None
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"sharded loading: local shard of {tuple(local.shape)} but {tuple(shape)} expected")
    return local, tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def shard_range(rows: int, shards: int, coordinate: int) -> tuple[int, int]:
    """(first row, row count) of shard ``coordinate`` of ``rows`` rows split ``shards`` ways, as ``torch.chunk``
    and FSDP2 split them: ceil(rows / shards) per shard, the last ones shorter or empty."""
    chunk = -(-rows // shards)
    start = min(coordinate * chunk, rows)
    return start, min(start + chunk, rows) - start


def run_dtype(plan) -> torch.dtype:
    """The weights' dtype in the worker: the plan's on CUDA, float32 on a CPU."""
    return getattr(torch, plan.dtype) if plan.device == "cuda" else torch.float32


def skeleton(base_dir: Path, plan, runtime) -> tuple[torch.nn.Module, Pending]:
    """The base's empty model as ``runtime`` builds it (its ``empty_context``: the meta device, or ZeRO-3's
    partitions) in the run's dtype, and the ``Pending`` its ``wrap`` fills from the checkpoint, each rank its part."""
    dtype = run_dtype(plan)
    model = build_empty(base_dir, dtype, lambda: runtime.empty_context(plan, dtype))
    return model, Pending(Checkpoint(base_dir))


def build_empty(base_dir: Path, dtype: torch.dtype, context: Callable):
    """The base architecture from ``base_dir``'s config.json inside ``context`` (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    with context():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Built on the meta device, a tied pair (tie_word_embeddings, e.g. SmolLM2's, whose checkpoint holds no
    # lm_head.weight) comes out as two parameters; tied here, it is one, read once from the embedding's tensor.
    model.tie_weights()
    return model


def meta_context():
    """Parameters on the meta device; buffers (e.g. rotary frequencies, computed at init) stay real."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def init_adapters(model, seed: int) -> None:
    """(Re)initialise every LoRA weight with peft's own initialiser, in module order, from ``seed``.

    Done in every loading path, after the adapter is attached: a skeleton's LoRA weights were moved to
    the meta device with its base layer, and a replicated model's were drawn after whatever the load
    consumed from the generator. Reset here, all paths start from the same adapter.
    """
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            for part in (module.lora_A[ADAPTER], module.lora_B[ADAPTER]):
                if any(p.is_meta for p in part.parameters()):
                    part.to_empty(device="cpu")
            module.reset_lora_parameters(ADAPTER, True)


def kept_values(model) -> dict[str, torch.Tensor]:
    """What materialising the skeleton would wipe: the initialised adapter weights and every buffer."""
    values = {name: p.detach().clone() for name, p in model.named_parameters() if is_adapter(name)}
    values.update({name: b.detach().clone() for name, b in model.named_buffers()})
    return values


def meta_parameters(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.is_meta]
