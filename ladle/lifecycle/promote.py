"""The model registry's lifecycle: register, gate, promote, roll back; MLflow aliases, not stages.

A merged model is registered only after it was evaluated and answered its smoke request, with alias
``challenger``. It becomes ``champion`` only when it beats the current champion (or, with none, the base
model) on the same held-out set by more than ``promote.min_improvement`` on the gate metric. Every decision,
its numbers and its reason are tags on the version. The registered model keeps the order in which versions
were champion (tag ``ladle.champion_history``), so a rollback knows "the previous champion".
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from pydantic import BaseModel, Field

from ladle.errors import LadleError
from ladle.lifecycle.lock import champion_lock
from ladle.lifecycle.registry import REFUSALS, absent, client, registry, unreachable  # noqa: F401 - promote's API
from ladle.platform.secrets import redact_url

CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_TAG = "ladle.champion_history"
CANARY_PENDING = "canary"
"""The ``ladle.promotion`` tag of a version that passed the gate and waits for its canary."""


class Version(BaseModel):
    name: str
    version: str
    source: str = Field(description="Where the model's files are (the merged model's folder).")
    aliases: list[str] = Field(default_factory=list)
    tags: dict[str, str] = Field(default_factory=dict)
    run_id: str | None = None
    created_ms: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            k.removeprefix("ladle.metric."): float(v) for k, v in self.tags.items() if k.startswith("ladle.metric.")
        }


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


def as_version(mv) -> Version:
    return Version(
        name=mv.name,
        version=str(mv.version),
        source=mv.source,
        aliases=list(mv.aliases or []),
        tags=dict(mv.tags or {}),
        run_id=mv.run_id,
        created_ms=int(mv.creation_timestamp or 0),
    )


def register(uri: str, name: str, source: str, run_id: str | None, tags: dict[str, str]) -> Version:
    """The version of ``name`` for ``source`` from ``run_id`` (created if needed), with ``tags``, aliased
    ``challenger``. Idempotent: a retry after a partial failure finds the version the first try made
    (same run, same source) instead of registering a second one.

    Raises:
        LadleError: the registry failed (not "not found").
    """
    mlflow = client(uri)
    try:
        mlflow.get_registered_model(name)
    except Exception as exc:  # noqa: BLE001 - MLflow raises RestException subclasses for "not found"
        if not absent(exc):
            raise unreachable(uri, exc, f"looking up registered model {name!r}") from None
        try:
            mlflow.create_registered_model(name, description="Fine-tuned by ladle; alias `champion` is the one served.")
        except Exception as exc:  # noqa: BLE001 - another run created it first: that one is ours too
            if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise unreachable(uri, exc, f"creating registered model {name!r}") from None
    with registry(uri, f"registering {source} as a version of {name!r}"):
        made = [mv for mv in mlflow.search_model_versions(f"name = '{name}' and run_id = '{run_id}'") if run_id]
        mv = next((mv for mv in made if mv.source == source), None)
        if mv is None:
            tags = {k: str(v) for k, v in tags.items()}
            mv = mlflow.create_model_version(name, source=source, run_id=run_id, tags=tags)
        mlflow.set_registered_model_alias(name, CHALLENGER, str(mv.version))
        return as_version(mlflow.get_model_version(name, str(mv.version)))


def get_version(uri: str, name: str, version: str) -> Version:
    """Raises: LadleError: no such model or version."""
    try:
        return as_version(client(uri).get_model_version(name, str(version)))
    except Exception:  # noqa: BLE001 - MLflow's "not found" is a RestException
        known = ", ".join(v.version for v in versions(uri, name)) or "none"
        raise LadleError(f"VERSION = {version!r}: model {name!r} has no such version (versions: {known}).") from None


def champion(uri: str, name: str) -> Version | None:
    """The version aliased ``champion``, or None (no such model, or nothing promoted yet).

    Raises:
        LadleError: the registry failed. An outage is never "no champion": the gate would then compare the
            new model with the base and might promote it over the one in service.
    """
    try:
        return as_version(client(uri).get_model_version_by_alias(name, CHAMPION))
    except Exception as exc:  # noqa: BLE001 - "not found" for both a missing model and a missing alias
        if absent(exc):
            return None
        raise unreachable(uri, exc, f"reading {name}@{CHAMPION}") from None


def versions(uri: str, name: str) -> list[Version]:
    """Every version of ``name``, newest first (empty when the model does not exist)."""
    mlflow = client(uri)
    found = [as_version(mv) for mv in mlflow.search_model_versions(f"name = '{name}'")]
    if found:  # search results carry no aliases on every store: take them from the registered model
        aliases = mlflow.get_registered_model(name).aliases or {}
        for v in found:
            v.aliases = sorted(alias for alias, number in aliases.items() if str(number) == v.version)
    return sorted(found, key=lambda v: int(v.version), reverse=True)


def history(uri: str, name: str) -> list[str]:
    """Versions in the order they became champion (the last is the current one)."""
    tags = client(uri).get_registered_model(name).tags or {}
    return json.loads(tags.get(HISTORY_TAG, "[]"))


def set_champion(uri: str, name: str, version: str, reason: str, history_: list[str]) -> None:
    mlflow = client(uri)
    mlflow.set_registered_model_alias(name, CHAMPION, version)
    mlflow.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history_[-100:]))
    mlflow.set_model_version_tag(name, version, "ladle.champion_since", str(int(time.time())))
    mlflow.set_model_version_tag(name, version, "ladle.champion_reason", reason[:4000])


def promote(uri: str, name: str, version: str, reason: str) -> None:
    """Point ``champion`` at ``version`` and append it to the history (once: a retry that finds it last
    already does not append it again)."""
    past = history(uri, name)
    set_champion(uri, name, version, reason, past if past[-1:] == [version] else [*past, version])


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
        decision = guard_probe(decision, scores.get("probe"), reference.get("probe"), rule.max_probe_drop)
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


RETRAINING_TAG = "ladle.retraining.last"


def record_retraining_check(uri: str, name: str, entry: dict) -> bool:
    """Keep a scheduled run's decision (``entry``: decision, reason, fingerprint, flow run) on the registered
    model, stamped with the time; False when there is no registered model yet to keep it on."""
    with registry(uri, f"recording the retraining check on {name}"):
        try:
            client(uri).set_registered_model_tag(
                name, RETRAINING_TAG, json.dumps({**entry, "at": int(time.time())})[:8000]
            )
        except Exception as exc:  # noqa: BLE001 - MLflow raises its own error for a missing model
            if absent(exc):
                return False
            raise
    return True


def retraining_check(uri: str, name: str) -> dict | None:
    """The last scheduled run's decision kept by ``record_retraining_check``, or None."""
    with registry(uri, f"reading {name}'s retraining check"):
        tags = client(uri).get_registered_model(name).tags or {}
    return json.loads(tags[RETRAINING_TAG]) if RETRAINING_TAG in tags else None


