"""The gate: whether a new version replaces the champion (``Rule``: ``eval.metric`` and ``promote.*``), decided
against the champion in service and recorded under the champion lock (``gate_and_promote``); the registry's
champion, history and rollback are in ``ladle.lifecycle.promote``."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, Field

from ladle.errors import LadleError
from ladle.lifecycle.lock import champion_lock
from ladle.lifecycle.mlflow_client import client, registry
from ladle.lifecycle.promote import (
    CANARY_PENDING,
    Version,
    champion,
    get_version,
    history,
    promote,
    register,
)


class Decision(BaseModel):
    promoted: bool
    metric: str
    greater_is_better: bool
    candidate: float | None = Field(description="The new model's score.")
    reference: float | None = Field(description="The score it had to beat.")
    against: str = Field(description="What it was compared with: `champion vN` or `base model`.")
    min_improvement: float
    improvement: float | None = Field(description="How much better the new model is (positive: better).")
    reason: str
    probe: float | None = Field(None, description="The new model's general-ability probe score (eval.probe).")
    probe_reference: float | None = Field(None, description="The probe score of what it was compared with.")
    max_probe_drop: float | None = Field(None, description="promote.max_probe_drop: how far the probe may fall.")
    canary: bool = Field(
        False, description="It passed the gate and waits for its canary (promote.canary); `champion` unchanged."
    )


def to_canary(decision: Decision, plan: str) -> Decision:
    """A passed gate's ``decision`` when a canary decides instead (``plan`` says how it runs)."""
    if not decision.promoted:
        return decision
    numbers = decision.reason.removeprefix("promoted: ")
    reason = f"canary next: passed the gate ({numbers}); {plan} before it becomes champion"
    return decision.model_copy(update={"promoted": False, "canary": True, "reason": reason})


def decide(
    metric: str,
    greater_is_better: bool,
    candidate: float | None,
    reference: float | None,
    against: str,
    min_improvement: float,
) -> Decision:
    """Promote when ``candidate`` beats ``reference`` by more than ``min_improvement`` in the metric's direction."""
    fields = {
        "metric": metric,
        "greater_is_better": greater_is_better,
        "candidate": candidate,
        "reference": reference,
        "against": against,
        "min_improvement": min_improvement,
    }
    if candidate is None or reference is None:
        missing = "the new model" if candidate is None else against
        reason = (
            f"not promoted: {metric} was not measured for {missing} (no held-out conversations or eval rows); "
            "give the data an eval split, or gate on another metric (promote.metric)"
        )
        return Decision(promoted=False, improvement=None, reason=reason, **fields)
    improvement = candidate - reference if greater_is_better else reference - candidate
    better = "higher" if greater_is_better else "lower"
    numbers = f"{metric} {candidate:.4g} vs {against} {reference:.4g} ({better} is better; change {improvement:+.4g}"
    if improvement > min_improvement:
        return Decision(
            promoted=True,
            improvement=improvement,
            reason=f"promoted: {numbers}, needed > {min_improvement:g})",
            **fields,
        )
    return Decision(
        promoted=False,
        improvement=improvement,
        reason=f"not promoted: {numbers}, needed > {min_improvement:g})",
        **fields,
    )


def guard_probe(
    decision: Decision, candidate: float | None, reference: float | None, max_drop: float | None
) -> Decision:
    """The task gate's ``decision``, held back when the new model's general-ability probe fell by more than
    ``max_drop`` below the reference's (the champion's, or the base's); None: the probe is not gated."""
    fields = {"probe": candidate, "probe_reference": reference, "max_probe_drop": max_drop}
    if max_drop is None or not decision.promoted:
        return decision.model_copy(update=fields)
    if candidate is None or reference is None:
        missing = "the new model" if candidate is None else decision.against
        reason = f"not promoted: the probe was not scored for {missing}; the task gate alone said: {decision.reason}"
        return decision.model_copy(update={**fields, "promoted": False, "reason": reason})
    drop = reference - candidate
    numbers = f"probe {candidate:.4g} vs {decision.against} {reference:.4g}"
    if drop > max_drop:
        reason = (
            f"not promoted: {numbers} fell by {drop:.4g}, more than promote.max_probe_drop {max_drop:g} (general "
            f"ability lost); the task gate alone said: {decision.reason}"
        )
        return decision.model_copy(update={**fields, "promoted": False, "reason": reason})
    return decision.model_copy(update={**fields, "reason": f"{decision.reason}; {numbers} (may fall by {max_drop:g})"})


def guard_parity(decision: Decision, failure: str | None) -> Decision:
    """The gate's ``decision``, held back when the served model is not the trained one (``failure`` says where)."""
    if failure is None or not decision.promoted:
        return decision
    reason = (
        f"not promoted: the served model is not the trained one ({failure}); the task gate alone said: "
        f"{decision.reason}"
    )
    return decision.model_copy(update={"promoted": False, "reason": reason})


def win_on_traffic(decision: Decision, win: tuple[str, str] | None) -> Decision:
    """The task gate's ``decision``, promoted when it failed only for want of improvement (the metric did not get
    worse) and the challenger beat this same champion on its users' replayed traffic: what users corrected is the
    truest held-out set there is, and a held-out task already at its ceiling cannot improve."""
    if win is None or decision.promoted or decision.improvement is None or decision.improvement < 0:
        return decision
    against, how = win
    if against != decision.against:
        return decision
    reason = f"promoted: {how}; the task gate: {decision.reason.removeprefix('not promoted: ')}"
    return decision.model_copy(update={"promoted": True, "reason": reason})


