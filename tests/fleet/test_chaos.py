"""Chaos under traffic, with real processes (the front, the model servers, a SQLite registry): an operator's
rollback during a canary; the model server killed and, during its supervisor's backoff, two promotions racing and
the swap to their winner; the front killed and started again. Afterwards the registry's champion is the version
the front serves, every failed request was in flight on a process that was killed (or sent while the front was
down), and every ladle server process left is the one the front serves: nothing runs that nothing owns."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from ladle.config import CanaryConfig, ServeConfig
from ladle.fleet import champion
from ladle.fleet import front as router
from ladle.lifecycle import gate as gates
from ladle.lifecycle import promote
from ladle.platform.processes import free_port
from ladle.serve import records
from ladle.serve.limits import ServeLimits
from tests.helpers import Traffic, fresh_registry, wait_for_requests

NAME = "chaos"


def register(uri: str, source: str, n: int, score: float) -> promote.Version:
    tags = {"ladle.model_sha256": f"{n:x}" * 64, "ladle.metric.exact_match": repr(score)}
    return promote.register(uri, NAME, source, None, tags)


def gate(uri: str, source: str, n: int, score: float, canary: str | None = None) -> tuple[str, bool]:
    def reference(champ):
        time.sleep(0.5)  # scoring the champion takes a while: both racers read it before either writes
        return ({"exact_match": float(champ.tags["ladle.metric.exact_match"]) if champ else 0.0}, "champion")

    tags = {"ladle.model_sha256": f"{n:x}" * 64, "ladle.metric.exact_match": repr(score)}
    version, decision, _ = gates.gate_and_promote(
        uri,
        NAME,
        source,
        {"exact_match": score},
        reference,
        gates.Rule(metric="exact_match", greater_is_better=True, canary=canary),
        tags=tags,
    )
    return version.version, decision.promoted


def servers() -> dict[str, set[int]]:
    """The live ladle processes serving NAME on this machine: fronts and model servers, by pid (a server's engine
    process, forked from it, shows its command line: it is counted as its server's)."""
    found: dict[str, set[int]] = {"fronts": set(), "servers": set()}
    engines: set[int] = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if f"--name {NAME}" not in line or proc.info["pid"] == os.getpid():
            continue
        if "ladle.fleet.front" in line:
            found["fronts"].add(proc.info["pid"])
        elif "ladle.serve" in line and proc.status() != psutil.STATUS_ZOMBIE:
            found["servers"].add(proc.info["pid"])
            engines.update(child.pid for child in proc.children())
    found["servers"] -= engines
    return found


def tree() -> list:
    return [
        (p.pid, p.ppid(), " ".join(p.cmdline())[:100])
        for p in psutil.process_iter()
        if "ladle" in " ".join(p.cmdline())
    ]


def front_upstream() -> dict:
    front = router.read_record(NAME)
    return champion.current_upstream(front)


# slow: each fault and race is proven alone in make test: a swap during the restart backoff, a canary's verdict
# against a rollback, racing promotions, a new front adopting a dead one's server (tests/fleet/test_control.py), a
# killed server restarted (tests/fleet/test_front_supervision.py), a killed challenger rolled back under traffic
# (tests/fleet/test_canary.py); this adds them all at once, under traffic.
@pytest.mark.slow
def test_rollbacks_promotions_and_kills_at_once_leave_the_champion_serving(tmp_path, tiny_model):
    uri = fresh_registry(tmp_path)
    source = str(tiny_model)
    limits = ServeLimits(max_tokens=16)
    cfg = ServeConfig(front_port=free_port(), max_new_tokens=6, drain_timeout_s=10, limits=limits)
    for n, score in ((1, 0.1), (2, 0.2)):
        promote.promote(uri, NAME, register(uri, source, n, score).version, "seed")
    served = champion.reconcile(uri, NAME, cfg)
    assert served.version == "2"
    windows: list[tuple[float, float]] = []  # (killed, back): requests sent or in flight then may fail
    try:
        with Traffic(served.front_url, NAME, clients=4, pause_s=0.05) as traffic:
            wait_for_requests(traffic, 4)

            # 1. The operator rolls back during v3's canary: the canary is withdrawn, v3 never promoted.
            v3, promoted = gate(uri, source, 3, 0.3, canary="a tenth of the traffic")
            assert not promoted
            result: dict = {}
            runner = threading.Thread(
                target=lambda: result.update(
                    out=champion.reconcile(uri, NAME, cfg, CanaryConfig(weight=0.3, duration_s=120, min_requests=10**6))
                ),
                daemon=True,
            )
            runner.start()
            front = router.read_record(NAME)
            deadline = time.monotonic() + 90
            while not (
                httpx.get(f"{front['url']}/ladle/canary", headers=champion.admin_headers(front)).json()["canary"]
            ):
                assert time.monotonic() < deadline and runner.is_alive(), result
                time.sleep(0.2)
            assert promote.rollback(uri, NAME) == ("2", "1")
            assert champion.end_canary_at_front(NAME, "the operator rolled back") == v3
            runner.join(timeout=90)
            assert result["out"].canary["status"] == "rolled_back"
            assert champion.reconcile(uri, NAME, cfg).version == "1"  # the serving flow, on the rollback's event
            assert promote.get_version(uri, NAME, v3).tags["ladle.promotion"] == "not promoted"

            # 2. The model server dies; while its supervisor backs off and restarts it, two promotions race and
            #    the winner is swapped in.
            upstream = front_upstream()
            killed = time.monotonic()
            os.killpg(upstream["pid"], signal.SIGKILL)
            racers: list = []
            threads = [
                threading.Thread(target=lambda n=n, s=s: racers.append(gate(uri, source, n, s)), daemon=True)
                for n, s in ((4, 0.9), (5, 0.7))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            # Version numbers follow registration order; the winner is the better score, whichever came first.
            best = promote.champion(uri, NAME)
            assert best.tags["ladle.metric.exact_match"] == "0.9", racers
            assert champion.reconcile(uri, NAME, cfg).version == best.version
            windows.append((killed, time.monotonic()))
            wait_for_requests(traffic, 4)

            # 3. The front dies and a new one adopts the server it served.
            front = router.read_record(NAME)
            killed = time.monotonic()
            os.killpg(front["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while records.alive(front, marker="ladle.fleet.front"):  # SIGKILL is delivered, not awaited
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with contextlib.suppress(ChildProcessError):  # this test's process started it: reap it
                os.waitpid(front["pid"], 0)
            again = champion.reconcile(uri, NAME, cfg)
            assert again.action == "unchanged" and again.version == best.version
            windows.append((killed, time.monotonic()))
            wait_for_requests(traffic, 8)

        assert promote.champion(uri, NAME).version == front_upstream()["version"] == best.version
        # After the rollback to v1, each promotion beat the champion it replaced; the 0.9 one ends it.
        history = promote.history(uri, NAME)
        score = {v.version: float(v.tags["ladle.metric.exact_match"]) for v in promote.versions(uri, NAME)}
        assert history[0] == "1" and history[-1] == best.version, history
        assert [score[v] for v in history] == sorted(score[v] for v in history), history
        failed = [r for r in traffic.failures() if not any(r[3] <= back and r[0] >= start for start, back in windows)]
        assert failed == [], failed[:5]
        assert {r[1] for r in traffic.results if r[0] > windows[-1][1]} == {best.version}
        live = servers()
        assert live["fronts"] == {router.read_record(NAME)["pid"]}
        assert live["servers"] == {front_upstream()["pid"]}, (live, front_upstream(), tree())
        assert records.alive(front_upstream())
    finally:
        if router.read_record(NAME):
            champion.stop(NAME, grace_s=20)
    left = servers()
    assert left == {"fronts": set(), "servers": set()}, left
