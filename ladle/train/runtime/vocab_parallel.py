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

ZeRO-3 runs the same ops for a LoRA run's frozen ends: ``zero.keep_ends_local`` takes them out of ZeRO's
partitioning and leaves each rank its rows as a plain tensor (``local_rows`` reads either form).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ladle.data.packing import IGNORE
from ladle.sizing import LOGITS_CHUNK_BYTES

# torch 2.13 renamed the tensor-form collectives (the old names warn on every call).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def active_module(wrapped):
    """The module that runs: peft's trained copy where it wraps one (``modules_to_save``), else the module."""
    copies = getattr(wrapped, "modules_to_save", None)
    if copies is not None and not wrapped.disable_adapters and wrapped.active_adapters:
        return copies[wrapped.active_adapters[0]]
    return getattr(wrapped, "original_module", wrapped)


def shardable(model, ranks: int) -> tuple[str | None, str | None]:
    """Why the input embedding and the output head cannot be kept sharded over ``ranks`` data-parallel ranks
    (``None`` for each that can; ``ranks`` 0: more than one data-parallel dimension)."""
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        tied = "its weight is tied to the other end of the model, which needs it whole"
        return tied, tied
    if ranks < 2:
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


def end_notes(why: list | tuple, held: str) -> dict[str, str]:
    """What ``check_applied`` reports for each end: ``held`` (how a kept-sharded end is held) or why it is
    gathered, from ``why`` (a reason per end, ``None`` where it is kept sharded)."""
    return {
        "input_embedding": f"{held} (vocabulary-parallel lookup, never gathered)"
        if why[0] is None
        else f"gathered ({why[0]})",
        "output_head": f"{held} (vocabulary-parallel loss, never gathered)"
        if why[1] is None
        else f"gathered ({why[1]})",
    }


def owner_of(model, child) -> tuple[torch.nn.Module, str]:
    """The module holding ``child`` as an attribute, and the attribute's name."""
    for module in model.modules():
        for name, sub in module.named_children():
            if sub is child:
                return module, name
    raise RuntimeError(f"{type(child).__name__} is not a submodule of {type(model).__name__}")


