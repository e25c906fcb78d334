"""The canary (``promote.canary``): the front splits live traffic, judges the challenger against the champion by
itself, and the registry follows its verdict.

* the verdict rules on recorded counts (no processes);
* the front with upstreams that misbehave on purpose (a share of HTTP 500s, slow answers): rolled back by itself,
  all traffic back on the champion; a healthy one passes and takes all traffic;
* end to end with real servers of the demo's tiny model and an MLflow registry: a canary passes under traffic and
  becomes champion (the old server stopped), then a challenger killed with SIGKILL mid-canary is rolled back
  by the front, its alias removed, with no client failing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import signal
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ladle.config import CanaryConfig, ServeConfig, build_config
from ladle.errors import LadleError
from ladle.fleet import champion, front_canary
from ladle.fleet import front as router
from ladle.fleet.canary import Canary, pending
from ladle.lifecycle import gate as gates
from ladle.lifecycle import promote
from ladle.platform.processes import exited, free_port
from ladle.serve import records
from tests.helpers import Traffic, fresh_registry, wait_for_requests
from tests.serve.running import Running

TOKEN = "t"
ADMIN = {router.ADMIN_HEADER: TOKEN}


# -- the verdict --------------------------------------------------------------------------------------------


def fed(limits: CanaryConfig, champion_arm: tuple[int, int, float], challenger_arm: tuple[int, int, float]) -> Canary:
    """A canary with ``(requests, errors, latency s)`` recorded per arm."""
    canary = Canary({"url": "u2", "version": "2", "pid": None}, {"url": "u1", "version": "1"}, limits)
    for arm, (n, errors, seconds) in (("champion", champion_arm), ("challenger", challenger_arm)):
        for i in range(n):
            canary.record(arm, i >= errors, seconds)
    return canary


def test_the_verdict_follows_the_limits():
    limits = CanaryConfig(weight=0.2, duration_s=60, min_requests=20, max_error_rate_increase=0.05)
    # Too few challenger requests: no verdict before the end, whatever they say.
    assert fed(limits, (100, 0, 0.1), (19, 19, 0.1)).judge() is None
    # 4/20 failed (20 %) vs the champion's 1 %: more than 5 points above: rolled back at once.
    bad = fed(limits, (100, 1, 0.1), (20, 4, 0.1))
    assert bad.judge() == "rolled_back"
    assert bad.reason.startswith("error rate 20.0% vs the champion's 1.0% (may exceed it by 5.0%)")
    assert bad.pick() is False  # no more traffic to it
    bad.record("challenger", True, 0.1)
    assert bad.arms["challenger"].requests == 20  # the verdict is in: nothing more is counted
    # 1/20 (5 %) vs 1 %: within 5 points; still running until the duration has passed.
    assert fed(limits, (100, 1, 0.1), (20, 1, 0.1)).judge() is None
    # Twice as slow at p95 (limit 1.5x): rolled back; twice as slow by milliseconds (within the slack): not.
    slow = fed(limits, (100, 0, 0.1), (20, 0, 0.2))
    assert slow.judge() == "rolled_back" and "(2.00x; limit 1.5x, beyond the 0.05 s slack)" in slow.reason
    assert fed(limits, (100, 0, 0.004), (20, 0, 0.008)).judge() is None
    # A dead challenger: rolled back whatever the counts.
    dead = fed(limits, (100, 0, 0.1), (20, 0, 0.1))
    assert dead.judge(challenger_alive=False) == "rolled_back" and "exited during the canary" in dead.reason

    ended = CanaryConfig(duration_s=0.01, min_requests=20)
    good, quiet = fed(ended, (100, 1, 0.1), (20, 0, 0.11)), fed(ended, (100, 0, 0.1), (3, 0, 0.1))
    time.sleep(0.02)
    assert good.judge() == "passed" and "p95 latency 1.10x the champion's (limit 1.5x)" in good.reason
    assert quiet.judge() == "rolled_back" and quiet.reason.startswith("not enough evidence: 3 challenger requests")


def test_an_arms_latencies_stay_bounded_and_its_p95_follows_the_whole():
    """A canary at 1k requests/s for 10 minutes records 0.6 M latencies an arm: the arm keeps a bounded uniform
    sample, whose p95 is the whole's within a percentile point, and judging does not sort it again unless an
    answer came."""
    from ladle.fleet import canary as canaries

    arm = canaries.Arm()
    rng = random.Random(1)
    seen = [rng.expovariate(10.0) for _ in range(200_000)]
    for seconds in seen:
        arm.add(seconds)
    assert len(arm.latencies) == canaries.LATENCY_SAMPLE and arm.answered == len(seen)
    ordered = sorted(seen)
    lo, hi = ordered[int(0.94 * len(seen))], ordered[int(0.96 * len(seen))]
    assert lo <= arm.p95() <= hi
    # late answers still reach the sample: a challenger that slows down halfway shows it
    for _ in range(200_000):
        arm.add(5.0)
    assert arm.p95() == 5.0
    # a cached p95 between answers
    first = arm.p95()
    arm.latencies[:] = [0.0] * len(arm.latencies)  # not re-sorted: nothing new came
    assert arm.p95() == first


def test_the_share_of_traffic_is_the_weight():
    canary = Canary({"version": "2"}, {"version": "1"}, CanaryConfig(weight=0.25), random.Random(0))
    picked = sum(canary.pick() for _ in range(4000))
    assert 900 < picked < 1100


def test_bad_canary_settings_name_the_field():
    minimal = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}
    with pytest.raises(LadleError, match="promote.canary.weight") as bad:
        build_config({**minimal, "promote": {"canary": {"weight": 1.5}}}, [])
    assert "1.5" in str(bad.value)
    with pytest.raises(LadleError, match="promote.canary is set but promote.enabled = false"):
        build_config({**minimal, "promote": {"enabled": False, "canary": {}}}, [])
    cfg = build_config(minimal, ["promote.canary.duration_s=30"])
    assert cfg.promote.canary == CanaryConfig(duration_s=30)


# -- the front, with upstreams that misbehave on purpose -----------------------------------------------------


def upstream_app(version: str, fail_every: int = 0, delay_s: float = 0.0) -> FastAPI:
    app = FastAPI()
    count = itertools.count(1)

    @app.get("/ready")
    def ready():
        return {"status": "ready"}

    @app.post("/v1/chat/completions")
    async def chat():
        await asyncio.sleep(delay_s)
        if fail_every and next(count) % fail_every == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
        return {"choices": [{"message": {"content": version}, "finish_reason": "stop"}], "version": version}

    return app


def send(url: str, n: int) -> list[tuple[int, str]]:
    """``n`` requests through the front: (status, the version header)."""
    with httpx.Client(timeout=30) as client:
        out = []
        for _ in range(n):
            answer = client.post(f"{url}/v1/chat/completions", json={"messages": []})
            out.append((answer.status_code, answer.headers.get(router.VERSION_HEADER, "")))
        return out


def front_with(challenger_app: FastAPI, limits: dict):
    old, new = Running(upstream_app("1")), Running(challenger_app)
    front = Running(router.create_app("m", TOKEN, {"upstream": {"url": old.url, "version": "1", "pid": None}}, None))
    body = {"url": new.url, "version": "2", "pid": None, "model_dir": "-", "limits": limits}
    started = httpx.put(f"{front.url}/ladle/canary", json=body, headers=ADMIN)
    assert started.status_code == 200, started.text
    return front, [front, old, new]


def verdict(front_url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(f"{front_url}/ladle/canary", headers=ADMIN).json()["canary"]
        if state["status"] != "running":
            return state
        assert time.monotonic() < deadline, state
        send(front_url, 5)


def test_a_challenger_that_fails_a_share_of_requests_is_rolled_back_by_the_front():
    front, running = front_with(upstream_app("2", fail_every=3), {"weight": 0.5, "duration_s": 120, "min_requests": 10})
    try:
        state = verdict(front.url)
        # Every third answer was a 500: about 33 % (counted from the first judged look on, so near it).
        assert state["status"] == "rolled_back", state
        assert re.match(r"error rate (2\d|3\d|40)\.\d% vs the champion's 0\.0%", state["reason"]), state["reason"]
        assert state["arms"]["champion"]["errors"] == 0 and state["arms"]["challenger"]["requests"] >= 10
        assert set(send(front.url, 30)) == {(200, "1")}  # every request on the champion again
        assert (
            'ladle_front_canary_requests_total{arm="challenger",outcome="error"}'
            in httpx.get(f"{front.url}/ladle/metrics").text
        )
        # Another canary waits until this one's verdict was applied and cleared.
        again = {"url": "x", "version": "3", "pid": None, "model_dir": "-"}
        assert httpx.put(f"{front.url}/ladle/canary", json=again, headers=ADMIN).status_code == 409
        assert httpx.delete(f"{front.url}/ladle/canary", headers=ADMIN).json()["canary"]["version"] == "2"
        assert httpx.get(f"{front.url}/ladle/canary", headers=ADMIN).json()["canary"] is None
    finally:
        for server in running:
            server.stop()


def test_a_slow_challenger_is_rolled_back_and_a_healthy_one_takes_all_traffic():
    front, running = front_with(upstream_app("2", delay_s=0.3), {"weight": 0.5, "duration_s": 120, "min_requests": 6})
    try:
        state = verdict(front.url)
        assert state["status"] == "rolled_back" and "p95 latency" in state["reason"], state
    finally:
        for server in running:
            server.stop()

    front, running = front_with(upstream_app("2"), {"weight": 0.5, "duration_s": 1.5, "min_requests": 5})
    try:
        assert {version for _, version in send(front.url, 40)} == {"1", "2"}  # both arms took traffic
        state = verdict(front.url)
        assert state["status"] == "passed", state
        assert set(send(front.url, 20)) == {(200, "2")}
        upstream = httpx.get(f"{front.url}/ladle/upstream", headers=ADMIN).json()["upstream"]
        assert upstream["version"] == "2"
        for method, path in [(m, "/ladle/canary") for m in ("GET", "PUT", "PATCH", "DELETE")] + [
            ("GET", "/ladle/upstream"),
            ("PUT", "/ladle/upstream"),
        ]:  # every admin route, with a wrong token: refused before its body is read, in OpenAI's envelope
            refused = httpx.request(method, f"{front.url}{path}", json={}, headers={"x-ladle-admin-token": "no"})
            assert refused.status_code == 403, (method, path, refused.text)
            assert refused.json()["error"]["type"] == "permission_error", (method, path)
        assert httpx.get(f"{front.url}/ladle/canary", headers=ADMIN).json()["canary"]["status"] == "passed"
    finally:
        for server in running:
            server.stop()


def adapter_upstream(failing_version: str) -> FastAPI:
    """A base's server stand-in: answers with the model asked and the version the front pinned (every second
    answer of ``failing_version`` a 500), and keeps every body it got."""
    app = FastAPI()
    app.state.bodies = []
    count = itertools.count(1)

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await request.body()
        app.state.bodies.append(body)
        pinned = request.headers.get(router.PINNED_HEADER)
        if pinned == failing_version and next(count) % 2 == 0:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
        model = json.loads(body)["model"] if body.startswith(b"{") else None
        return {"model": model, "pinned": pinned}

    return app


def test_an_adapter_canary_splits_only_its_adapter_and_a_restarted_front_adopts_it(tmp_path, monkeypatch):
    """On a base's front: the canary of ``bot`` v3 pins a share of the bare-name requests for ``bot`` to v3 and the
    rest to v2, and counts only those; ``red``, ``bot@v2`` and a body that is not JSON pass untouched, and a
    client's own pin header is dropped. An operator's end, or a challenger failing half its answers (rolled back by
    the front itself), leaves ``bot`` unpinned. A front started from the run record of one that died goes on with a
    running adapter canary."""
    base = Running(adapter_upstream("5"))
    record_file = tmp_path / "front.json"
    upstream = {"url": base.url, "version": "base", "pid": None}
    front = Running(router.create_app("base-x", TOKEN, {"upstream": upstream}, record_file))
    running = [front, base]
    try:
        body = {"adapter": "bot", "version": "3", "champion_version": "2"}
        no_verdict = {"weight": 0.5, "duration_s": 120, "min_requests": 100_000}
        started = httpx.put(f"{front.url}/ladle/canary", json={**body, "limits": no_verdict}, headers=ADMIN)
        assert started.status_code == 200 and started.json()["canary"]["adapter"] == "bot", started.text
        assert httpx.put(f"{front.url}/ladle/canary", json={**body, "version": "4"}, headers=ADMIN).status_code == 409
        with httpx.Client(timeout=30) as client:

            def ask(model: str) -> tuple[int, str | None]:
                answer = client.post(f"{front.url}/v1/completions", json={"model": model, "prompt": "x"})
                return answer.status_code, answer.json().get("pinned") if answer.status_code == 200 else None

            assert {ask("bot") for _ in range(30)} == {(200, "2"), (200, "3")}
            assert ask("red") == (200, None) and ask("bot@v2") == (200, None)
            raw = client.post(f"{front.url}/v1/completions", content=b"not json", headers={router.PINNED_HEADER: "9"})
            assert raw.status_code == 200 and raw.json()["pinned"] is None  # a client's pin header is dropped
            assert base.server.config.app.state.bodies[-1] == b"not json"  # passed byte for byte
            arms = httpx.get(f"{front.url}/ladle/canary", params={"adapter": "bot"}, headers=ADMIN).json()["canary"]
            assert arms["arms"]["champion"]["requests"] + arms["arms"]["challenger"]["requests"] == 30  # bot's only
            ended = httpx.patch(f"{front.url}/ladle/canary", params={"adapter": "bot", "reason": "stop"}, headers=ADMIN)
            assert ended.json()["canary"]["status"] == "rolled_back"
            assert {ask("bot") for _ in range(10)} == {(200, None)}  # rolled back: the server's own version
            assert (
                httpx.delete(f"{front.url}/ladle/canary", params={"adapter": "bot"}, headers=ADMIN).status_code == 200
            )

            failing = {**body, "version": "5", "limits": {"weight": 0.5, "duration_s": 120, "min_requests": 8}}
            assert httpx.put(f"{front.url}/ladle/canary", json=failing, headers=ADMIN).status_code == 200
            deadline = time.monotonic() + 30
            while (state := httpx.get(f"{front.url}/ladle/canary", params={"adapter": "bot"}, headers=ADMIN).json())[
                "canary"
            ]["status"] == "running":
                assert time.monotonic() < deadline, state
                ask("bot")
            state = state["canary"]
            assert state["status"] == "rolled_back" and state["reason"].startswith("error rate"), state
            assert state["arms"]["champion"]["errors"] == 0 and state["arms"]["challenger"]["errors"] >= 1
            assert {ask("bot") for _ in range(10)} == {(200, None)}
            assert (
                httpx.delete(f"{front.url}/ladle/canary", params={"adapter": "bot"}, headers=ADMIN).status_code == 200
            )

            running_again = {"adapter": "ops", "version": "7", "champion_version": "6", "limits": {"duration_s": 120}}
            assert httpx.put(f"{front.url}/ladle/canary", json=running_again, headers=ADMIN).status_code == 200
            monkeypatch.setattr(front_canary, "MAX_ADAPTER_CANARIES", 1)  # a front's adapter canaries are bounded
            another = {**running_again, "adapter": "billing"}
            refused = httpx.put(f"{front.url}/ladle/canary", json=another, headers=ADMIN)
            assert refused.status_code == 409 and "MAX_ADAPTER_CANARIES" in refused.text
        front.stop()  # the front dies; its record says what it served and which canary ran
        saved = json.loads(record_file.read_text())
        assert list(saved["adapter_canaries"]) == ["ops"]
        again = Running(router.create_app("base-x", TOKEN, saved, record_file))
        running.append(again)
        state = httpx.get(f"{again.url}/ladle/canary", params={"adapter": "ops"}, headers=ADMIN).json()["canary"]
        assert (state["status"], state["version"], state["champion_version"]) == ("running", "7", "6")
        assert httpx.get(f"{again.url}/ladle/canary", headers=ADMIN).json()["adapters"] == ["ops"]
    finally:
        for server in running:
            server.stop()


# -- end to end: real servers, a real registry ---------------------------------------------------------------

NAME = "canary-demo"


def gate(uri: str, source: str, sha: str) -> promote.Version:
    version, decision, _ = gates.gate_and_promote(
        uri, NAME, source, {"loss": 1.0}, lambda _: ({"loss": 2.0}, "x"),
        gates.Rule(metric="loss", greater_is_better=False, canary="it takes half the traffic"),
        tags={"ladle.model_sha256": sha},
    )  # fmt: skip
    assert decision.canary and not decision.promoted and decision.reason.startswith("canary next: passed the gate")
    return version


def test_a_canary_passes_under_traffic_and_a_killed_challenger_is_rolled_back(tmp_path, tiny_model):
    uri = fresh_registry(tmp_path)
    cfg = ServeConfig(front_port=free_port(), max_new_tokens=6, drain_timeout_s=20)
    v1 = promote.register(uri, NAME, str(tiny_model), None, {"ladle.model_sha256": "one"})
    promote.promote(uri, NAME, v1.version, "first")
    served = champion.reconcile(uri, NAME, cfg)
    try:
        v2 = gate(uri, str(tiny_model), "two")
        assert promote.champion(uri, NAME).version == "1" and pending(uri, NAME, "1").version == v2.version
        # Both servers share this machine's cores, so their latencies move with each other's load: the latency
        # limit is loose here (the slow challenger's rollback is proven above, against a steady champion).
        limits = CanaryConfig(weight=0.5, duration_s=4, min_requests=4, max_latency_ratio=20)
        with Traffic(served.front_url, NAME, clients=4) as traffic:
            wait_for_requests(traffic, 4)
            passed = champion.reconcile(uri, NAME, cfg, limits)
            wait_for_requests(traffic, 4)
        assert traffic.failures() == [], traffic.failures()[:5]
        assert {r[1] for r in traffic.results} == {"1", "2"}
        assert passed.canary["status"] == "passed" and passed.version == "2", passed.canary
        assert promote.champion(uri, NAME).version == "2" and promote.history(uri, NAME) == ["1", "2"]
        assert pending(uri, NAME, "2") is None
        assert exited(served.server_pid)  # the old champion's server was drained and stopped
        assert champion.reconcile(uri, NAME, cfg, limits).action == "unchanged"  # nothing waits: nothing runs

        v3 = gate(uri, str(tiny_model), "three")
        front = router.read_record(NAME)
        only_death = CanaryConfig(duration_s=120, min_requests=100_000)  # no verdict from counts: from the kill
        result: dict = {}
        runner = threading.Thread(
            target=lambda: result.update(out=champion.reconcile(uri, NAME, cfg, only_death)),
            daemon=True,
        )
        with Traffic(served.front_url, NAME, clients=4) as traffic:
            runner.start()
            deadline = time.monotonic() + 120
            while (state := httpx.get(f"{front['url']}/ladle/canary", headers=champion.admin_headers(front))).json()[
                "canary"
            ] is None:
                assert time.monotonic() < deadline and runner.is_alive(), result
                time.sleep(0.2)
            killed = state.json()["canary"]["challenger"]["pid"]
            wait_for_requests(traffic, 8)
            t_kill = time.monotonic()
            os.killpg(killed, signal.SIGKILL)
            runner.join(timeout=60)
            wait_for_requests(traffic, 8)
        assert not runner.is_alive()
        rolled = result["out"]
        assert rolled.canary["status"] == "rolled_back" and "exited during the canary" in rolled.canary["reason"]
        assert rolled.version == "2" and promote.champion(uri, NAME).version == "2"
        tags = promote.get_version(uri, NAME, v3.version).tags
        assert tags["ladle.promotion"] == "not promoted" and "canary rolled back" in tags["ladle.promotion.reason"]
        assert (
            pending(uri, NAME, "2") is None
            and promote.CHALLENGER not in promote.get_version(uri, NAME, v3.version).aliases
        )
        # A request refused by the dead challenger went on to the champion; only one in flight on it when it was
        # killed (at most one per client) can fail.
        failed = traffic.failures()
        assert len(failed) <= 4 and all(sent < t_kill for *_, sent in failed), failed
        upstream = champion.current_upstream(front)
        assert upstream["version"] == "2" and records.alive(upstream)
    finally:
        if router.read_record(NAME):
            champion.stop(NAME, grace_s=20)
