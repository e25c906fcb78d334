"""A model server is two processes: the API (``python -m ladle.serve``) and its engine, forked from it. Real
processes on the demo's tiny model (with Hermes's tool-calling template): answers through the split equal the
engine driven in this process (greedy, seeded, with log-probabilities, echo, stop strings, streamed and whole); a
forced tool call is one valid call, whole and streamed; a hung-up stream stops the engine's work; SIGTERM drains a request in flight and leaves nothing; the engine killed fails its request with a
503 and the server exits 1 to be restarted; the API killed takes the engine with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from ladle.platform.processes import stop_process
from tests.helpers import start_server
from tests.templates import assert_one_forced_call

CASES = [
    ("/v1/completions", {"prompt": "red blue green", "max_tokens": 12, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "one two", "max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 10, "temperature": 0.8, "seed": 7}),
    ("/v1/completions", {"prompt": "red blue green", "max_tokens": 12, "temperature": 0, "stop": ["e"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "temperature": 0}),
]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def engine_of(server) -> psutil.Process:
    children = psutil.Process(server.pid).children()
    assert len(children) == 1, children  # one engine process per server
    return children[0]


NO_EOS = {"2": -100}  # the tiny model's end-of-sequence token never chosen: a generation runs to its max_tokens


def same(a, b, path: str = "") -> None:
    """Equal answers: the same structure, text and tokens; log-probabilities within 1e-4 (the engine in the server
    and the one here may run on different thread counts, which reorders float sums)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a.keys() - {"id", "created"}:
            same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert abs(a - b) <= 1e-4, (path, a, b)
    else:
        assert a == b, (path, a, b)


def streamed_text(url: str, path: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


@pytest.fixture(scope="module")
def hermes(tiny_model, tmp_path_factory):
    """The tiny model with Hermes's tool-calling chat template."""
    from tests.templates import TEMPLATES, with_template

    return with_template(tiny_model, tmp_path_factory.mktemp("hermes") / "model", TEMPLATES["hermes"])


@pytest.fixture(scope="module")
def split(hermes, tmp_path_factory):
    server, url = start_server(hermes, tmp_path_factory.mktemp("split") / "server.log", max_batch_size=8)
    yield server, url
    stop_process(server, 10, group=True)


@pytest.fixture(scope="module")
def server(hermes):
    """The same model's engine driven in this process, behind the same app."""
    from ladle.serve.backends import TransformersBackend
    from ladle.serve.server import Settings, create_app
    from tests.serve.running import Running

    running = Running(create_app(TransformersBackend(str(hermes), max_batch=8), Settings("tiny", max_new_tokens=16)))
    yield running
    running.stop()


def test_answers_through_the_split_equal_the_engine_in_this_process(split, server):
    proc, url = split
    assert engine_of(proc).pid != proc.pid
    for path, body in CASES:
        here = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        there = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert here.status_code == there.status_code == 200, there.text
        same(there.json(), here.json())
        whole = there.json()["choices"][0]
        text = whole.get("text") if "text" in whole else whole["message"]["content"]
        if not body.get("echo"):
            assert streamed_text(url, path, body) == text
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_forced_tool_call_through_the_split_is_one_valid_call_whole_and_streamed(split):
    """Calls are read from the answer's tokens (a call tag may be a special token), which the engine process sends
    with each event, and the grammar that forces the call is compiled there: Hermes's template, whole and streamed."""
    _, url = split
    assert_one_forced_call(url)


def steps(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("ladle_batch_size_count"):
            return float(line.split()[-1])
    raise AssertionError("no ladle_batch_size_count")


def test_a_hung_up_stream_stops_the_engines_work(split):
    _, url = split
    body = {"prompt": "red", "max_tokens": 2000, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
        next(answer.iter_lines())  # its first chunk; then the client hangs up
    time.sleep(0.5)  # the cancel crosses to the engine, which drops the row at its next step
    before = steps(url)
    time.sleep(1.0)
    assert steps(url) == before  # no step ran since: nobody generates the 2,000 tokens for nobody
    assert httpx.get(f"{url}/metrics").text.count("ladle_cancelled_total 1.0") == 1


def test_sigterm_drains_the_request_in_flight_and_leaves_nothing(split):
    proc, url = split
    engine = engine_of(proc)
    with httpx.Client(timeout=60) as http:
        body = {"prompt": "red", "max_tokens": 400, "temperature": 0, "stream": True, "logit_bias": NO_EOS}
        with http.stream("POST", f"{url}/v1/completions", json=body) as answer:
            lines = answer.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)  # to the API process; the engine serves the drain
            lines = list(lines)
    assert [x for x in lines if x][-1] == "data: [DONE]"
    assert json.loads([x for x in lines if x.startswith("data: {")][-1][6:])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=30) == 0
    wait_for(lambda: gone(engine.pid), 10, "the engine outlived its server")


def test_the_engine_killed_fails_its_request_and_the_server_exits_to_be_restarted(tiny_model, tmp_path):
    proc, url = start_server(tiny_model, tmp_path / "server.log")
    try:
        engine = engine_of(proc)
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json={"prompt": "red", "max_tokens": 1500, "temperature": 0, "stream": True, "logit_bias": NO_EOS},
            timeout=60,
        ) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()
            next(lines)
            os.kill(engine.pid, signal.SIGKILL)
            rest = "".join(lines)
        assert '"code": "engine_down"' in rest and "exited (code -9)" in rest
        assert proc.wait(timeout=30) == 1  # red, then gone: the supervisor starts it again
        assert "the engine process of this server exited (code -9)" in (tmp_path / "server.log").read_text()
    finally:
        stop_process(proc, 10, group=True)


