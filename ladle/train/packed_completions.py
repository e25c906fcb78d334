"""A micro-batch's completions scored as one row of their real tokens (``training.kernels.padding_free`` under
grpo).

The update scores every completion of a micro-batch on its prompt's cache (``ladle.train.grpo.completion_logps``).
Padded, the completions are a ``rows x longest`` batch, and every linear map, norm and the head run over every
position of it; completions stop at their end-of-sequence token, so most positions can be padding (the tiny
recipe's 64 completions of at most 12 tokens hold about 310 real tokens in 768 positions).

Here the completions' real tokens run as one row, ``[1, tokens]``, each with the position id it has in the padded
layout (the prompts' width plus its index) and no cache. Only attention needs the rows: an attention function,
registered with transformers' ``AttentionInterface`` under ``NAME`` and switched on for this one forward
(``attention_switched``; the layout rides in the model call's keywords), puts each completion's queries, keys and values back in its padded slot, puts its prompt's keys and
values before them (from the prompt forward, with their gradients), and runs SDPA under the prompt's padding and a
causal mask: the attention the padded forward runs. The outputs go back to the tokens. The head then runs only at
positions whose next token is scored. The log-probabilities equal the padded path's to float32 rounding
(``tests/train/test_grpo.py``).

It runs for model types whose attention is plain causal attention (``ladle.strategies.attention``), and only where
the prompts run apart from their completions (no activation checkpointing; ``grpo.shares_prompts``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

NAME = "ladle_grpo_packed"


class Layout:
    """Where each of the micro-batch's real completion tokens sits in the padded ``rows x width`` layout, and the
    prompt keys and values each row attends to."""

    def __init__(self, lengths: list[int], prompt_kv: list, which: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        device = which.device
        rows, self.width = len(lengths), max(lengths)
        count = torch.tensor(lengths, device=device)
        starts = count.cumsum(0) - count
        self.tokens = int(count.sum())
        self.row = torch.repeat_interleave(torch.arange(rows, device=device), count)  # each token's row
        self.col = torch.arange(self.tokens, device=device) - starts[self.row]  # and its index in it
        self.slot_of_token = self.row * self.width + self.col
        # Every slot reads a token of its own row (slots past a row's end repeat its last token: causal attention
        # never lets a real query see them, and their outputs are never read back).
        last = starts + count - 1
        self.token_of_slot = torch.minimum(starts[:, None] + torch.arange(self.width, device=device), last[:, None])
        self.token_of_slot = self.token_of_slot.reshape(-1)
        self.rows = rows
        self.prompt_kv, self.which = prompt_kv, which
        keys = prompt_mask.bool().index_select(0, which)[:, None, None, :].expand(rows, 1, self.width, -1)
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=device).tril()
        self.mask = torch.cat([keys, causal.expand(rows, 1, -1, -1)], dim=-1)  # [rows, 1, width, prompt + width]

    def regroup(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, heads, tokens, dim]`` -> ``[rows, heads, width, dim]``."""
        heads, dim = x.shape[1], x.shape[3]
        x = x[0].transpose(0, 1).index_select(0, self.token_of_slot)
        return x.view(self.rows, self.width, heads, dim).transpose(1, 2)

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """``[rows, heads, width, dim]`` -> ``[1, tokens, heads, dim]``, the layout transformers expects back."""
        heads, dim = out.shape[1], out.shape[3]
        out = out.transpose(1, 2).reshape(self.rows * self.width, heads, dim).index_select(0, self.slot_of_token)
        return out.unsqueeze(0)


KEY = "ladle_layout"  # the model call's keyword that carries the layout down to every layer's attention


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: ``[1, heads, tokens, dim]`` in, ``[1, tokens, heads, dim]`` out; the
    layout comes with the model call's keywords, which transformers hands to every layer's attention."""
    layout = kwargs.get(KEY)
    if layout is None:
        raise RuntimeError(f"the {NAME} attention runs only on a forward given {KEY}= (packed_completions.logps)")
    keys, values = layout.prompt_kv[module.layer_idx]
    out = F.scaled_dot_product_attention(
        layout.regroup(query),
        torch.cat([keys.index_select(0, layout.which), layout.regroup(key)], dim=2),
        torch.cat([values.index_select(0, layout.which), layout.regroup(value)], dim=2),
        attn_mask=layout.mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return layout.restore(out), None


@contextmanager
def attention_switched(config) -> Iterator[None]:
    """While it lasts, ``config``'s model runs its attention through ``attention`` (the one forward of the packed
    completions); the model's own attention comes back after, for the engine and every other forward."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def logps(model, kv, firsts, prompt_mask, which, completions, device, scaled):
    """Each completion token's log-probability (``[rows, width]``) from one forward of the completions' real tokens
    on the prompts' keys and values ``kv`` (per layer, ``[prompts, heads, prompt width, dim]``); ``firsts``: each
    completion's first token scored by its prompt's last position (``[rows]``). Every completion has at least one
    token."""
    layout = Layout([len(c) for c in completions], kv, which, prompt_mask)
    ids = torch.tensor([t for c in completions for t in c], dtype=torch.long, device=device)
    prompt_width = prompt_mask.shape[1]
    # The head runs where the next token is scored: each token but its completion's last.
    keep = torch.nonzero(layout.col[1:] != 0).squeeze(-1)
    with attention_switched(config_of(model)):
        logits = model(
            input_ids=ids[None],
            position_ids=(prompt_width + layout.col)[None],
            use_cache=False,
            logits_to_keep=keep,
            **{KEY: layout},
        ).logits[0]
    tail = torch.log_softmax(scaled(logits), dim=-1).gather(-1, ids[keep + 1].unsqueeze(-1)).squeeze(-1)
    # Each token's value: its row's first-token score at index 0, else the tail's score of the token before it.
    source = torch.empty(layout.tokens, dtype=torch.long, device=device)
    first = layout.col == 0
    source[first] = layout.row[first]
    source[~first] = layout.rows + torch.arange(int(keep.numel()), device=device)
    values = torch.cat([firsts, tail]).index_select(0, source)
    flat = torch.zeros(layout.rows * layout.width, dtype=values.dtype, device=device)
    return flat.index_copy(0, layout.slot_of_token, values).view(layout.rows, layout.width)


def config_of(model):
    """The Hugging Face config the attention modules of ``model`` read (under DDP's or DeepSpeed's wrapper, peft's,
    or none)."""
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return inner.config


def resolve(decided: dict, asked: bool | str, config, recomputes: bool) -> tuple[bool, str]:
    """Whether this run scores its completions as one row (the plan's ``padding_free``, the model's attention and
    whether the prompts run apart), and the run's words for it; ``asked``: ``training.kernels.padding_free``.

    Raises:
        RuntimeError: ``training.kernels.padding_free = true`` where it cannot run.
    """
    from ladle.strategies.attention import unsupported

    if not decided.get("padding_free"):
        return False, "off"
    why = unsupported(config) or ("activations are recomputed in the backward" if recomputes else None)
    if why is None:
        return True, "on: each micro-batch's completions as one row of their real tokens, attention per completion"
    if asked is True:
        raise RuntimeError(
            f"training.kernels.padding_free = true: {why}. Set training.kernels.padding_free=auto or false."
        )
    return False, f"off: {why}"
