"""The server under requests that would hurt everyone else: every ``serve.limits`` bound answers its 4xx naming
the field (413 before an oversized body is read whole, 429 with ``Retry-After`` when the queue is full, 503 when a
request waited past its deadline), tokenization never stalls ``/health``, a non-streaming client that hangs up
cancels its generation, a failing arrival fails only itself, an engine that fails every step turns readiness and
liveness red, and requests to random paths do not grow the metric series.

The engine runs the real tiny model; a ``Gate`` in front of its ``forward`` holds a step until the test opens it,
so a queue can be filled and a wait made to pass without racing the clock."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ladle.serve import engine as engine_module
from ladle.serve.backends import TransformersBackend
from ladle.serve.engine import Engine
from ladle.serve.limits import ServeLimits
from ladle.serve.rows import Job
from ladle.serve.server import Settings, create_app
from tests.serve.running import Running

CHAT = "/v1/chat/completions"


class Gate:
    """Wraps a model: each ``forward`` waits until the gate is open (and raises while ``broken``); records the
    logits' shape of every call."""

    def __init__(self, model):
        self.model, self.open, self.broken, self.shapes = model, threading.Event(), None, []
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, **kwargs):
        self.entered.set()
        assert self.open.wait(60), "the test never opened the gate"
        if self.broken is not None and self.broken(kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        out = self.model(**kwargs)
        self.shapes.append(tuple(out.logits.shape))
        return out


@pytest.fixture(scope="module")
def backend(tiny_model):
    return TransformersBackend(str(tiny_model), max_batch=1)


@pytest.fixture
def gated(backend):
    """The backend's engine with a closed ``Gate`` in front of its model (opened, and removed, at the end)."""
    gate = Gate(backend.engine.model)
    backend.engine.model = gate
    yield gate
    gate.broken = None
    gate.open.set()
    deadline = time.monotonic() + 60
    while backend.engine.depth() or backend.engine.failures:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    backend.engine.model = gate.model
    backend.engine.failures = 0


def serving(backend, **limits) -> Running:
    return Running(create_app(backend, Settings("tiny", max_new_tokens=4, limits=ServeLimits(**limits))))


def body(content: str = "Hello", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **extra}


def test_oversized_bodies_get_413_before_they_are_read(backend):
    running = serving(backend, max_body_bytes=4096)
    try:
        big = httpx.post(f"{running.url}{CHAT}", json=body("x" * 10_000))
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert "serve.limits.max_body_bytes" in big.json()["error"]["message"]

        def chunks():  # no Content-Length: refused while it arrives
            for _ in range(100):
                yield b"x" * 1000

        streamed = httpx.post(f"{running.url}{CHAT}", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413, streamed.text
        assert httpx.post(f"{running.url}{CHAT}", json=body()).status_code == 200
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        running.stop()


def test_a_full_queue_gets_429_and_a_late_request_503(backend, gated, monkeypatch):
    from ladle.serve import routes as server_module

    compiled = []
    real = server_module.constraint_of
    monkeypatch.setattr(server_module, "constraint_of", lambda *a: compiled.append(a) or real(*a))
    running = serving(backend, max_queue=1, queue_timeout_s=0.5)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{running.url}{CHAT}", json=body("first"), timeout=60)
            assert gated.entered.wait(30)  # the first one holds the only row, inside its prefill
            second = pool.submit(httpx.post, f"{running.url}{CHAT}", json=body("second"), timeout=60)
            deadline = time.monotonic() + 30
            while backend.engine.depth() < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.02)
            before = len(compiled)
            schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
            shaped = {
                **body("third"),
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            }
            full = httpx.post(f"{running.url}{CHAT}", json=shaped, timeout=30)
            assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
            assert full.json()["error"]["code"] == "queue_full"
            assert len(compiled) == before  # refused before its grammar cost the server anything
            time.sleep(0.8)  # past the second one's queue deadline
            gated.open.set()
            assert first.result().status_code == 200
            late = second.result()
        assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
        assert late.json()["error"]["code"] == "queue_timeout"
        assert "serve.limits.queue_timeout_s" in late.json()["error"]["message"]
    finally:
        running.stop()


def test_tools_larger_than_a_schema_may_be_are_refused_naming_the_field(backend):
    running = serving(backend)
    try:
        huge = {
            "type": "object",
            "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(600)},
        }
        tool = {"type": "function", "function": {"name": "f", "parameters": huge}}
        answer = httpx.post(f"{running.url}{CHAT}", json={**body("x"), "tools": [tool]}, timeout=30)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("tools", "tools_too_large") and "at most 100000" in error["message"]
    finally:
        running.stop()


def test_a_streamed_request_that_waited_too_long_gets_a_503_status(backend, gated):
    running = serving(backend, queue_timeout_s=0.3)
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{running.url}{CHAT}", json=body("first"), timeout=60)
            assert gated.entered.wait(30)
            threading.Timer(0.8, gated.open.set).start()
            late = httpx.post(f"{running.url}{CHAT}", json=body("late", stream=True), timeout=60)
            assert first.result().status_code == 200
        assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
    finally:
        running.stop()


def test_tokenizing_a_long_prompt_does_not_stall_health(backend, monkeypatch):
    started, release = threading.Event(), threading.Event()
    encode = backend.encode

    def slow_encode(text):
        started.set()
        release.wait(30)
        return encode(text)

    monkeypatch.setattr(backend, "encode", slow_encode)
    running = serving(backend)
    try:
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(
                httpx.post, f"{running.url}/v1/completions", json={"prompt": "x y", "max_tokens": 2}, timeout=60
            )
            assert started.wait(30)
            began = time.monotonic()
            assert httpx.get(f"{running.url}/health", timeout=5).status_code == 200
            waited = time.monotonic() - began
            release.set()
            assert done.result().status_code == 200
        assert waited < 5
    finally:
        release.set()
        running.stop()


def cancelled(url: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return next(float(line.split()[-1]) for line in lines if line.startswith("ladle_cancelled_total"))


def test_a_non_streaming_client_that_hangs_up_cancels_its_generation(backend, gated):
    running = serving(backend)
    try:
        before = cancelled(running.url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.url}{CHAT}", json=body(max_tokens=200), timeout=httpx.Timeout(30, read=0.5))
        deadline = time.monotonic() + 30
        while cancelled(running.url) == before:
            assert time.monotonic() < deadline, "the abandoned request was not cancelled"
            time.sleep(0.05)
        gated.open.set()
        assert httpx.post(f"{running.url}{CHAT}", json=body(), timeout=60).status_code == 200
    finally:
        running.stop()


def test_an_engine_that_fails_every_step_turns_ready_and_health_red(backend, gated):
    running = serving(backend)
    try:
        gated.broken = lambda kwargs: True
        gated.open.set()
        for _ in range(engine_module.FAILING_STEPS):
            failed = httpx.post(f"{running.url}{CHAT}", json=body(), timeout=60)
            assert failed.status_code == 500 and "illegal memory access" in failed.json()["error"]["message"]
        assert httpx.get(f"{running.url}/ready").status_code == 503
        assert httpx.get(f"{running.url}/health").status_code == 503
        gated.broken = None  # one step that works again: ready
        assert httpx.post(f"{running.url}{CHAT}", json=body(), timeout=60).status_code == 200
        assert httpx.get(f"{running.url}/ready").status_code == 200
    finally:
        running.stop()


def test_random_paths_do_not_grow_the_metric_series(backend):
    running = serving(backend)
    try:
        for i in range(30):
            assert httpx.get(f"{running.url}/probe-{i}").status_code == 404
        assert httpx.post(f"{running.url}{CHAT}", json=body(seed=2**70)).status_code == 400
        series = [
            line for line in httpx.get(f"{running.url}/metrics").text.splitlines() if "ladle_requests_total{" in line
        ]
        assert any('route="other",status="404"' in line for line in series)
        assert not any("probe-" in line for line in series) and len(series) < 10
    finally:
        running.stop()


def test_a_temperature_near_zero_is_greedy_not_an_error(backend):
    running = serving(backend)
    try:
        greedy = httpx.post(f"{running.url}{CHAT}", json=body(), timeout=60).json()
        tiny = httpx.post(f"{running.url}{CHAT}", json=body(temperature=1e-30), timeout=60)
        assert tiny.status_code == 200, tiny.text
        assert tiny.json()["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    finally:
        running.stop()


def test_an_arrival_that_fails_its_prefill_fails_alone(tiny_model, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    gate = Gate(model)
    poison = tokenizer("zebra", add_special_tokens=False).input_ids[0]
    gate.broken = lambda kwargs: bool((kwargs["input_ids"] == poison).any()) and kwargs["input_ids"].shape[1] > 1
    engine = Engine(gate, tokenizer, "cpu", max_batch=4)
    jobs, ends = [], {}

    def job(text: str, tokens: int) -> Job:
        item = Job(ids=tokenizer(text, add_special_tokens=False).input_ids, max_new_tokens=tokens)
        done = threading.Event()
        item.emit = lambda kind, data, text=text: (ends.__setitem__(text, kind), done.set()) if kind != "text" else None
        item.done = done
        jobs.append(item)
        return item

    engine.submit(job("a running answer", 40))
    assert gate.entered.wait(30)  # the first one's prefill is held: the next two arrive together
    engine.submit(job("zebra crossing", 4))
    engine.submit(job("a good one", 4))
    time.sleep(0.2)
    gate.open.set()
    for item in jobs:
        assert item.done.wait(60)
    assert ends == {"a running answer": "done", "zebra crossing": "error", "a good one": "done"}
    assert engine.failures == 0 and engine.healthy()
    # Prefill kept only the last position's logits: every call's logits are [rows, 1, vocab].
    assert all(shape[1] == 1 for shape in gate.shapes), gate.shapes


def test_incremental_detokenization_equals_a_whole_decode(tokenizer):
    import random

    from ladle.serve.rows import decode_next

    rng = random.Random(0)
    texts = ["héllo wörld — naïve café ✓ 日本語 🙂", "  spaces\tand\nnewlines  ", "a" * 50]
    sequences = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(60)] for _ in range(20)]
    for ids in sequences:
        job = Job(ids=[1], max_new_tokens=len(ids))
        text = ""
        for token in ids:
            job.tokens.append(token)
            text += decode_next(tokenizer, job)
        text += decode_next(tokenizer, job, final=True)
        assert text == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_stop_string_across_tokens_is_found_by_the_bounded_scan():
    from ladle.serve.rows import find_stop

    text = "one two thr"
    assert find_stop(text, ["three"], len(text)) == -1
    text += "ee four"
    assert find_stop(text, ["three", "zzz"], len("one two thr")) == text.index("three")
    assert find_stop("stop at the start", ["stop"], 0) == 0


def test_the_front_refuses_an_oversized_body_before_holding_it(backend):
    from ladle.fleet import front as router

    running = serving(backend)
    upstream = {"url": running.url, "version": "1", "pid": None, "model_dir": "x"}
    front = Running(router.create_app("tiny", "t", {"upstream": upstream}, None, max_body_bytes=4096))
    try:
        big = httpx.post(f"{front.url}{CHAT}", json=body("x" * 10_000))
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

        def chunks():
            for _ in range(100):
                yield b"x" * 1000

        streamed = httpx.post(f"{front.url}{CHAT}", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert httpx.post(f"{front.url}{CHAT}", json=body(), timeout=60).status_code == 200
    finally:
        front.stop()
        running.stop()


def test_a_client_that_leaves_the_front_before_its_answer_cancels_it_and_frees_its_count(backend, gated):
    from ladle.fleet import front as router

    running = serving(backend)
    upstream = {"url": running.url, "version": "1", "pid": None, "model_dir": "x"}
    front = Running(router.create_app("tiny", "t", {"upstream": upstream}, None))
    try:
        before = cancelled(running.url)
        for stream in (False, True):  # the answer's headers wait for its first token, held by the gate
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{front.url}{CHAT}", json=body(max_tokens=200, stream=stream), timeout=httpx.Timeout(30, read=0.5)
                )
        deadline = time.monotonic() + 30
        while cancelled(running.url) < before + 2:
            assert time.monotonic() < deadline, "the abandoned requests were not cancelled at the server"
            time.sleep(0.05)
        counts = httpx.get(f"{front.url}/ladle/upstream", headers={router.ADMIN_HEADER: "t"}).json()["in_flight"]
        assert counts.get(running.url, 0) == 0, counts
    finally:
        front.stop()
        running.stop()


def test_a_front_loop_that_crashes_turns_the_front_red():
    from ladle.fleet import front as router

    app = router.create_app("tiny", "t", {"upstream": None}, None)

    async def broken():
        raise RuntimeError("supervision bug")

    app.state.supervisor.run = broken
    front = Running(app)
    try:
        deadline = time.monotonic() + 30
        while httpx.get(f"{front.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "the crash was not reported"
            time.sleep(0.05)
        message = httpx.get(f"{front.url}/ready").json()["error"]["message"]
        assert "the front's supervision loop crashed (RuntimeError: supervision bug)" in message
    finally:
        front.stop()
