"""FSDP2's output head, never gathered: a vocabulary-parallel cross-entropy over the data-parallel ranks.

FSDP2 shards the head's weight on dim 0, the vocabulary, so each rank already holds whole rows of it. Run as a
FSDP unit, the head is all-gathered for the forward and again for the backward, at the moment the activations
peak; on a big-vocabulary model it is the largest unit (Llama-3-70B: 128k x 8k, 2.1 GB in bf16), and the gather
builds it twice (the collective's output, then the parameter). Here the head never runs as a unit: the ranks
exchange their hidden states instead (tokens x hidden, a few MB), each computes the logits of every rank's
tokens over its own rows, and the softmax is completed with three small all-reduces (max, sum of exponentials,
target logit), as Megatron's vocabulary-parallel loss does over tensor-parallel ranks. The backward sends each
rank the hidden-state gradient of its tokens (a reduce-scatter) and leaves each rank the gradient of its rows,
summed over every rank's tokens: what FSDP2's reduce-scatter would have produced, divided by the world as FSDP2
averages.

The head stays a FSDP unit (so its parameter is the same ``Shard(0)`` DTensor for the optimizer, checkpoints and
saving); it is only taken out of the model's forward while the loss runs (``bypassed``), so FSDP2's runtime never
sees it and never gathers it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ladle.data.packing import IGNORE

# torch 2.13 renamed the tensor-form collectives (the old names warn on every call).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def active_module(wrapped):
    """The module that runs: peft's trained copy where it wraps one (``modules_to_save``), else the module."""
    copies = getattr(wrapped, "modules_to_save", None)
    if copies is not None and not wrapped.disable_adapters and wrapped.active_adapters:
        return copies[wrapped.active_adapters[0]]
    return getattr(wrapped, "original_module", wrapped)


def shardable(model, mesh) -> tuple[str | None, str | None]:
    """Why the input embedding and the output head cannot be kept sharded here (``None`` for each that can)."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        tied = "its weight is tied to the other end of the model, which needs it whole"
        return tied, tied
    if mesh.ndim != 1 or mesh.size() < 2:
        one = "kept sharded over one data-parallel dimension of 2 or more ranks only"
        return one, one
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed, head = (None if m is None else active_module(m) for m in (embed, head))
    embed_why = head_why = None
    if not isinstance(embed, torch.nn.Embedding) or embed.max_norm is not None:
        embed_why = "not a plain nn.Embedding"
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        head_why = "not a linear layer without bias"
    return embed_why, head_why


def owner_of(model, child) -> tuple[torch.nn.Module, str]:
    """The module holding ``child`` as an attribute, and the attribute's name."""
    for module in model.modules():
        for name, sub in module.named_children():
            if sub is child:
                return module, name
    raise RuntimeError(f"{type(child).__name__} is not a submodule of {type(model).__name__}")


