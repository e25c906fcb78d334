"""The champion in the model registry: register, promote, roll back, canary marks; MLflow aliases, not stages.

A merged model is registered only after it was evaluated and answered its smoke request, with alias
``challenger``. It becomes ``champion`` only when the gate (``ladle.lifecycle.gate``) says it beats the current
champion (or, with none, the base model) on the same held-out set. Every decision, its numbers and its reason
are tags on the version. The registered model keeps the order in which versions were champion (tag
``ladle.champion_history``), so a rollback knows "the previous champion". What scheduled runs decided is kept
by ``ladle.lifecycle.retraining``.
"""

from __future__ import annotations

import json
import time

from pydantic import BaseModel, Field

from ladle.errors import LadleError
from ladle.lifecycle.lock import champion_lock
from ladle.lifecycle.mlflow_client import REFUSALS, absent, client, registry, unreachable  # noqa: F401 - promote's API
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
    # An alias is a read-then-insert in MLflow's SQL store: two registrations setting `challenger` at once both
    # insert it, and one fails on the store's unique key. Alias writes go through the model's lock.
    lock = champion_lock(uri, name, f"marking v{mv.version} {CHALLENGER}")
    with lock, registry(uri, f"marking {name} v{mv.version} {CHALLENGER}"):
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


def aliased(uri: str, name: str) -> dict[str, Version]:
    """The versions aliased ``champion`` and ``challenger`` (those present), by alias.

    Raises:
        LadleError: the registry failed (a missing model or alias is just absent).
    """
    found = {}
    mlflow = client(uri)
    for alias in (CHAMPION, CHALLENGER):
        try:
            found[alias] = as_version(mlflow.get_model_version_by_alias(name, alias))
        except Exception as exc:  # noqa: BLE001 - "not found" for both a missing model and a missing alias
            if not absent(exc):
                raise unreachable(uri, exc, f"reading {name}@{alias}") from None
    return found


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
