"""Which models' attention ladle's own attention layers can take over: plain causal attention over the rows they
are given (no sliding window, no soft-capped logits). Both the packed-rows attention
(``ladle.train.packed_attention``) and Ulysses sequence parallelism (``ladle.train.sequence_parallel``) replace a
model's attention through transformers' ``AttentionInterface``; the planner asks here before the worker does,
without torch."""

from __future__ import annotations

from typing import Any

# Model types whose self-attention is plain causal attention over the rows it is given.
PLAIN_ATTENTION_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo", "olmo2", "gemma")


def unsupported(config: Any) -> str | None:
    """Why this model's attention is not plain causal attention (None when it is); ``config`` is a Hugging Face
    config object or its ``config.json`` as a dict."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    model_type = get("model_type", "") or ""
    if model_type not in PLAIN_ATTENTION_TYPES:
        return f"{model_type or 'this model'}'s attention has not been checked with it"
    if get("sliding_window", None) and get("use_sliding_window", True):
        return f"{model_type} uses sliding-window attention"
    if get("attn_logit_softcapping", None):
        return f"{model_type} soft-caps its attention logits"
    return None
