"""Ulysses sequence parallelism (``parallelism.dims.sp``): each row split across the ranks of an sp group.

Each rank of a group of ``sp`` holds ``length / sp`` consecutive tokens of every row of the micro-batch: its
slice of the input ids, of the position ids (the row's own, so rotary embeddings see true positions and packed
examples keep their boundaries) and of the labels, shifted before the split, so the last token of one slice is
trained to predict the first token of the next. A row whose length does not divide by ``sp`` (a padding-free
joined row) is padded at its end with untrained tokens; planned rows (``data.seq_len``) divide already.

Everything but attention is per token and runs on the slice as it is. Attention needs the whole sequence, and
that is the all-to-all trade (DeepSpeed-Ulysses, arXiv:2309.14509): the rank's q, k, v of ``heads`` heads over
its slice go out as ``sp`` head groups, one to each rank, and each rank gets back its head group over every slice:
``heads / sp`` heads over the whole sequence. Attention runs there, example by example inside packed rows from the
gathered position ids (``ladle.train.packed_attention``'s regrouping, causal SDPA per example, so no mask is ever
built), and a second all-to-all trades the output back: the rank's slice over every head. Both exchanges are
differentiable (``torch.distributed.nn.functional.all_to_all_single``): the backward is the opposite exchange.
KV heads that do not divide by ``sp`` (GQA, MQA) are repeated until they do, as DeepSpeed's layer does.

Why not DeepSpeed's ``UlyssesSPAttentionHF``: its registration loads the model by name and sets up DeepSpeed's
own sequence-parallel groups (``parallel_state_sp``), not the run's device mesh, and its SDPA path treats each
gathered row as one causal sequence, so packed rows need FlashAttention's varlen kernels (CUDA). This layer runs
on the mesh's ``sp`` group, on any backend with all-to-all (gloo included), and keeps packed examples apart on
any device.

The loss is the summed token cross-entropy of each rank's slice over the global count of trained tokens; the sp
ranks reduce gradients with the data-parallel ones (FSDP over ``dp_shard × sp``), so the step is the same global
token mean as without sequence parallelism (``tests/train/test_sequence_parallel.py`` holds them equal).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from ladle.data.packing import IGNORE
from ladle.sizing import kv_repeats
from ladle.strategies.attention import unsupported

NAME = "ladle_ulysses"


class Ulysses:
    """A run's sequence-parallel group (on its model's ``ladle.train.run_state``, and on each of its attention
    layers as ``ladle_ulysses``, while it trains with sp > 1) and its tally."""

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.rows = self.padded = self.exchanges = 0
        self._positions: tuple[torch.Tensor, torch.Tensor] | None = None

    def split(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor):
        """This rank's slice of ``ids``, ``labels`` and ``positions`` (rows x length). The labels come back with
        one leading column that is never a target: ``labels[:, 1 + i]`` is the target of slice position ``i``,
        the layout ``ladle.train.loss`` reads (a row's labels, whose ``[:, 1:]`` are the targets of ``[:, :-1]``)."""
        rows, length = ids.shape
        pad = -length % self.size
        targets = torch.cat([labels[:, 1:], labels.new_full((rows, 1), IGNORE)], dim=1)
        if pad:
            self.padded += rows * pad
            ids = torch.cat([ids, ids[:, -1:].expand(rows, pad)], dim=1)
            targets = torch.cat([targets, targets.new_full((rows, pad), IGNORE)], dim=1)
            # Positions go on counting: the padding joins the row's last example, after every real token of it,
            # so causal attention never shows it to a real one.
            step = torch.arange(1, pad + 1, dtype=positions.dtype, device=positions.device)
            positions = torch.cat([positions, positions[:, -1:] + step], dim=1)
        self.rows += rows
        n = (length + pad) // self.size
        mine = slice(self.rank * n, (self.rank + 1) * n)
        lead = targets.new_full((rows, 1), IGNORE)
        return ids[:, mine].contiguous(), torch.cat([lead, targets[:, mine]], dim=1), positions[:, mine].contiguous()

    def whole_positions(self, local: torch.Tensor) -> torch.Tensor:
        """The whole rows' position ids from every rank's slice (every layer of a forward gets the same tensor,
        so they are gathered once per forward)."""
        if self._positions is None or self._positions[0] is not local:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(parts, local.contiguous(), group=self.group)
            self._positions = (local, torch.cat(parts, dim=1))
        return self._positions[1]

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, heads, slice, dim) on each rank -> (rows, heads / sp, whole length, dim): this rank's head group
        over every rank's slice."""
        rows, heads, n, dim = x.shape
        sp = self.size
        send = x.reshape(rows, sp, heads // sp, n, dim).permute(1, 0, 2, 3, 4).contiguous()
        got = all_to_all_single(torch.empty_like(send), send, group=self.group)  # [source rank = slice]
        self.exchanges += 1
        return got.permute(1, 2, 0, 3, 4).reshape(rows, heads // sp, sp * n, dim)

    def to_slices(self, out: torch.Tensor) -> torch.Tensor:
        """(rows, whole length, heads / sp, dim) -> (rows, slice, heads, dim): this rank's slice over every head
        group, the layout transformers expects back from attention."""
        rows, length, group, dim = out.shape
        sp = self.size
        n = length // sp
        send = out.reshape(rows, sp, n, group, dim).permute(1, 0, 2, 3, 4).contiguous()
        got = all_to_all_single(torch.empty_like(send), send, group=self.group)  # [source rank = head group]
        self.exchanges += 1
        return got.permute(1, 2, 0, 3, 4).reshape(rows, n, sp * group, dim)

    def summary(self) -> str:
        """What ran, in words (the result's ``sequence_parallel``)."""
        padded = f"; {self.padded} padding tokens added to make rows divide" if self.padded else ""
        return f"on: Ulysses sp={self.size}, {self.rows} row slices, {self.exchanges} all-to-alls{padded}"


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature on a slice: (rows, heads, slice, dim) in, (rows, slice, heads, dim) out."""
    from ladle.train import packed_attention

    ulysses = getattr(module, "ladle_ulysses", None)
    positions = kwargs.get("position_ids")
    if ulysses is None or positions is None:
        raise RuntimeError(
            "sequence-parallel attention ran without its group or without position ids: the worker installs it "
            "and every training forward passes the slice's position ids"
        )
    heads, kv = query.shape[1], key.shape[1]
    if kv % ulysses.size:
        repeat = kv_repeats(heads, kv, ulysses.size)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    whole = ulysses.whole_positions(positions)
    if whole.shape[0] != query.shape[0]:
        whole = whole.expand(query.shape[0], -1)
    q, k, v = ulysses.to_heads(query), ulysses.to_heads(key), ulysses.to_heads(value)
    out, _ = packed_attention.attention(module, q, k, v, None, dropout, scaling, position_ids=whole)
    return ulysses.to_slices(out), None


def install(model, group) -> str:
    """Run ``model``'s attention as Ulysses over ``group`` (the mesh's sp dimension); what runs, in words.

    Raises:
        RuntimeError: the model's attention is not plain causal attention (the planner refuses it first).
    """
    config = model.config
    why = unsupported(config)
    if why is not None:
        raise RuntimeError(f"parallelism.dims.sp > 1: {why}. Set parallelism.dims.sp=1.")
    from transformers import AttentionInterface

    from ladle.train import run_state

    ulysses = Ulysses(group)
    heads = config.num_attention_heads
    if heads % ulysses.size:
        raise RuntimeError(f"parallelism.dims.sp = {ulysses.size} does not divide num_attention_heads = {heads}")
    run_state.on(model).ulysses = ulysses
    for module in model.modules():  # the attention layers transformers hands to ``attention`` as ``module``
        if type(module).__name__.endswith("Attention"):
            module.ladle_ulysses = ulysses
    AttentionInterface.register(NAME, attention)
    model.set_attn_implementation(NAME)
    return f"on: Ulysses sp={ulysses.size}"


def report(ran: dict, model) -> None:
    """Replace ``ran['sequence_parallel']`` with the tally, once the steps have run."""
    from ladle.train import run_state

    ulysses = run_state.of(model).ulysses
    if ulysses is not None:
        ran["sequence_parallel"] = ulysses.summary()
