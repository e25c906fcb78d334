"""The front heals the server behind it: a killed server is started again within seconds on the same address
and answers, counted and logged; one that keeps dying is given up and the front answers 503 with the reason.
Real processes: ``python -m ladle.serve`` on the demo's tiny model, its engine process killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from ladle.fleet import front as router
from ladle.fleet.deploy import wait_healthy
from ladle.platform.processes import free_port, stop_pid
from ladle.serve import pool
from tests.serve.running import Running

FAST = {"check_s": 0.2, "backoff_s": 0.1, "backoff_max_s": 0.5, "max_restarts": 3, "window_s": 60.0}


def wait_for(predicate, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_killed_server_is_restarted_and_answers_again(tiny_model, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "ladle.serve", "--model", str(tiny_model), "--name", "m", "--port", str(port)]
    log = tmp_path / "server.log"
    server = pool.launch(argv, log)  # forked from the suite's warm pool, as the deploy stage starts one
    url = f"http://127.0.0.1:{port}"
    wait_healthy(server, url, 120, log)
    upstream = {
        "url": url,
        "version": "4",
        "pid": server.pid,
        "model_dir": str(tiny_model),
        "argv": argv,
        "log": str(log),
    }
    front = Running(router.create_app("m", "t", {"upstream": upstream}, None, supervision=FAST))
    ask = {"messages": [{"role": "user", "content": "Add 2 and 3."}], "max_tokens": 4, "temperature": 0}
    try:
        before = httpx.post(f"{front.url}/v1/chat/completions", json=ask, timeout=60).json()
        # Its engine process dies: the server fails what it had in flight, exits 1, and the front starts it again.
        (engine,) = psutil.Process(server.pid).children()
        os.kill(engine.pid, signal.SIGKILL)
        try:
            assert server.wait(timeout=30) == 1
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server outlived its engine; its log:\n{log.read_text()[-4000:]}") from None
        wait_for(
            lambda: httpx.get(f"{front.url}/ladle/metrics").text.count("ladle_front_restarts_total 1.0"),
            30,
            "no restart",
        )
        wait_for(lambda: ready(front.url), 120, "the restarted server never became ready")
        after = httpx.post(f"{front.url}/v1/chat/completions", json=ask, timeout=60)
        assert after.status_code == 200 and after.json()["choices"] == before["choices"]
        assert after.headers[router.VERSION_HEADER] == "4"
    finally:
        current = httpx.get(f"{front.url}/ladle/upstream", headers={router.ADMIN_HEADER: "t"}).json()["upstream"]
        front.stop()
        assert current["pid"] != server.pid  # the front's own restarted server
        stop_pid(current["pid"], 10, group=True)


def test_a_server_that_keeps_dying_is_given_up_with_a_503(tmp_path):
    port = free_port()
    argv = [sys.executable, "-c", "import sys; sys.exit(3)"]
    dead = subprocess.Popen(argv)
    dead.wait()
    upstream = {"url": f"http://127.0.0.1:{port}", "version": "7", "pid": dead.pid, "model_dir": "x", "argv": argv}
    front = Running(router.create_app("m", "t", {"upstream": upstream}, None, supervision=FAST))
    try:
        wait_for(lambda: httpx.get(f"{front.url}/ready").json().get("error", {}).get("code") == "upstream_failed", 30)
        answer = httpx.get(f"{front.url}/ready")
        assert answer.status_code == 503
        message = answer.json()["error"]["message"]
        assert message.startswith("m v7: its server was restarted 3 times in 60 s and died again (its process")
        assert "(exit 3)" in message and "ladle model rollback" in message
        chat = httpx.post(f"{front.url}/v1/chat/completions", json={"messages": []})
        assert chat.status_code == 503 and chat.json()["error"]["message"] == message
        assert "ladle_front_restarts_total 3.0" in httpx.get(f"{front.url}/ladle/metrics").text
        assert "ladle_front_failed 1.0" in httpx.get(f"{front.url}/ladle/metrics").text
        assert httpx.get(f"{front.url}/health").status_code == 200  # the front itself lives
    finally:
        front.stop()
