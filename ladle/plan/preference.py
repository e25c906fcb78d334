"""The plan's decisions for preference tuning (``training.objective: dpo``): whether the strategy can train pairs,
and where the reference log-probabilities come from, in GiB."""

from __future__ import annotations

from ladle import sizing
from ladle.config import LadleConfig
from ladle.plan.model import Decision
from ladle.strategies import Strategy
from ladle.strategies.base import Target


def choose_reference(cfg: LadleConfig, strategy: Strategy, target: Target, model: dict | None) -> Decision[str | None]:
    """``training.preference.reference`` resolved, and why; with the strategy's refusal where it cannot train
    pairs."""
    t = cfg.training
    if t.objective not in ("dpo", "kto"):
        return Decision(None)
    problems = []
    why_not = strategy.pairs_refusal(strategy.options(cfg))
    if why_not:
        problems.append(
            f"training.objective = {t.objective} with parallelism.strategy = {strategy.name}: {why_not}. Use ddp, zero1, "
            "zero2, zero3, zero++ or fsdp2 (or parallelism.strategy=auto)."
        )
    pref = t.preference
    if pref.loss == "simpo":
        return Decision("none", ("preference loss simpo: reference-free, no reference pass",), problems=tuple(problems))
    pairs = "both sides of each pair in one forward, one row per pair (2 x data.seq_len tokens)"
    copy = ""
    if model is not None:
        try:
            params = sizing.shape_from_config(model).params
        except (KeyError, TypeError, ValueError):
            params = 0
        if params:
            width = 4 if target.dtype == "float32" else 2
            shards = target.world_size if strategy.shards_tensors else 1
            copy = f"{sizing.gib(params * width / shards)}/rank"
    if pref.reference == "adapters_off":
        reason = (
            "reference adapters_off (explicit): the base with LoRA's adapters disabled, one no-grad forward per "
            f"micro-batch beside the policy's; {pairs}"
        )
        return Decision("adapters_off", (reason,), problems=tuple(problems))
    held = f"a frozen reference copy sharded like the policy would hold {copy} more" if copy else "no copy is held"
    chosen = "explicit" if pref.reference == "precomputed" else "auto"
    reason = (
        f"reference precomputed ({chosen}): one no-grad pass over the pairs by the model as loaded, before the "
        f"first step, stored with the run; no reference weights during the steps ({held}), and no reference "
        f"forward per step (adapters_off would run one per micro-batch); {pairs}"
    )
    return Decision("precomputed", (reason,), problems=tuple(problems))
