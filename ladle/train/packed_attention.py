"""Attention example by example inside packed rows (``training.kernels.packed_attention``).

A packed row holds several examples, position ids restarting at each. transformers keeps attention inside each
example with a block-diagonal mask, and SDPA with a mask computes every query-key pair of the row: a 256-token
row of three examples computes 256 x 256 pairs where the examples need 100^2 + 90^2 + 66^2 (and, given a mask,
SDPA's CPU kernel cannot skip the blocks above the diagonal either). Here each example's queries, keys and
values are regrouped into a batch of their own (one slot per example, as long as the longest example in the
micro-batch), SDPA runs causal over that batch, and the outputs go back to the tokens' places. That is
variable-length attention, as FlashAttention's varlen kernels do on CUDA, from plain SDPA on any device.

The regrouping is a gather of q, k, v and a gather back of the output, computed once per forward from the
position ids (every layer gets the same tensor) and reused by every layer. The loss and gradients equal the
masked path's to float32 rounding (``tests/train/test_packed_attention.py``); on the tiny model's 256-token
rows it took a CPU step from 125-131 ms to 93-103 ms.

It replaces the model's attention through transformers' ``AttentionInterface`` under the name ``ladle_packed``
(not written into saved configs), for model types whose attention is plain causal attention: no sliding window,
no logit soft-capping. The model then builds no mask at all: it is for the worker's forwards, which always pass
position ids and no cache (a call without position ids, or with a cache, runs SDPA as transformers would).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ladle.strategies.attention import unsupported

NAME = "ladle_packed"


class Layout:
    """Where each token of a rows x length batch goes when its examples become a batch of their own."""

    def __init__(self, position_ids: torch.Tensor) -> None:
        from transformers.masking_utils import find_packed_sequence_indices

        device = position_ids.device
        # transformers' own rule for where an example ends (its positions stop counting), numbered per row
        within = find_packed_sequence_indices(position_ids)
        if within is None:  # one example per row
            within = torch.zeros_like(position_ids)
        per_row = within[:, -1] + 1
        example = (within + (per_row.cumsum(0) - per_row)[:, None]).reshape(-1)
        lengths = torch.bincount(example)
        starts = lengths.cumsum(0) - lengths
        total = example.numel()
        self.examples, self.longest = int(starts.numel()), int(lengths.max())
        offset = torch.arange(total, device=device) - starts[example]
        # The slot of every token, and for every slot the token it reads (slots past an example's end repeat its
        # last token: causal attention never lets a real query see them, and their outputs are never read).
        self.slot_of_token = example * self.longest + offset
        last = (starts + lengths - 1)[:, None]
        self.token_of_slot = torch.minimum(starts[:, None] + torch.arange(self.longest, device=device), last).reshape(
            -1
        )
        self.source = position_ids

    def regroup(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, heads, length, dim) -> (examples, heads, longest, dim)."""
        rows, heads, length, dim = x.shape
        x = x.transpose(1, 2).reshape(rows * length, heads, dim).index_select(0, self.token_of_slot)
        return x.view(self.examples, self.longest, heads, dim).transpose(1, 2)

    def restore(self, out: torch.Tensor, rows: int, length: int) -> torch.Tensor:
        """(examples, heads, longest, dim) -> (rows, length, heads, dim), the layout transformers expects back."""
        heads, dim = out.shape[1], out.shape[3]
        out = out.transpose(1, 2).reshape(self.examples * self.longest, heads, dim).index_select(0, self.slot_of_token)
        return out.view(rows, length, heads, dim)


_last: Layout | None = None


def layout_of(position_ids: torch.Tensor) -> Layout:
    """The layout of these position ids; every layer of one forward gets the same tensor, so it is built once."""
    global _last
    if _last is None or _last.source is not position_ids:
        _last = Layout(position_ids)
    return _last


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: (rows, heads, length, dim) in, (rows, length, heads, dim) out."""
    position_ids = kwargs.get("position_ids")
    rows, heads, length, _ = query.shape
    if position_ids is None or key.shape[2] != length or attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if position_ids.shape[0] != rows:
        position_ids = position_ids.expand(rows, -1)
    layout = layout_of(position_ids)
    out = F.scaled_dot_product_attention(
        layout.regroup(query),
        layout.regroup(key),
        layout.regroup(value),
        dropout_p=dropout,
        is_causal=True,
        scale=scaling,
        enable_gqa=key.shape[1] != heads,
    )
    return layout.restore(out, rows, length), None


def install(model, decided: dict) -> str:
    """Run ``model``'s attention example by example where the plan decided to; what runs, in words."""
    wanted = decided.get("packed_attention", "off")
    if wanted == "off":
        return "off"
    why = unsupported(model.config)
    if why is not None:
        if wanted == "on":
            raise RuntimeError(
                f"training.kernels.packed_attention = true: {why}. Set training.kernels.packed_attention=auto or false."
            )
        return f"off: {why}"
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    model.set_attn_implementation(NAME)
    return "on: causal SDPA per example"