def test_the_api_process_killed_takes_its_engine_with_it(tiny_model, tmp_path):
    proc, _ = start_server(tiny_model, tmp_path / "server.log")
    engine = engine_of(proc)
    os.kill(proc.pid, signal.SIGKILL)  # the API process alone, not its group
    proc.wait(timeout=10)
    wait_for(lambda: gone(engine.pid), 10, "the engine was orphaned")


def test_a_server_forks_from_the_warm_pool_and_reports_its_exit_through_it(tmp_path):
    from ladle.serve import pool

    sock = os.environ[pool.ENV]  # the suite's pool (tests/conftest.py), started without waiting
    wait_for(lambda: os.path.exists(sock), 120, "the suite's server pool never listened")
    argv = [sys.executable, "-m", "ladle.serve", "--model", "/nonexistent", "--port", "1"]
    started = pool.launch(argv, tmp_path / "warm.log")
    assert isinstance(started, pool.Started)
    assert started.wait(timeout=60) == 2  # main's exit status, carried back by the pool
    assert "--model /nonexistent" in (tmp_path / "warm.log").read_text()
    assert not psutil.pid_exists(started.pid) or gone(started.pid)
    assert os.stat(sock).st_mode & 0o777 == 0o600, "only the pool's user may ask it for a server"
    target = tmp_path / "someone-elses-file"
    target.write_text("kept")
    (tmp_path / "linked.log").symlink_to(target)
    linked = pool.launch(argv, tmp_path / "linked.log")  # a log through a link: never truncated
    assert linked.wait(timeout=60) != 0 and target.read_text() == "kept"

    cold = pool.launch(argv, tmp_path / "cold.log", {**os.environ, pool.ENV: str(tmp_path / "no.sock")})
    assert isinstance(cold, subprocess.Popen) and cold.wait(timeout=60) == 2
    assert "--model /nonexistent" in (tmp_path / "cold.log").read_text()


def test_a_pool_killed_leaves_its_servers_serving_and_their_handles_working(tiny_model, tmp_path):
    """The pool is a convenience, not a dependency: killed, the servers it forked go on answering, a handle on one
    still polls and stops it (its exit status is lost with the pool: -1), and a new start is cold."""
    from ladle.platform.processes import free_port
    from ladle.serve import pool

    sock = tmp_path / "pool.sock"
    parent = subprocess.Popen([sys.executable, "-m", "ladle.serve.pool", "--socket", str(sock)])
    started = None
    try:
        wait_for(sock.exists, 120, "the pool never listened")
        port = free_port()
        argv = [sys.executable, "-m", "ladle.serve", "--model", str(tiny_model), "--name", "m", "--port", str(port)]
        started = pool.launch(argv, tmp_path / "server.log", {**os.environ, pool.ENV: str(sock)})
        assert isinstance(started, pool.Started) and psutil.Process(started.pid).ppid() == parent.pid
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: answers(f"{url}/ready") or started.poll() is not None, 60, "the server never became ready")
        engine = engine_of(started)
        parent.kill()
        parent.wait(10)
        assert started.poll() is None  # the pool gone, the server is not
        assert httpx.get(f"{url}/health").status_code == 200
        started.terminate()
        assert started.wait(timeout=30) == -1
        wait_for(lambda: gone(engine.pid), 10, "the engine outlived its server")  # nobody's child now: checked here
        cold = pool.launch([*argv[:3], "--help"], tmp_path / "cold.log", {**os.environ, pool.ENV: str(sock)})
        assert isinstance(cold, subprocess.Popen) and cold.wait(timeout=60) == 0  # nobody answers: a cold start
    finally:
        if started is not None and started.poll() is None:
            started.kill()
        stop_process(parent, 5)


def test_an_engine_whose_pipe_outlives_it_is_still_found_dead():
    """The reader learns of the engine's end from its exit status too: an engine process that died while something
    it started kept its end of the pipe open sends no end of file, and the server must still fail what it had in
    flight and exit to be restarted. Here the pipe's other end is held by this test, and the "engine" a child that
    exits at once."""
    import threading
    from multiprocessing import Pipe

    from ladle.serve.client import EngineClient

    ours, theirs = Pipe()
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    client = object.__new__(EngineClient)  # the reader alone: no model, no engine process of its own
    client.conn, client.pid, client.proc, client.code, client.reaping = ours, pid, None, None, threading.Lock()
    client.dead, client.jobs, died = None, {}, []
    client.on_death = lambda: died.append(True)
    reader = threading.Thread(target=client.read, daemon=True)
    began = time.monotonic()
    reader.start()
    reader.join(timeout=15)
    assert not reader.is_alive() and died == [True], "the reader never noticed the engine had ended"
    assert time.monotonic() - began < 10
    assert "exited (code 3)" in client.dead
    theirs.close()