def local_rows(module, group) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``module``'s weight and the index of the first: a FSDP2 ``Shard(0)`` DTensor's local
    part, or the rows a ZeRO-3 end holds as a plain tensor (``zero.keep_ends_local``)."""
    weight = module.weight
    if hasattr(weight, "to_local"):
        return weight.to_local(), first_row(weight.shape[0], group)
    return weight, module.ladle_first_row


def first_row(vocab: int, group) -> int:
    """This rank's first row of a ``vocab``-row weight that FSDP2 shards on dim 0 (as torch.chunk does)."""
    rows = -(-vocab // dist.get_world_size(group))
    return min(dist.get_rank(group) * rows, vocab)


class ShardedVocab:
    """The loss of a model whose input embedding and/or output head stay sharded (FSDP2, or ZeRO-3's frozen ends).

    Args:
        model: the (peft or Hugging Face) causal LM, FSDP2-wrapped or DeepSpeed's engine's module.
        group: the process group the ends are sharded over.
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
        weight, start = local_rows(self.embed, self.group)
        flat = VocabParallelEmbedding.apply(
            weight, ids.reshape(-1), start, self.group, self.dtype, self.embed.padding_idx
        )
        return flat.reshape(*ids.shape, -1)

    def token_loss(self, model, data: dict[str, torch.Tensor], rows: list[int], device) -> tuple[torch.Tensor, int]:
        """``ladle.train.loss.token_loss`` with the sharded ends applied shard-wise (collective: every rank calls
        it the same number of times)."""
        from ladle.train.loss import batch_rows, token_cross_entropy

        ids, labels, positions = batch_rows(model, data, rows, device)
        out = self.forward(model, ids, positions)
        targets = labels[:, 1:].reshape(-1)
        if self.head is None:
            return token_cross_entropy(out, labels)
        return self.token_losses(out, targets).sum(), int((targets != IGNORE).sum())

    def forward(self, model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's forward with the sharded ends applied shard-wise: logits where the head is whole, else the
        final hidden states (collective)."""
        inputs = {"input_ids": ids} if self.embed is None else {"inputs_embeds": self.embeddings(ids)}
        with self.bypassed():
            return model(**inputs, position_ids=positions, use_cache=False).logits

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy of ``hidden`` (batch x seq x hidden, its last position dropped) against
        ``targets`` (flattened), 0 where a target is ignored: the head applied shard-wise (collective). The head in
        use is read now: peft's trained copy, or the original while adapters are disabled."""
        weight, start = local_rows(active_module(self.head_wrapper), self.group)
        return VocabParallelLoss.apply(hidden[:, :-1].reshape(-1, hidden.size(-1)), weight, targets, start, self.group)


def most_rows(count: int, group, device) -> int:
    """The largest of every rank's ``count`` (ranks may hold different numbers of tokens)."""
    counts = torch.empty(dist.get_world_size(group), dtype=torch.long, device=device)
    all_gather_single(counts, torch.tensor([count], device=device), group=group)
    return int(counts.max())


def gather_rows(tensor: torch.Tensor, most: int, group, fill) -> torch.Tensor:
    """Every rank's ``tensor`` (first dim padded to ``most`` with ``fill``), stacked in rank order."""
    padded = tensor.new_full((most, *tensor.shape[1:]), fill)
    padded[: tensor.size(0)] = tensor
    out = tensor.new_empty((dist.get_world_size(group) * most, *tensor.shape[1:]))
    all_gather_single(out, padded.contiguous(), group=group)
    return out


def row_chunks(rows: int, vocab_rows: int, budget: int) -> list[slice]:
    """Consecutive token rows whose float32 logits over ``vocab_rows`` fit ``budget`` bytes (at least one row)."""
    step = max(1, budget // max(1, 4 * vocab_rows))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def logits_of(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits in the model's dtype, as the head computes them, then in float32 at least, as token_loss has them."""
    logits = hidden @ weight.t()
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class VocabParallelLoss(torch.autograd.Function):
    """Per-token cross-entropy of this rank's tokens (0 where the target is ignored), the vocabulary split over
    ``group`` (see the module).

    The logits are never whole: the forward computes them ``budget`` bytes of rows at a time and keeps, per
    token, this rank's maximum, sum of exponentials and target logit (an online softmax, merged across ranks
    with two all-reduces); the backward recomputes each chunk (one more matmul of the head's, instead of
    keeping tokens x vocabulary float32 probabilities: 2 GB for 4 096 tokens of a 128k vocabulary).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, start: int, group, budget: int = LOGITS_CHUNK_BYTES):
        rank = dist.get_rank(group)
        most = most_rows(hidden.size(0), group, hidden.device)
        everyone = gather_rows(hidden.detach(), most, group, 0)
        local = gather_rows(targets, most, group, IGNORE) - start
        mine = (local >= 0) & (local < weight.size(0))
        w = weight.detach().to(everyone.dtype)
        wide = torch.promote_types(everyone.dtype, torch.float32)
        rows = everyone.size(0)
        top, total, picked = (torch.zeros(rows, dtype=wide, device=everyone.device) for _ in range(3))
        for part in row_chunks(rows, weight.size(0), budget):
            logits = logits_of(everyone[part], w)
            held = mine[part].nonzero().squeeze(1)
            picked[part.start + held] = logits[held, local[part][held]]
            top[part] = logits.max(dim=1).values
            total[part] = logits.sub_(top[part, None]).exp_().sum(dim=1)
            del logits  # before the next chunk's: one chunk alive at a time
        peak = top.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        total *= (top - peak).exp_()  # each rank's sum, rescaled to the global maximum
        dist.all_reduce(total, group=group)
        dist.all_reduce(picked, group=group)
        lse = peak + total.log_()  # log of the softmax's denominator, per token
        trained = local + start != IGNORE
        losses = torch.where(trained, lse - picked, torch.zeros_like(lse))
        ctx.save_for_backward(everyone, weight, local, mine, trained, lse)
        ctx.group, ctx.most, ctx.count, ctx.budget = group, most, hidden.size(0), budget
        return losses[rank * most : rank * most + hidden.size(0)]

    @staticmethod
    def backward(ctx, grad):
        everyone, weight, local, mine, trained, lse = ctx.saved_tensors
        group, most = ctx.group, ctx.most
        world = dist.get_world_size(group)
        # d loss / d logits = softmax - one-hot(target), times each token's upstream gradient (held by its rank).
        row_scale = (gather_rows(grad.contiguous(), most, group, 0) * trained).to(lse.dtype)
        w = weight.to(everyone.dtype)
        partial = torch.empty_like(everyone)
        d_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        for part in row_chunks(everyone.size(0), weight.size(0), ctx.budget):
            probs = logits_of(everyone[part], w).sub_(lse[part, None]).exp_()
            held = mine[part].nonzero().squeeze(1)
            probs[held, local[part][held]] -= 1
            d_logits = probs.mul_(row_scale[part, None]).to(everyone.dtype)
            partial[part] = d_logits @ w
            if d_weight is not None:  # every rank's tokens: the sum FSDP2's reduce-scatter makes (it then averages)
                d_weight += d_logits.t() @ everyone[part]
            del probs, d_logits  # before the next chunk's: one chunk alive at a time
        d_hidden = torch.empty((most, partial.size(1)), dtype=partial.dtype, device=partial.device)
        reduce_scatter_single(d_hidden, partial, group=group)
        if d_weight is not None:
            d_weight = (d_weight / world).to(weight.dtype)
        return d_hidden[: ctx.count], d_weight, None, None, None, None


class VocabParallelEmbedding(torch.autograd.Function):
    """Embeddings of this rank's ``ids``, the embedding's rows split over ``group``: the ranks exchange the ids,
    each fills in the rows it holds for every rank's tokens, and a reduce-scatter (one non-zero term per row)
    hands each rank its own. The backward gathers every rank's output gradient and adds it into the rows held
    here, divided by the world as FSDP2 averages."""

    @staticmethod
    def forward(ctx, weight, ids, start: int, group, dtype, padding_idx):
        world = dist.get_world_size(group)
        most = most_rows(ids.numel(), group, ids.device)
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
