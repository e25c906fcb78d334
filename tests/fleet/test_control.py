"""Every control action is compare-and-set against what is served now: a restart planned before a swap is
dropped, a canary measured against a champion the front no longer serves never passes, a canary verdict loses to
a rollback made meanwhile, promotions racing from separate processes are serialised by the registry's lock
(the champion is the best of them and the history loses no entry), a rollback withdraws a waiting canary, and the
front a dead one left behind is adopted, never doubled."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ladle.fleet import canary as canaries
from ladle.fleet import front as router
from ladle.fleet.deploy import wait_healthy
from ladle.lifecycle import gate, promote
from ladle.lifecycle import lock as registry_lock
from ladle.platform.processes import free_port, stop_pid
from ladle.serve import pool
from tests.fleet.test_front_supervision import wait_for
from tests.helpers import fresh_registry
from tests.serve.running import Running

ADMIN = {router.ADMIN_HEADER: "t"}


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    return fresh_registry(tmp_path_factory.mktemp("registry"))


def sleeper(marker: Path | None = None) -> list[str]:
    """An argv that stands for a server: it writes ``marker`` when it starts (so a restart shows), then sleeps."""
    code = f"open({str(marker)!r}, 'a').write('started\\n'); " if marker else ""
    return [sys.executable, "-c", code + "import time; time.sleep(120)"]


def test_a_swap_during_the_restart_backoff_wins(tmp_path):
    marker = tmp_path / "restarted"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    upstream = {"url": "http://127.0.0.1:9", "version": "1", "pid": dead.pid, "model_dir": "x", "argv": sleeper(marker)}
    slow = {"check_s": 0.1, "backoff_s": 2.0, "backoff_max_s": 2.0, "max_restarts": 5, "window_s": 60.0}
    app = router.create_app("m", "t", {"upstream": upstream}, None, supervision=slow)
    front = Running(app)
    rolled_back = subprocess.Popen(sleeper())
    try:
        wait_for(lambda: len(app.state.supervisor.restarts) == 1, 30, "the dead server was never noticed")
        # The supervisor now sleeps its backoff; an operator's rollback swaps another server in meanwhile.
        new = {"url": "http://127.0.0.1:10", "version": "0", "pid": rolled_back.pid, "model_dir": "y"}
        assert httpx.put(f"{front.url}/ladle/upstream", json=new, headers=ADMIN).status_code == 200
        time.sleep(2.5)
        current = httpx.get(f"{front.url}/ladle/upstream", headers=ADMIN).json()["upstream"]
        assert current["version"] == "0" and current["pid"] == rolled_back.pid
        assert not marker.exists(), "the old version was restarted over the rollback"
        assert "ladle_front_restarts_total 0.0" in httpx.get(f"{front.url}/ladle/metrics").text
    finally:
        front.stop()
        rolled_back.kill()


def test_a_swap_ends_a_running_canary_and_a_stale_swap_is_refused():
    champion, challenger, third = (subprocess.Popen(sleeper()) for _ in range(3))
    upstream = {"url": "http://127.0.0.1:11", "version": "1", "pid": champion.pid, "model_dir": "x"}
    front = Running(router.create_app("m", "t", {"upstream": upstream}, None))
    try:
        body = {"url": "http://127.0.0.1:12", "version": "2", "pid": challenger.pid, "model_dir": "y"}
        started = httpx.put(f"{front.url}/ladle/canary", json={**body, "limits": {"duration_s": 600}}, headers=ADMIN)
        assert started.json()["canary"]["status"] == "running"
        stale = {"url": "http://127.0.0.1:13", "version": "3", "pid": third.pid, "model_dir": "z"}
        refused = httpx.put(
            f"{front.url}/ladle/upstream", json={**stale, "expect_url": "http://127.0.0.1:99"}, headers=ADMIN
        )
        assert refused.status_code == 409 and "another swap came first" in refused.json()["error"]["message"]
        swapped = httpx.put(f"{front.url}/ladle/upstream", json={**stale, "expect_url": upstream["url"]}, headers=ADMIN)
        assert swapped.status_code == 200
        state = httpx.get(f"{front.url}/ladle/canary", headers=ADMIN).json()["canary"]
        assert state["status"] == "rolled_back" and state["reason"].startswith("superseded: the front was switched")
    finally:
        front.stop()
        for proc in (champion, challenger, third):
            proc.kill()


def register(uri: str, name: str, n: int, score: float) -> promote.Version:
    return promote.register(uri, name, f"/models/{name}/{n}", None, {"ladle.metric.exact_match": repr(score)})


def test_a_canary_verdict_loses_to_a_rollback_made_meanwhile(uri):
    name = "cas"
    for n, score in ((1, 0.1), (2, 0.2)):
        v = register(uri, name, n, score)
        promote.promote(uri, name, v.version, "test")
    v3 = register(uri, name, 3, 0.3)
    promote.mark_canary(uri, name, v3.version)
    before, after = promote.rollback(uri, name)  # the operator rolls back during v3's canary
    assert (before, after) == ("2", "1")
    assert promote.get_version(uri, name, v3.version).tags["ladle.promotion"] == "not promoted"
    state = {
        "version": v3.version,
        "champion_version": "2",
        "status": "passed",
        "reason": "error rate 0.0% vs 0.0%",
        "champion": {},
        "challenger": {},
    }
    assert canaries.apply(uri, name, state) is False
    assert promote.champion(uri, name).version == "1"
    tags = promote.get_version(uri, name, v3.version).tags
    assert (
        tags["ladle.promotion"] == "not promoted" and "superseded: champion is v1 now" in tags["ladle.promotion.reason"]
    )
    assert promote.history(uri, name) == ["1"]


def test_a_rolled_back_canary_keeps_a_newer_challenger(uri):
    name = "newer"
    promote.promote(uri, name, register(uri, name, 1, 0.1).version, "test")
    v2 = register(uri, name, 2, 0.2)
    v3 = register(uri, name, 3, 0.3)  # the newest registration holds `challenger` now
    state = {"version": v2.version, "champion_version": "1", "status": "rolled_back", "reason": "slow"}
    canaries.apply(uri, name, {**state, "champion": {}, "challenger": {}})
    assert str(promote.client(uri).get_model_version_by_alias(name, promote.CHALLENGER).version) == v3.version


def race(uri: str, name: str, n: int, score: float, start: float) -> str:
    """One promotion in its own process: all start at ``start``; comparing with the champion takes a second
    (as scoring it would), so every racer reads the champion before any writes."""
    time.sleep(max(0.0, start - time.time()))

    def reference(champ):
        time.sleep(1.0)
        return ({"exact_match": float(champ.tags["ladle.metric.exact_match"]) if champ else 0.0}, "champion")

    version, decision, _ = gate.gate_and_promote(
        uri,
        name,
        f"/models/{name}/{n}",
        {"exact_match": score},
        reference,
        gate.Rule(metric="exact_match", greater_is_better=True),
        tags={"ladle.metric.exact_match": repr(score)},
    )
    return f"{version.version}:{decision.promoted}"


def test_racing_promotions_are_serialised_by_the_registry_lock(uri):
    name = "race"
    scores = [0.4, 0.8, 0.6, 0.2]
    promote.client(uri).search_registered_models()  # the store's tables exist before four processes open it
    start = time.time() + 8  # the processes import MLflow first
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(race, [(uri, name, n, s, start) for n, s in enumerate(scores)], chunksize=1)
    by_source = {v.source: v for v in promote.versions(uri, name)}
    best = by_source[f"/models/{name}/{scores.index(max(scores))}"]
    assert promote.champion(uri, name).version == best.version, results
    promoted = [r.split(":")[0] for r in results if r.endswith(":True")]
    assert sorted(promote.history(uri, name)) == sorted(promoted), (results, promote.history(uri, name))
    # Every promotion beat the champion it replaced: the history's scores rise.
    score = {v.version: float(v.tags["ladle.metric.exact_match"]) for v in by_source.values()}
    trail = [score[v] for v in promote.history(uri, name)]
    assert trail == sorted(trail)
    names = [m.name for m in promote.client(uri).search_registered_models()]
    assert registry_lock.lock_name(name) not in names  # released


def test_a_dead_holders_lock_is_taken_over(uri, monkeypatch):
    name = "stale"
    mlflow = promote.client(uri)
    expired = {"ladle.lock.owner": "gone:1:x", "ladle.lock.doing": "crashed", "ladle.lock.expires": "0"}
    mlflow.create_registered_model(registry_lock.lock_name(name), tags=expired)
    with registry_lock.champion_lock(uri, name, "a test", wait_s=10):
        held = mlflow.get_registered_model(registry_lock.lock_name(name)).tags
        assert held["ladle.lock.doing"] == "a test"
    live = {**expired, "ladle.lock.expires": str(time.time() + 600)}
    mlflow.create_registered_model(registry_lock.lock_name(name), tags=live)
    busy = pytest.raises(Exception, match=r"stale: another writer of its champion \(gone:1:x, crashed\)")
    with busy, registry_lock.champion_lock(uri, name, "a test", wait_s=0.5):
        pass


def test_a_live_holder_outlasting_the_locks_life_keeps_it_and_a_silent_one_loses_it(uri, monkeypatch):
    """A holder slowed by its registry past the lock's life renews it, so a second writer never takes a live
    lock; a holder whose heartbeat stopped loses it after the life on the waiter's own clock, even when its tags
    say it expires far ahead (another machine's clock)."""
    import threading

    monkeypatch.setattr(registry_lock, "LOCK_TTL_S", 2.0)  # twenty renewals a life: a busy machine's stalls fit
    monkeypatch.setattr(registry_lock, "RENEW_S", 0.1, raising=False)
    name, inside, order = "slow", threading.Event(), []

    def slow_writer():
        with registry_lock.champion_lock(uri, name, "a slow write", wait_s=5):
            inside.set()
            time.sleep(3.3)  # past the second writer's wait, and longer than a lock's life: retried registry calls
            order.append("slow done")

    writer = threading.Thread(target=slow_writer)
    writer.start()
    assert inside.wait(30)
    refused = pytest.raises(Exception, match=r"slow: another writer of its champion .*a slow write")
    with refused, registry_lock.champion_lock(uri, name, "a second write", wait_s=3.0):
        order.append("second inside")
    writer.join(30)
    assert order == ["slow done"]
    # a dead holder whose clock ran ahead: its expiry is ten minutes away, its heartbeat never moves
    mlflow = promote.client(uri)
    ahead = {"ladle.lock.owner": "ahead:1:x", "ladle.lock.doing": "died", "ladle.lock.expires": str(time.time() + 600)}
    mlflow.create_registered_model(registry_lock.lock_name(name), tags=ahead)
    began = time.monotonic()
    with registry_lock.champion_lock(uri, name, "after the dead one", wait_s=10):
        waited = time.monotonic() - began
    assert 2.0 <= waited < 10


def test_a_lock_released_while_the_store_refuses_the_create_is_taken_next(uri, monkeypatch):
    """MLflow's SQL store answers a refused create by reading the existing model: released in between, the
    create raises "not found". That is a lock just freed, not a failed registry: the writer tries again."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST
    from mlflow.tracking import MlflowClient

    real, calls = MlflowClient.create_registered_model, []

    def released_in_between(self, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 1:
            raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_registered_model", released_in_between)
    with registry_lock.champion_lock(uri, "freed", "a test", wait_s=10):
        held = promote.client(uri).get_registered_model(registry_lock.lock_name("freed")).tags
        assert held["ladle.lock.doing"] == "a test"
    assert calls == [registry_lock.lock_name("freed")] * 2


def front_process(name: str, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ladle.fleet.front", "--name", name, "--port", str(port)]
    return subprocess.Popen(argv, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True)


def test_a_new_front_adopts_a_dead_ones_server_and_a_second_front_is_refused(tiny_model, tmp_path):
    port, server_port = free_port(), free_port()
    argv = [sys.executable, "-m", "ladle.serve", "--model", str(tiny_model), "--name", "m", "--port", str(server_port)]
    log = tmp_path / "server.log"
    server = pool.launch(argv, log)  # forked from the suite's warm pool, as the deploy stage starts one
    url = f"http://127.0.0.1:{server_port}"
    front_log = tmp_path / "front.log"
    first = front_process("adopt", port, front_log)
    fronts = [first]
    try:
        wait_healthy(server, url, 120, log)
        wait_for(lambda: router.read_record("adopt") is not None, 60, "the front never wrote its record")
        record = router.read_record("adopt")
        headers = {router.ADMIN_HEADER: record["token"]}
        wait_for(lambda: httpx.get(f"{record['url']}/health").status_code == 200, 60, "the front never answered")
        body = {"url": url, "version": "5", "pid": server.pid, "model_dir": str(tiny_model), "argv": argv}
        assert httpx.put(f"{record['url']}/ladle/upstream", json=body, headers=headers).status_code == 200

        # A second front of the same name, on another port: refused at once, the live one untouched.
        second = subprocess.run(
            [sys.executable, "-m", "ladle.fleet.front", "--name", "adopt", "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0 and "a front for it already runs" in second.stderr
        assert router.read_record("adopt")["pid"] == first.pid
        # Another name on the live port: fails to bind, and writes no record.
        taken = subprocess.run(
            [sys.executable, "-m", "ladle.fleet.front", "--name", "other", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert taken.returncode != 0 and "cannot listen" in taken.stderr
        assert router.read_record("other") is None and not router.record_path("other").exists()

        os.killpg(first.pid, signal.SIGKILL)  # the front dies; its server does not
        first.wait(timeout=10)
        again = front_process("adopt", port, front_log)
        fronts.append(again)
        wait_for(lambda: (router.read_record("adopt") or {}).get("pid") == again.pid, 60, "no new front")
        record = router.read_record("adopt")
        wait_for(lambda: httpx.get(f"{record['url']}/health").status_code == 200, 60, "the new front never answered")
        adopted = httpx.get(f"{record['url']}/ladle/upstream", headers={router.ADMIN_HEADER: record["token"]}).json()
        assert adopted["upstream"]["pid"] == server.pid and adopted["upstream"]["version"] == "5"
        ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        answer = httpx.post(f"{record['url']}/v1/chat/completions", json=ask, timeout=60)
        assert answer.status_code == 200 and answer.headers[router.VERSION_HEADER] == "5"
        assert json.loads(router.record_path("adopt").read_text())["upstream"]["pid"] == server.pid
    finally:
        for proc in fronts:
            stop_pid(proc.pid, 10, group=True)
        stop_pid(server.pid, 10, group=True)