def first_row(vocab: int, group) -> int:
    """This rank's first row of a ``vocab``-row weight that FSDP2 shards on dim 0 (as torch.chunk does)."""
    rows = -(-vocab // dist.get_world_size(group))
    return min(dist.get_rank(group) * rows, vocab)


class ShardedVocab:
    """The loss of a FSDP2 model whose input embedding and/or output head stay sharded.

    Args:
        model: the FSDP2-wrapped (peft or Hugging Face) causal LM.
        group: the process group FSDP2 shards over.
        dtype: the compute dtype (FSDP2's ``param_dtype``): the embedding's output is cast to it.
        embed, head: keep this end sharded (the caller checked ``shardable``).
    """

    def __init__(self, model, group, dtype, embed: bool, head: bool):
        self.group, self.dtype = group, dtype
        self.embed = active_module(model.get_input_embeddings()) if embed else None
        self.head_wrapper = model.get_output_embeddings() if head else None
        self.head = active_module(self.head_wrapper) if head else None
        if head:
            self.owner, self.name = owner_of(model, self.head_wrapper)

    @contextmanager
    def bypassed(self):
        """The model's forward returns the final hidden states (the head replaced by an identity)."""
        if self.head is None:
            yield
            return
        setattr(self.owner, self.name, torch.nn.Identity())
        try:
            yield
        finally:
            setattr(self.owner, self.name, self.head_wrapper)

    def embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``ids`` (batch x seq), looked up shard-wise (collective)."""
        weight = self.embed.weight.to_local()
        start = first_row(self.embed.weight.shape[0], self.group)
        flat = VocabParallelEmbedding.apply(
            weight, ids.reshape(-1), start, self.group, self.dtype, self.embed.padding_idx
        )
        return flat.reshape(*ids.shape, -1)

    def token_loss(self, model, data: dict[str, torch.Tensor], rows: list[int], device) -> tuple[torch.Tensor, int]:
        """``ladle.train.loss.token_loss`` with the sharded ends applied shard-wise (collective: every rank calls
        it the same number of times)."""
        from ladle.train.loss import token_cross_entropy

        index = torch.tensor(rows, dtype=torch.long)
        ids = data["input_ids"][index].to(device)
        labels = data["labels"][index].to(device)
        positions = data["position_ids"][index].to(device)
        inputs = {"input_ids": ids} if self.embed is None else {"inputs_embeds": self.embeddings(ids)}
        with self.bypassed():
            out = model(**inputs, position_ids=positions, use_cache=False).logits
        targets = labels[:, 1:].reshape(-1)
        if self.head is None:
            return token_cross_entropy(out, labels)
        hidden = out[:, :-1].reshape(-1, out.size(-1))
        weight = self.head.weight.to_local()
        start = first_row(self.head.weight.shape[0], self.group)
        loss = VocabParallelLoss.apply(hidden, weight, targets, start, self.group)
        return loss, int((targets != IGNORE).sum())


def gather_rows(tensor: torch.Tensor, most: int, group, fill) -> torch.Tensor:
    """Every rank's ``tensor`` (first dim padded to ``most`` with ``fill``), stacked in rank order."""
    padded = tensor.new_full((most, *tensor.shape[1:]), fill)
    padded[: tensor.size(0)] = tensor
    out = tensor.new_empty((dist.get_world_size(group) * most, *tensor.shape[1:]))
    all_gather_single(out, padded.contiguous(), group=group)
    return out


class VocabParallelLoss(torch.autograd.Function):
    """Summed cross-entropy of this rank's tokens, the vocabulary split over ``group`` (see the module)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, start: int, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        count = torch.tensor([hidden.size(0)], device=hidden.device)
        counts = torch.empty(world, dtype=count.dtype, device=hidden.device)
        all_gather_single(counts, count, group=group)
        most = int(counts.max())
        everyone = gather_rows(hidden.detach(), most, group, 0)
        all_targets = gather_rows(targets, most, group, IGNORE)
        # Logits in the model's dtype, as the head computes them; the softmax in float32 at least, as token_loss.
        logits = everyone @ weight.detach().to(everyone.dtype).t()
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        top = logits.max(dim=1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        logits -= top[:, None]
        local = all_targets - start
        mine = (local >= 0) & (local < weight.size(0))
        picked = torch.zeros_like(top)
        picked[mine] = logits[mine.nonzero().squeeze(1), local[mine]]
        dist.all_reduce(picked, group=group)
        total = logits.exp_().sum(dim=1)  # logits now hold exp(logit - max)
        dist.all_reduce(total, group=group)
        losses = torch.where(all_targets != IGNORE, total.log() - picked, torch.zeros_like(total))
        ctx.save_for_backward(everyone, weight, logits.div_(total[:, None]), local, mine, all_targets != IGNORE)
        ctx.group, ctx.most, ctx.count = group, most, hidden.size(0)
        return losses[rank * most : rank * most + hidden.size(0)].sum()

    @staticmethod
    def backward(ctx, grad):
        everyone, weight, probs, local, mine, trained = ctx.saved_tensors
        group, most = ctx.group, ctx.most
        world = dist.get_world_size(group)
        scales = torch.empty(world, dtype=grad.dtype, device=grad.device)
        all_gather_single(scales, grad.reshape(1).contiguous(), group=group)
        # d loss / d logits = softmax - one-hot(target), times the upstream gradient of the token's own rank.
        probs[mine.nonzero().squeeze(1), local[mine]] -= 1
        probs *= (scales.repeat_interleave(most) * trained)[:, None]
        d_logits = probs.to(everyone.dtype)
        partial = d_logits @ weight.to(everyone.dtype)
        d_hidden = torch.empty((most, partial.size(1)), dtype=partial.dtype, device=partial.device)
        reduce_scatter_single(d_hidden, partial, group=group)
        d_weight = None
        if ctx.needs_input_grad[1]:
            # Every rank's tokens are in d_logits: this is the sum FSDP2's reduce-scatter makes; it then averages.
            d_weight = (d_logits.t() @ everyone).to(weight.dtype) / world
        return d_hidden[: ctx.count], d_weight, None, None, None


class VocabParallelEmbedding(torch.autograd.Function):
    """Embeddings of this rank's ``ids``, the embedding's rows split over ``group``: the ranks exchange the ids,
    each fills in the rows it holds for every rank's tokens, and a reduce-scatter (one non-zero term per row)
    hands each rank its own. The backward gathers every rank's output gradient and adds it into the rows held
    here, divided by the world as FSDP2 averages."""

    @staticmethod
    def forward(ctx, weight, ids, start: int, group, dtype, padding_idx):
        world = dist.get_world_size(group)
        count = torch.tensor([ids.numel()], device=ids.device)
        counts = torch.empty(world, dtype=count.dtype, device=ids.device)
        all_gather_single(counts, count, group=group)
        most = int(counts.max())
        local = gather_rows(ids, most, group, -1) - start
        mine = (local >= 0) & (local < weight.size(0))
        held = mine.nonzero().squeeze(1)
        out = torch.zeros((world * most, weight.size(1)), dtype=dtype, device=weight.device)
        out[held] = weight.detach()[local[held]].to(dtype)
        own = torch.empty((most, weight.size(1)), dtype=dtype, device=weight.device)
        reduce_scatter_single(own, out, group=group)
        ctx.save_for_backward(local, held)
        ctx.group, ctx.most, ctx.count, ctx.rows = group, most, ids.numel(), weight.size(0)
        ctx.weight_dtype, ctx.padding_row = weight.dtype, None if padding_idx is None else padding_idx - start
        return own[: ids.numel()]

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        local, held = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        everyone = gather_rows(grad.contiguous(), ctx.most, ctx.group, 0)
        wide = torch.promote_types(grad.dtype, torch.float32)  # sum repeated tokens' gradients in float32 at least
        d_weight = torch.zeros((ctx.rows, grad.size(1)), dtype=wide, device=grad.device)
        d_weight.index_add_(0, local[held], everyone[held].to(wide))
        if ctx.padding_row is not None and 0 <= ctx.padding_row < ctx.rows:
            d_weight[ctx.padding_row] = 0  # nn.Embedding leaves the padding row's gradient at zero
        return (d_weight / world).to(ctx.weight_dtype), None, None, None, None, None