def guard_shadow(decision: Decision, failure: str | None) -> Decision:
    """The gate's ``decision``, held back when the challenger regressed on the champion's replayed traffic."""
    if failure is None or not decision.promoted:
        return decision
    reason = f"not promoted: {failure}; the task gate alone said: {decision.reason}"
    return decision.model_copy(update={"promoted": False, "reason": reason})


class Rule(BaseModel):
    """What a new version must do to replace the champion (``eval.metric``, ``promote.*``)."""

    model_config = {"frozen": True}

    metric: str
    greater_is_better: bool
    min_improvement: float = 0.0
    max_probe_drop: float | None = None
    """The general-ability probe may fall by at most this much (None: not guarded)."""
    canary: str | None = None
    """How the canary runs, in words (None: no canary, the gate promotes)."""
    parity_failure: str | None = None
    """Where the served model differs from the trained one (``ladle.lifecycle.parity``); None: it does not, or the
    check was not made or does not gate."""
    shadow_failure: str | None = None
    """How the challenger regressed on the replayed traffic (``ladle.lifecycle.shadow``); None: it did not, or no
    replay was made."""
    shadow_win: tuple[str, str] | None = None
    """``(the champion replayed, e.g. "champion v3"; how the challenger beat it)`` where it did significantly on the
    replayed traffic: enough to promote it when the task metric did not get worse."""


def gate_and_promote(
    uri: str,
    name: str,
    source: str,
    scores: dict[str, float],
    reference_of: Callable[[Version | None], tuple[dict[str, float], str]],
    rule: Rule,
    *,
    run_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> tuple[Version, Decision, Version | None]:
    """Register ``source`` (alias ``challenger``, from MLflow run ``run_id``, tagged ``tags``), gate its
    ``scores`` against the champion's (``reference_of`` gives them, or the base's when there is none) by
    ``rule`` and, when it wins, make it ``champion`` (with ``rule.canary``: tag it as waiting for its canary
    instead, ``champion`` unchanged).

    Safe to run again after any failure, with the same result as one clean run: registration finds the version
    a first try made; a first try that failed after the alias flip left this version champion, so its history
    names the champion it was compared with, and the gate runs against that one again. The alias is the one
    write that changes what is served, and the history is appended once. A registry that fails is one
    ``unreachable`` error naming what was being done, never a half-decided "no champion".

    Returns:
        ``(the version, the decision, the champion it was compared with or None)``.
    """
    version = register(uri, name, source, run_id, tags or {})
    metric = rule.metric
    for _ in range(GATE_TRIES):
        observed = champion(uri, name)
        current = gate_reference(uri, name, observed, version)
        reference, against = reference_of(current)
        decision = decide(
            metric, rule.greater_is_better, scores.get(metric), reference.get(metric), against, rule.min_improvement
        )
        decision = win_on_traffic(decision, rule.shadow_win)
        decision = guard_probe(decision, scores.get("probe"), reference.get("probe"), rule.max_probe_drop)
        decision = guard_parity(decision, rule.parity_failure)
        decision = guard_shadow(decision, rule.shadow_failure)
        if rule.canary is not None:
            decision = to_canary(decision, rule.canary)
        with champion_lock(uri, name, f"the gate of v{version.version}"):
            now = champion(uri, name)
            if (now and now.version) != (observed and observed.version):
                continue  # promoted or rolled back while this one was compared: compare with the one in service now
            with registry(uri, f"recording the decision on {name} v{version.version}"):
                tag_decision(uri, name, version.version, decision)
                if decision.promoted:
                    promote(uri, name, version.version, decision.reason)
            return version, decision, current
    raise LadleError(
        f"{name} v{version.version}: the champion changed {GATE_TRIES} times while this version was compared with "
        "it; nothing was decided. Run the promotion again.",
        exit_code=1,
    )


GATE_TRIES = 5
"""Comparisons a gate makes when other writers keep changing the champion under it."""


def gate_reference(uri: str, name: str, observed: Version | None, version: Version) -> Version | None:
    """The champion ``version`` is compared with: ``observed``, unless it is ``version`` itself (a first try
    that failed after the alias flip), then the champion before it."""
    if observed is None or observed.version != version.version:
        return observed
    with registry(uri, f"reading {name}'s champion history"):
        past = [v for v in history(uri, name) if v != version.version]
    return get_version(uri, name, past[-1]) if past else None


def tag_decision(uri: str, name: str, version: str, decision: Decision) -> None:
    mlflow = client(uri)
    tags = {
        "ladle.promotion": "promoted" if decision.promoted else CANARY_PENDING if decision.canary else "not promoted",
        "ladle.promotion.reason": decision.reason,
        "ladle.promotion.against": decision.against,
        "ladle.promotion.metric": decision.metric,
        "ladle.promotion.reference": "" if decision.reference is None else repr(decision.reference),
        "ladle.promotion.min_improvement": repr(decision.min_improvement),
    }
    for key, value in tags.items():
        mlflow.set_model_version_tag(name, version, key, value[:4000])
