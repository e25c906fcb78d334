"""A canary: a version that passed the offline gate takes a share of live traffic before it becomes ``champion``.

Two halves:

* **In the front** (``Canary``): while a canary runs, each request goes to the challenger's server with probability
  ``weight``, else to the champion's. The front counts, per arm, the answers and the failures (HTTP 5xx, a refused
  connection, a stream that broke) and the latency of each answered request (from sending it to its last byte).
  Every quarter second it judges: once the challenger has ``min_requests`` answers, an error rate more than
  ``max_error_rate_increase`` above the champion's, or a p95 latency more than ``max_latency_ratio`` times the
  champion's (and more than ``latency_slack_s`` above it), or a challenger process that died, **rolls back** at once (its weight drops to 0; the champion
  takes everything). When ``duration_s`` has passed with neither, the canary **passes** and the front switches
  all traffic to the challenger's (already warm) server; with fewer than ``min_requests`` challenger answers by
  then it rolls back: there was not enough evidence. The front makes these decisions by itself, so traffic is
  protected even when whatever started the canary is gone. A request refused by a dead challenger is sent on to
  the champion (it never reached the challenger), so its client does not see the failure.
* **Beside the registry** (``run``, called by ``champion.reconcile``): starts the challenger's server, hands it
  to the front, follows the verdict (with a deadline), then makes the registry say what the front did: a pass
  points ``champion`` at the version and emits ``ladle.model.promoted``; a rollback tags the version with the
  reason, removes its ``challenger`` alias and emits ``ladle.model.canary_rolled_back``. The server that lost is
  drained and stopped. Both steps are idempotent, so a rerun after a crash finishes what was decided.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ladle.config import CanaryConfig, ServeConfig
from ladle.errors import LadleError
from ladle.lifecycle import promote
from ladle.lifecycle.lock import champion_lock
from ladle.platform.processes import exited, stop_pid
from ladle.serve import records

PENDING = promote.CANARY_PENDING
CANARY_TAG = "ladle.canary"


LATENCY_SAMPLE = 4096
"""Latencies an arm keeps: a uniform sample of every answer the canary has seen (reservoir sampling), so memory
and the p95's sort stay bounded however long and busy the canary is. A p95 from 4,096 of N draws is within about
±0.7 percentile points of the whole's (one standard error), and both arms are sampled over the same period
whatever their rates, which a window of the last answers would not be."""


@dataclass
class Arm:
    requests: int = 0
    errors: int = 0
    answered: int = 0  # answers with a latency, the sample drawn from them
    latencies: list[float] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _p95: float | None = None
    _stale: bool = False

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def add(self, seconds: float) -> None:
        """One answered request's latency into the bounded sample (Vitter's algorithm R)."""
        self.answered += 1
        if len(self.latencies) < LATENCY_SAMPLE:
            self.latencies.append(seconds)
        else:
            slot = self.rng.randrange(self.answered)
            if slot >= LATENCY_SAMPLE:
                return
            self.latencies[slot] = seconds
        self._stale = True

    def p95(self) -> float | None:
        """The sample's 95th percentile, sorted again only when an answer came since the last call (the front
        judges four times a second)."""
        if not self.latencies:
            return None
        if self._stale or self._p95 is None:
            ordered = sorted(self.latencies)
            self._p95, self._stale = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)], False
        return self._p95

    def summary(self) -> dict:
        p95 = self.p95()
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 4),
            "p95_s": None if p95 is None else round(p95, 4),
        }


class Canary:
    """The front's canary state: the challenger upstream, the limits, each arm's counts, and the verdict."""

    def __init__(self, challenger: dict, champion: dict, limits: CanaryConfig, rng: random.Random | None = None):
        self.challenger, self.champion, self.limits = challenger, champion, limits
        self.started = time.monotonic()
        self.started_at = time.time()
        self.status = "running"  # then "passed" or "rolled_back"
        self.reason: str | None = None
        self.arms = {"champion": Arm(), "challenger": Arm()}
        self.rng = rng or random.Random()

    @property
    def version(self) -> str:
        return str(self.challenger["version"])

    def pick(self) -> bool:
        """Whether this request goes to the challenger."""
        return self.status == "running" and self.rng.random() < self.limits.weight

    def record(self, arm: str, ok: bool, seconds: float | None) -> None:
        if self.status != "running":
            return  # the verdict is in: later answers do not change it
        counts = self.arms[arm]
        counts.requests += 1
        if not ok:
            counts.errors += 1
        elif seconds is not None:
            counts.add(seconds)

    def judge(self, challenger_alive: bool = True) -> str | None:
        """Decide if the evidence allows; returns the new status when it changed, else None."""
        if self.status != "running":
            return None
        lim, new, old = self.limits, self.arms["challenger"], self.arms["champion"]
        elapsed = time.monotonic() - self.started
        if not challenger_alive:
            return self.end("rolled_back", f"its server (pid {self.challenger.get('pid')}) exited during the canary")
        seen = f"after {new.requests} challenger and {old.requests} champion requests in {elapsed:.0f} s"
        if new.requests >= lim.min_requests:
            excess = new.error_rate - old.error_rate
            if excess > lim.max_error_rate_increase:
                return self.end(
                    "rolled_back",
                    f"error rate {new.error_rate:.1%} vs the champion's {old.error_rate:.1%} (may exceed it by "
                    f"{lim.max_error_rate_increase:.1%}) {seen}",
                )
            ratio = self.latency_ratio()
            if ratio is not None and ratio > lim.max_latency_ratio and new.p95() - old.p95() > lim.latency_slack_s:
                return self.end(
                    "rolled_back",
                    f"p95 latency {new.p95():.3f} s vs the champion's {old.p95():.3f} s ({ratio:.2f}x; limit "
                    f"{lim.max_latency_ratio:g}x, beyond the {lim.latency_slack_s:g} s slack) {seen}",
                )
        if elapsed < lim.duration_s:
            return None
        if new.requests < lim.min_requests:
            return self.end(
                "rolled_back",
                f"not enough evidence: {new.requests} challenger requests in {lim.duration_s:g} s, fewer than "
                f"promote.canary.min_requests {lim.min_requests}; raise promote.canary.duration_s or weight",
            )
        ratio = self.latency_ratio()
        latency = (
            f"p95 latency {ratio:.2f}x the champion's (limit {lim.max_latency_ratio:g}x)"
            if ratio is not None
            else "latency not compared (the champion answered no request)"
        )
        return self.end(
            "passed",
            f"error rate {new.error_rate:.1%} vs the champion's {old.error_rate:.1%} (may exceed it by "
            f"{lim.max_error_rate_increase:.1%}), {latency}, {seen}",
        )

    def latency_ratio(self) -> float | None:
        new, old = self.arms["challenger"].p95(), self.arms["champion"].p95()
        return None if new is None or not old else new / old

    def end(self, status: str, reason: str) -> str:
        self.status, self.reason = status, reason
        return status

    def snapshot(self) -> dict:
        """What a front started after this one died needs to go on with the canary (its clock; the counts start
        again, so the evidence is all its own)."""
        return {
            "challenger": self.challenger,
            "champion": self.champion,
            "limits": self.limits.model_dump(),
            "started_at": self.started_at,
            "status": self.status,
            "reason": self.reason,
        }

    @classmethod
    def restore(cls, snapshot: dict) -> Canary:
        canary = cls(snapshot["challenger"], snapshot["champion"], CanaryConfig.model_validate(snapshot["limits"]))
        canary.started_at = snapshot["started_at"]
        canary.started = time.monotonic() - max(0.0, time.time() - snapshot["started_at"])
        canary.status, canary.reason = snapshot["status"], snapshot["reason"]
        return canary

    def summary(self) -> dict:
        return {
            "version": self.version,
            "champion_version": str(self.champion["version"]),
            "status": self.status,
            "reason": self.reason,
            "started_at": self.started_at,
            "seconds": round(time.monotonic() - self.started, 3),
            "limits": self.limits.model_dump(),
            "arms": {name: arm.summary() for name, arm in self.arms.items()},
            "challenger": {k: v for k, v in self.challenger.items() if k in ("url", "pid", "version", "log")},
            "champion": {k: v for k, v in self.champion.items() if k in ("url", "pid", "version", "log")},
        }


def challenger_alive(canary: Canary, child=None) -> bool:
    pid = canary.challenger.get("pid")
    if child is not None and child.pid == pid:
        return child.poll() is None
    return pid is None or not exited(pid)


# -- beside the registry: start, follow, apply ---------------------------------------------------------------


def pending(uri: str, name: str, champion_version: str | None) -> promote.Version | None:
    """The version aliased ``challenger`` that passed the offline gate and waits for its canary, or None."""
    with promote.registry(uri, f"reading {name}'s challenger"):
        try:
            version = promote.as_version(promote.client(uri).get_model_version_by_alias(name, promote.CHALLENGER))
        except Exception as exc:  # noqa: BLE001 - MLflow raises its own error for a missing alias
            if promote.absent(exc):
                return None
            raise
    if version.version == champion_version or version.tags.get("ladle.promotion") != PENDING:
        return None
    return version


def front_canary(front: dict, headers: dict, adapter: str | None = None) -> dict | None:
    """The front's canary (``adapter``: that adapter's), or None."""
    params = {"adapter": adapter} if adapter else None
    answer = httpx.get(front["url"] + "/ladle/canary", params=params, headers=headers, timeout=10)
    answer.raise_for_status()
    return answer.json()["canary"]


def follow(front: dict, headers: dict, version: str, deadline_s: float, adapter: str | None = None) -> dict:
    """Poll the front until the canary of ``version`` (of ``adapter``) has a verdict; past ``deadline_s`` it is
    rolled back and that is the verdict (a served model's canary is also forgotten there; an adapter's is kept
    until ``ladle.fleet.adapters.finish_canary``)."""
    deadline = time.monotonic() + deadline_s
    what = f"{adapter} v{version}" if adapter else f"v{version}"
    while time.monotonic() < deadline:
        state = front_canary(front, headers, adapter)
        if state is None or state["version"] != version:
            raise LadleError(f"the front at {front['url']} no longer runs the canary of {what} (it restarted?)")
        if state["status"] != "running":
            return state
        time.sleep(0.5)
    reason = f"no verdict within {deadline_s:.0f} s (the front's clock did not end it)"
    answer = httpx.request(
        "PATCH" if adapter else "DELETE",
        front["url"] + "/ladle/canary",
        params={"reason": reason, **({"adapter": adapter} if adapter else {})},
        headers=headers,
        timeout=10,
    )
    answer.raise_for_status()
    return answer.json()["canary"]


def apply(uri: str, name: str, state: dict) -> bool:
    """Make the registry say what the front decided (idempotent), compare-and-set under the champion lock: a pass
    promotes only while ``champion`` is still the version the canary was measured against (a rollback or another
    promotion made meanwhile wins, and the verdict is recorded as superseded); a rollback removes ``challenger``
    only while it still names this version. Returns whether ``champion`` changed."""
    version, reason = state["version"], f"canary {state['status'].replace('_', ' ')}: {state['reason']}"
    changed = superseded = False
    with (
        champion_lock(uri, name, f"the canary verdict on v{version}"),
        promote.registry(uri, f"recording the canary of {name} v{version}"),
    ):
        mlflow = promote.client(uri)
        mlflow.set_model_version_tag(name, version, CANARY_TAG, json.dumps(state)[:4000])
        current = promote.champion(uri, name)
        measured_against = str(state["champion_version"])
        if state["status"] == "passed" and current is not None and current.version not in (version, measured_against):
            superseded = True
            reason = (
                f"canary passed but superseded: champion is v{current.version} now, not v{measured_against} it was "
                f"measured against (a rollback or another promotion came first); {state['reason']}"
            )
        if state["status"] == "passed" and not superseded:
            mlflow.set_model_version_tag(name, version, "ladle.promotion", "promoted")
            mlflow.set_model_version_tag(name, version, "ladle.promotion.reason", reason[:4000])
            if current is None or current.version != version:
                promote.promote(uri, name, version, reason)
                changed = True
        else:
            mlflow.set_model_version_tag(name, version, "ladle.promotion", "not promoted")
            mlflow.set_model_version_tag(name, version, "ladle.promotion.reason", reason[:4000])
            drop_challenger(mlflow, name, version)
    if os.environ.get("PREFECT_API_URL"):
        from ladle.lifecycle import events

        if changed:
            events.emit_promoted(name, version, reason, previous=state["champion_version"])
        elif state["status"] != "passed" or superseded:
            events.emit_canary(events.CANARY_ROLLED_BACK, name, version, reason)
    return changed


def drop_challenger(mlflow, name: str, version: str) -> None:
    """Remove the ``challenger`` alias while it names ``version`` (a newer challenger keeps it)."""
    try:
        if str(mlflow.get_model_version_by_alias(name, promote.CHALLENGER).version) == str(version):
            mlflow.delete_registered_model_alias(name, promote.CHALLENGER)
    except Exception as exc:  # noqa: BLE001 - already removed by an earlier try
        if not promote.absent(exc):
            raise


def run(
    uri: str,
    name: str,
    version: promote.Version,
    cfg: ServeConfig,
    limits: CanaryConfig,
    front: dict,
    headers: dict,
    start: Callable[[], tuple[subprocess.Popen, str, Path]],
    model_dir: str,
) -> dict:
    """Run the canary of ``version`` against what ``front`` serves now and apply its verdict; the verdict.
    ``start`` starts the version's server (ready and answering: its process, URL and log); ``model_dir`` is
    where its files are.

    A canary of this version already running at the front (a rerun after a crash) is followed, not restarted.
    """
    state = front_canary(front, headers)
    if state is None or state["version"] != version.version:
        proc, url, log_path = start()
        body = {
            "url": url,
            "version": version.version,
            "pid": proc.pid,
            "model_dir": model_dir,
            "argv": list(proc.args),
            "log": str(log_path),
            "limits": limits.model_dump(),
        }
        try:
            answer = httpx.put(front["url"] + "/ladle/canary", json=body, headers=headers, timeout=30)
        except BaseException:
            stop_pid(proc.pid, 10, group=True)  # the handover was dropped: nothing else owns the server
            raise
        if answer.status_code != 200:
            stop_pid(proc.pid, 10, group=True)
            raise LadleError(f"the front refused the canary of v{version.version}: {answer.text[:500]}")
    state = follow(front, headers, version.version, limits.duration_s + 120)
    return finish(uri, name, cfg, front, headers, state)


def finish(uri: str, name: str, cfg: ServeConfig, front: dict, headers: dict, state: dict) -> dict:
    """After the front's verdict: the registry follows it, the server that lost is drained and stopped, and the
    front forgets the canary. Idempotent (each step checks first), so a crash anywhere is finished by a rerun."""
    apply(uri, name, state)
    answer = httpx.get(front["url"] + "/ladle/upstream", headers=headers, timeout=10)
    answer.raise_for_status()
    serving = (answer.json()["upstream"] or {}).get("url")
    # Whichever of the two the front does not serve now is stopped: not a snapshot's idea of the loser (after a
    # rollback during the canary, the front serves a third server and both of these go).
    for arm in (state["champion"], state["challenger"]):
        if arm["url"] != serving:
            drain(front, headers, arm["url"], cfg.drain_timeout_s)
            if arm.get("pid") and records.alive(arm):  # a ladle server still: a reused pid is left alone
                stop_pid(arm["pid"], cfg.drain_timeout_s + 10, group=True)
    httpx.delete(front["url"] + "/ladle/canary", headers=headers, timeout=10).raise_for_status()
    return state


def drain(front: dict, headers: dict, url: str, timeout_s: float) -> bool:
    """Wait until the front has no request in flight on ``url`` (True), or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = httpx.get(front["url"] + "/ladle/upstream", headers=headers, timeout=10)
        answer.raise_for_status()
        if not answer.json()["in_flight"].get(url):
            return True
        time.sleep(0.1)
    return False
