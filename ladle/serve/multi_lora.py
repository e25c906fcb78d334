"""A grouped LoRA product: every loaded adapter inside the base's linear layers at once, each batch row taking only
its own adapter's update.

Each adapted linear layer keeps its base weights and, side by side, every loaded adapter's ``A`` (scaled by its
``alpha / r``) and ``B``: ``A_cat`` is ``[R, in]`` and ``B_cat`` ``[out, R]``, ``R`` the ranks of the adapters
that adapt this layer, summed, with ``owner[R]`` naming the adapter of each rank column. A forward over rows of
several adapters computes

    y = base(x) + ((x @ A_cat.T) * mask) @ B_cat.T,    mask[row, col] = owner[col] == adapter[row]

two matmuls and a multiply per layer whatever the number of adapters in the batch, where peft's mixed batch runs,
per layer and per adapter present, a gather, two matmuls and a scatter-add, plus a forward hook on every LoRA
module per call (``bench/adapters.py`` measures both). The product does ``n`` times the LoRA arithmetic for ``n``
adapters present (each row against every adapter's columns, masked), which is small beside the base's own
matmuls at serving ranks, and it is the same arithmetic for a decode step as for a prefill.

Exactness: each row's update is its adapter's ``B (s A x)`` (the other columns contribute exact zeros), in the
model's dtype; greedy answers equal the merged model's (tested, float32).

What it holds: LoRA on linear layers (any rank per module, rsLoRA), and the output head or input embedding an
adapter replaces whole (peft's ``modules_to_save``, as teams that add chat tokens train them): each adapter's copy
sits beside the base's, and the rows of a forward that run on that adapter take their output from it (the base's
module runs only where some row still needs it). A DoRA adapter, one that adapts an embedding with LoRA, replaces
any other module whole, uses ``alpha_pattern`` or Conv1D layers (``fan_in_fan_out``) is refused when registered
(``ladle.serve.adapters.inspect``), naming why.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class MultiLoraLinear(nn.Module):
    """A base ``nn.Linear`` with every loaded adapter's update beside it."""

    def __init__(self, base: nn.Linear, group: MultiLora):
        super().__init__()
        self.base = base
        object.__setattr__(self, "group", group)  # not a submodule: the group is shared by every layer
        self.a_cat: torch.Tensor | None = None  # [R, in]: each adapter's s A, one after another
        self.b_cat: torch.Tensor | None = None  # [out, R]
        self.layout: tuple[tuple[int, int], ...] = ()  # (adapter id, rank) of each block of columns, in order
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # adapter id -> its whole copy

    @property
    def weight(self):  # what code reading a linear layer's weight expects (its dtype, its device)
        return self.base.weight

    def add(self, adapter: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.a_cat is None:
            self.a_cat, self.b_cat = a, b
        else:
            self.a_cat, self.b_cat = torch.cat([self.a_cat, a]), torch.cat([self.b_cat, b], dim=1)
        self.layout = (*self.layout, (adapter, a.shape[0]))

    def remove(self, adapter: int) -> None:
        self.saved.pop(adapter, None)
        if adapter not in {owner for owner, _ in self.layout}:
            return
        keep, start = [], 0
        for owner, rank in self.layout:
            if owner != adapter:
                keep.append(torch.arange(start, start + rank, device=self.a_cat.device))
            start += rank
        self.layout = tuple(block for block in self.layout if block[0] != adapter)
        if not keep:
            self.a_cat = self.b_cat = None
            return
        index = torch.cat(keep)
        self.a_cat, self.b_cat = self.a_cat[index].contiguous(), self.b_cat[:, index].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        present = self.group.present(self.saved)
        if not present:
            return self.adapted(x)
        return self.group.by_rows(x, present, self.adapted, lambda adapter, rows: F.linear(rows, *self.saved[adapter]))

    def adapted(self, x: torch.Tensor) -> torch.Tensor:
        """The base's output and, in each row, its adapter's low-rank update."""
        y = self.base(x)
        if self.a_cat is None or self.group.rows is None:
            return y
        mask = self.group.mask(
            self.layout, x.dim(), x.device
        )  # [rows, 1..., R], None when no row runs on these adapters
        if mask is None:
            return y
        h = (x.to(self.a_cat.dtype) @ self.a_cat.T) * mask
        return y + (h @ self.b_cat.T).to(y.dtype)


class MultiEmbedding(nn.Module):
    """A base ``nn.Embedding`` with the tables of the adapters that replaced it whole (``modules_to_save``)."""

    def __init__(self, base: nn.Embedding, group: MultiLora):
        super().__init__()
        self.base = base
        object.__setattr__(self, "group", group)
        self.saved: dict[int, torch.Tensor] = {}  # adapter id -> its table

    @property
    def weight(self):
        return self.base.weight

    def remove(self, adapter: int) -> None:
        self.saved.pop(adapter, None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        present = self.group.present(self.saved)
        if not present:
            return self.base(ids)
        b = self.base
        look = lambda adapter, rows: F.embedding(  # noqa: E731 - the base's own lookup, on the adapter's table
            rows, self.saved[adapter], b.padding_idx, b.max_norm, b.norm_type, b.scale_grad_by_freq, b.sparse
        )
        return self.group.by_rows(ids, present, self.base, look)


class MultiLora:
    """The adapters inside one model, by the engine's keys; ``rows`` says which adapter each row of the next
    forward runs on."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: dict[str, MultiLoraLinear | MultiEmbedding] = {}
        self.ids: dict[str, int] = {}  # key -> adapter id (0, 1, ...; -1: the base)
        self.rows: torch.Tensor | None = None
        self.row_ids: set[int] = set()  # the adapter ids ``rows`` holds, on the host
        self.row_list: list[int] = []  # the same, row by row
        self.masks: dict[tuple, torch.Tensor | None] = {}  # per forward: one mask per column layout
        self.dtype = next(model.parameters()).dtype

    def add(self, key: str, folder: str | Path) -> None:
        """Load the adapter at ``folder`` under ``key`` (its tensors checked against the layers they adapt).

        Raises:
            ValueError: a tensor names a module the model does not have, or has a shape that does not fit it.
        """
        from safetensors.torch import load_file

        folder = Path(folder)
        settings = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        tensors = load_file(folder / "adapter_model.safetensors", device="cpu")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        whole: dict[str, dict[str, torch.Tensor]] = {}  # modules_to_save: module -> {"weight": ..., "bias": ...}
        for name, tensor in tensors.items():
            module, _, part = name.removeprefix("base_model.model.").partition(".lora_")
            if part in ("A.weight", "B.weight"):
                pairs.setdefault(module, {})[part[0]] = tensor
            elif not part and module.endswith((".weight", ".bias")):
                owner, _, kind = module.rpartition(".")
                whole.setdefault(owner, {})[kind] = tensor
            else:
                raise ValueError(f"{name}: not a LoRA linear weight (ladle.serve.adapters.inspect refuses these)")
        staged = []  # everything checked and converted before any layer changes: a failed load changes nothing
        for module, parts in pairs.items():
            if set(parts) != {"A", "B"}:
                raise ValueError(f"{module}: the adapter has lora_{next(iter(parts))} but not its other half")
            a, b = parts["A"], parts["B"]
            rank = a.shape[0]
            if b.shape[1] != rank:
                raise ValueError(f"{module}: lora_A has rank {rank} but lora_B {b.shape[1]}")
            scale = settings["lora_alpha"] / (math.sqrt(rank) if settings.get("use_rslora") else rank)
            layer = self.layer(module)
            if a.shape[1] != layer.base.in_features or b.shape[0] != layer.base.out_features:
                raise ValueError(f"{module}: adapter shapes {list(a.shape)}, {list(b.shape)} do not fit the layer")
            device, dtype = layer.base.weight.device, layer.base.weight.dtype  # each layer's own: a placed base
            staged.append((layer, (a.float() * scale).to(device, dtype), b.to(device, dtype)))
        copies = [self.staged_copy(module, parts) for module, parts in whole.items()]
        adapter = self.next_id()
        for layer, a, b in staged:
            layer.add(adapter, a, b)
        for layer, copy in copies:
            layer.saved[adapter] = copy
        self.ids[key] = adapter

    def staged_copy(self, module: str, parts: dict[str, torch.Tensor]):
        """The wrapper of ``module`` and an adapter's whole copy of it, checked and on the module's device.

        Raises:
            ValueError: the module is not a linear layer or a plain embedding, or the copy does not fit it.
        """
        layer = self.wrapper(module)
        base = layer.base
        weight = parts.get("weight")
        if weight is None or weight.shape != base.weight.shape or set(parts) - {"weight", "bias"}:
            got = {k: list(v.shape) for k, v in parts.items()}
            raise ValueError(f"{module}: a copy saved whole {got} that does not fit {list(base.weight.shape)}")
        device, dtype = base.weight.device, base.weight.dtype
        if isinstance(layer, MultiEmbedding):
            if "bias" in parts:
                raise ValueError(f"{module}: an embedding has no bias")
            return layer, weight.to(device, dtype)
        bias = parts.get("bias", base.bias)
        if bias is not None and (base.bias is None or bias.shape != base.bias.shape):
            raise ValueError(f"{module}: a bias the layer does not have, or of another shape")
        return layer, (weight.to(device, dtype), None if bias is None else bias.to(device, dtype))

    def next_id(self) -> int:
        """The smallest id no loaded adapter has: ids come from what is loaded, never from a count that a failed
        load or a removal could make collide with a live adapter's id."""
        taken = set(self.ids.values())
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def remove(self, key: str) -> None:
        adapter = self.ids.pop(key, None)
        if adapter is None:
            return
        for layer in self.layers.values():
            layer.remove(adapter)

    def layer(self, name: str) -> MultiLoraLinear:
        """The wrapper of linear layer ``name`` (installed on first use)."""
        wrapper = self.wrapper(name)
        if not isinstance(wrapper, MultiLoraLinear):
            raise ValueError(f"{name}: not a linear layer of the model (an embedding)")
        return wrapper

    def wrapper(self, name: str) -> MultiLoraLinear | MultiEmbedding:
        """The wrapper of module ``name``, a linear layer or a plain embedding (installed on first use)."""
        if name in self.layers:
            return self.layers[name]
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        base = getattr(parent, child, None)
        if type(base) is nn.Embedding:  # a subclass (a scaled embedding) computes more than its table's rows
            wrapper: MultiLoraLinear | MultiEmbedding = MultiEmbedding(base, self)
        elif isinstance(base, nn.Linear):
            wrapper = MultiLoraLinear(base, self)
        else:
            raise ValueError(f"{name}: not a linear layer or a plain embedding of the model ({type(base).__name__})")
        setattr(parent, child, wrapper)
        self.layers[name] = wrapper
        return wrapper

    def present(self, saved: dict) -> set[int]:
        """The adapters with a whole copy in ``saved`` that some row of this forward runs on."""
        return self.row_ids & saved.keys() if self.rows is not None and saved else set()

    def by_rows(self, x: torch.Tensor, present: set[int], whole, one) -> torch.Tensor:
        """A module's output where the rows of the adapters in ``present`` come from ``one(adapter, their rows)``
        (their whole copy) and the others from ``whole(x)``, which runs only when some row needs it."""
        y = None if self.row_ids <= present else whole(x)
        for adapter in sorted(present):
            index = self.rows_index(adapter, x.device)
            part = one(adapter, x.index_select(0, index))
            if y is None:
                y = part.new_empty((x.shape[0], *part.shape[1:]))
            y = y.index_copy(0, index, part.to(y.dtype))
        return y

    def rows_index(self, adapter: int, device: torch.device) -> torch.Tensor:
        """The rows of this forward that run on ``adapter``, as an index on ``device`` (made once per forward)."""
        key = ("rows", adapter, str(device))
        if key not in self.masks:
            rows = [i for i, owner in enumerate(self.row_list) if owner == adapter]
            self.masks[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return self.masks[key]

    def mask(self, layout: tuple[tuple[int, int], ...], dims: int, device: torch.device) -> torch.Tensor | None:
        """Which columns of a layer with ``layout`` each row of this forward keeps (1) or drops (0), shaped to
        multiply a ``dims``-dimensional activation on ``device``; None when no row runs on any of its adapters. Made
        once per forward per layout and device: layers that hold the same adapters share it, and a base placed over
        several devices gets each layer's mask where that layer's activations are."""
        key = (layout, dims, str(device))
        if key not in self.masks:
            self.masks[key] = None
            if self.row_ids & {adapter for adapter, _ in layout}:  # decided on the host: no device sync per layer
                rows = self.rows.to(device)
                owner = torch.cat([torch.full((rank,), adapter, device=device) for adapter, rank in layout])
                shape = (rows.shape[0], *([1] * (dims - 2)), owner.shape[0])
                self.masks[key] = (owner[None, :] == rows[:, None]).to(self.dtype).view(shape)
        return self.masks[key]

    @contextlib.contextmanager
    def rows_of(self, keys: list[str | None]):
        """During the block, row ``i`` of a forward runs on adapter ``keys[i]`` (None: the base)."""
        ids = [self.ids[k] if k is not None else -1 for k in keys]
        self.rows = torch.tensor(ids)  # moved per layer's device
        self.row_ids, self.row_list = set(ids), ids
        self.masks = {}
        try:
            yield
        finally:
            self.rows, self.row_ids, self.row_list, self.masks = None, set(), [], {}