def mark_canary(uri: str, name: str, version: str) -> Version:
    """Make ``version`` the one that waits for its canary (alias ``challenger``, ``ladle.promotion`` = canary):
    where the champion is served with ``promote.canary``, the next reconcile runs it.

    Raises:
        LadleError: no such model or version, or it is the champion already.
    """
    if not versions(uri, name):
        raise LadleError(f"NAME = {name!r}: no registered model of that name at {redact_url(uri)}.")
    target = get_version(uri, name, version)
    current = champion(uri, name)
    if current is not None and current.version == target.version:
        raise LadleError(f"VERSION = {version}: version {version} is the champion of {name!r} already; nothing to try.")
    with champion_lock(uri, name, f"marking v{version} for a canary"), registry(uri, f"marking {name} v{version}"):
        mlflow = client(uri)
        mlflow.set_model_version_tag(name, target.version, "ladle.promotion", CANARY_PENDING)
        mlflow.set_registered_model_alias(name, CHALLENGER, target.version)
    return target


def rollback(uri: str, name: str, to: str | None = None) -> tuple[str | None, str]:
    """Re-point ``champion``: to ``to``, or to the champion before the current one.

    Returns:
        ``(previous champion version or None, new champion version)``.

    Raises:
        LadleError: no such model or version, or no previous champion to go back to.
    """
    if not versions(uri, name):
        raise LadleError(f"NAME = {name!r}: no registered model of that name at {redact_url(uri)}.")
    with champion_lock(uri, name, f"a rollback of {name}"):
        return rollback_locked(uri, name, to)


def rollback_locked(uri: str, name: str, to: str | None) -> tuple[str | None, str]:
    """``rollback`` under the champion lock: the history read and the alias written are one step. A version
    waiting for its canary is taken off it: an operator rolling back does not want a canary to promote anything
    after them."""
    current = champion(uri, name)
    past = history(uri, name)
    if to is not None:
        get_version(uri, name, to)  # exists
        target, new_history = str(to), [*past, str(to)]
    else:
        trail = list(past)
        while trail and current is not None and trail[-1] == current.version:
            trail.pop()  # the current champion's own entries
        if not trail:
            raise LadleError(
                f"NAME = {name!r}: no previous champion to roll back to (champion history: {past or 'empty'}). "
                "Name one with --to VERSION."
            )
        target, new_history = trail[-1], trail
    if current is not None and current.version == target:
        raise LadleError(f"--to {target}: version {target} is already the champion of {name!r}.")
    reason = f"rollback from v{current.version if current else '-'}"
    set_champion(uri, name, target, reason, new_history)
    withdraw_canary(uri, name, reason)
    return (current.version if current else None), target


def withdraw_canary(uri: str, name: str, reason: str) -> str | None:
    """Take the version waiting for (or in) its canary off it: tagged not promoted with ``reason``, its
    ``challenger`` alias removed. Returns its version, or None when none waits."""
    mlflow = client(uri)
    try:
        waiting = as_version(mlflow.get_model_version_by_alias(name, CHALLENGER))
    except Exception as exc:  # noqa: BLE001 - MLflow's "not found" for a missing alias
        if absent(exc):
            return None
        raise
    if waiting.tags.get("ladle.promotion") != CANARY_PENDING:
        return None
    mlflow.set_model_version_tag(name, waiting.version, "ladle.promotion", "not promoted")
    mlflow.set_model_version_tag(name, waiting.version, "ladle.promotion.reason", f"canary withdrawn: {reason}")
    mlflow.delete_registered_model_alias(name, CHALLENGER)
    return waiting.version
