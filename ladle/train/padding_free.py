"""Padding-free micro-batches (``training.kernels.padding_free``): a micro-batch's packed rows joined into one
row without their padding, when that computes less.

A packed row is ``seq_len`` tokens, its examples first and padding after them; at 128 tokens, examples of 50-90
tokens leave a quarter of every row padding, and every layer computes it. Joined, the micro-batch is one row of
its real tokens only, position ids restarting at every example as they do within a row, so transformers keeps
attention inside each example (``masking_utils.find_packed_sequence_indices``): the loss is the padded rows'
loss (``tests/train/test_padding_free.py`` holds them equal).

What it costs: attention over one long row. SDPA with a mask computes every query-key pair of the row, so
joining B rows of S tokens into one of R real tokens trades ``B*S - R`` padded tokens through every linear layer
for ``R**2 - B*S**2`` more attention pairs. ``JoinRows.worth`` counts both in multiply-adds from the model's
config (per layer: the projections and the MLP per token, ``2 x heads x head_dim`` per query-key pair) and joins
only when the joined row costs less. One row with padding always gains (its padding is dropped, nothing is
added); many nearly full rows of long sequences never do. Where attention runs example by example
(``training.kernels.packed_attention``), joining adds no pair, and any padding is worth dropping.

Memory: the planner sizes activations for the padded rows, and a joined row holds fewer tokens, so the planned
peak stays an upper bound; the joined row's attention mask (R x R, against B x S x S padded) is a few MB at the
lengths the cost rule admits (6,226 tokens for two 4096-token rows a quarter padding: 39 MB as bool).
"""

from __future__ import annotations

import torch

from ladle.data.packing import IGNORE


class JoinRows:
    """A run's joiner (on its model's ``ladle.train.run_state`` while it trains with padding-free
    micro-batches) and its tally."""

    def __init__(self, per_token: float, per_pair: float, by_example: bool = False) -> None:
        self.per_token, self.per_pair, self.by_example = per_token, per_pair, by_example
        self.batches = self.joined = self.row_tokens = self.computed = 0

    @classmethod
    def for_config(cls, config, by_example: bool = False) -> JoinRows:
        """Costs from a Hugging Face model config (a decoder with a gated MLP; a plain MLP counts one matrix less)."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        inner = getattr(config, "intermediate_size", None) or 4 * hidden
        gated = 3 if getattr(config, "hidden_act", "silu") in ("silu", "swiglu", "gelu_pytorch_tanh") else 2
        per_token = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + gated * hidden * inner
        return cls(per_token, 2 * heads * head_dim, by_example)

    def cost(self, lengths: list[int]) -> float:
        """Multiply-adds per layer of rows of these lengths (every query-key pair of a row computed)."""
        return sum(n * self.per_token + n * n * self.per_pair for n in lengths)

    def worth(self, real: list[int], seq_len: int) -> bool:
        if self.by_example:  # attention per example: the joined row has the same examples, less padding
            return sum(real) < seq_len * len(real)
        return self.cost([sum(real)]) < self.cost([seq_len] * len(real))

    def join(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, real: torch.Tensor):
        """``ids``, ``labels``, ``positions`` (rows x seq_len) joined into one row of their first ``real[i]``
        tokens each where that computes less; as they are otherwise."""
        lengths = [int(n) for n in real.tolist()]
        rows, seq_len = ids.shape
        self.batches += 1
        self.row_tokens += rows * seq_len
        if not self.worth(lengths, seq_len):
            self.computed += rows * seq_len
            return ids, labels, positions
        self.joined += 1
        self.computed += sum(lengths)
        cut = [labels[i, :n].clone() for i, n in enumerate(lengths)]
        for piece in cut:
            # A row's first label is never a target (the shift drops it); joined, it would be the target of the
            # previous row's last token, across two examples.
            piece[0] = IGNORE
        return tuple(
            torch.cat(parts).unsqueeze(0)
            for parts in (
                [ids[i, :n] for i, n in enumerate(lengths)],
                cut,
                [positions[i, :n] for i, n in enumerate(lengths)],
            )
        )

    def summary(self) -> str:
        """What ran, in words (the result's ``kernels.padding_free``)."""
        if not self.batches:
            return "on: no micro-batch ran"
        dropped = 1 - self.computed / max(self.row_tokens, 1)
        return (
            f"on: {self.joined} of {self.batches} micro-batches joined into one row; "
            f"{dropped:.1%} of row tokens (padding) not computed"
        )


def install(model, decided: dict, by_example: bool = False) -> str:
    """Start joining ``model``'s micro-batches where the plan decided to; what runs, in words. ``by_example``:
    attention runs example by example (``ladle.train.packed_attention``), so joining adds no attention pairs."""
    from ladle.train import run_state

    state = run_state.on(model)
    state.joiner = JoinRows.for_config(model.config, by_example) if decided.get("padding_free") else None
    return "on" if state.joiner is not None else "off"


def report(ran: dict, model) -> None:
    """Replace ``ran['padding_free']`` with the tally, once the steps have run."""
    from ladle.train import run_state

    joiner = run_state.of(model).joiner
    if joiner is not None:
        ran["padding_free"] = joiner.summary()
