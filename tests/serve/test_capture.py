"""Traffic capture and feedback (``serve.capture``): a real server process records what it answered, redacted, in
whole files a crash cannot tear; feedback reaches it through the real front; bad feedback is a clear 4xx and
nothing is kept; a store that fails stops the capture, never the serving."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from ladle.fleet import front as router
from ladle.platform.processes import free_port, stop_process
from ladle.serve import pool
from ladle.serve.capture import INTERNAL_HEADER, CaptureSettings, Redactor, part_files, read_records
from ladle.serve.server import Settings, create_app
from tests.serve.running import Running

KEY = "capture-test-key"
SECRET_TEXT = (
    "my key is sk-proj-abcdefghijklmnopqrstuvwxyz0123 and my password: hunter2hunter2, write to jane.doe@example.com"
)
LEAKS = ("sk-proj-abcdefghijklmnop", "hunter2hunter2", "jane.doe@example.com")


def wait_for(condition, seconds: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def captured(tiny_model, tmp_path_factory):
    """A real server (API and engine processes, ``python -m ladle.serve``) capturing into a folder, behind the
    real front."""
    root = tmp_path_factory.mktemp("capture")
    store = root / "traffic"
    port = free_port()
    argv = [sys.executable, "-m", "ladle.serve", "--model", str(tiny_model), "--name", "tiny", "--port", str(port)]
    capture = {"enabled": True, "url": str(store), "flush_s": 0.2, "max_correction_chars": 200}
    argv += ["--capture", json.dumps(capture), "--model-version", "7", "--api-key-env", "CAPTURE_TEST_KEY"]
    argv += ["--max-new-tokens", "8"]
    proc = pool.launch(argv, root / "server.log", {**os.environ, "CAPTURE_TEST_KEY": KEY})
    url = f"http://127.0.0.1:{port}"
    front = None
    try:
        wait_for(lambda: ready(url, proc, root / "server.log"), 120, "ready server")
        front = Running(router.create_app("tiny", "admin-token", {"upstream": {"url": url, "version": "7"}}, None))
        yield type("Captured", (), {"url": url, "front": front.url, "store": store, "proc": proc, "root": root})
    finally:
        if front is not None:
            front.stop()
        stop_process(proc, grace_s=20, group=True)


def ready(url: str, proc, log: Path) -> bool:
    assert proc.poll() is None, log.read_text()[-3000:]
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def feedback(where: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{where}/v1/feedback", json=body, headers=headers, timeout=30)


def test_answers_are_captured_redacted_and_feedback_through_the_front_is_kept(captured):
    client = openai.OpenAI(base_url=f"{captured.front}/v1", api_key=KEY, max_retries=0)
    own = client.chat.completions.create(  # ladle's own request (a smoke request, the shadow replay): not kept
        model="tiny",
        messages=[{"role": "user", "content": "smoke"}],
        max_tokens=2,
        extra_headers={INTERNAL_HEADER: "1"},
    )
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": SECRET_TEXT}], max_tokens=6, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "red green"}], max_tokens=6, stream=True, seed=3
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = client.completions.create(model="tiny", prompt="blue", max_tokens=4, temperature=0)
    ids = {whole.id, chunks[0].id, text.id}
    assert len(ids) == 3

    wait_for(lambda: len(read_records(str(captured.store), "captures")) == 3, what="three records")
    records = {r["id"]: r for r in read_records(str(captured.store), "captures")}
    assert set(records) == ids and own.id not in records  # queued in order: the internal one would be first
    first = records[whole.id]
    assert first["model"] == "tiny" and first["version"] == "7" and first["route"] == "chat"
    assert first["answer"]["content"] == whole.choices[0].message.content
    assert first["prompt_tokens"] == whole.usage.prompt_tokens and first["completion_tokens"] > 0
    assert first["request"]["max_tokens"] == 6 and first["latency_s"] > 0
    content = first["request"]["messages"][0]["content"]
    assert "[redacted:api_key]" in content and "[redacted:secret]" in content and "[redacted:email]" in content
    assert records[chunks[0].id]["answer"]["content"] == streamed  # a streamed answer whole
    assert records[text.id]["route"] == "completions" and records[text.id]["request"]["prompt"] == "blue"
    files = part_files(str(captured.store), "captures")
    assert files and all("/date=" in f and "/model=tiny/version=7/" in f for f in files)
    for path in captured.store.rglob("*"):  # nothing the user sent as a secret is in any file
        if path.is_file():
            assert not any(leak in path.read_text() for leak in LEAKS), path

    said = {"response_id": whole.id, "value": False, "correction": "red", "rationale": "it should say red"}
    kept = feedback(captured.front, said)  # through the front, with the API key as for generation
    assert kept.status_code == 200, kept.text
    assert kept.json() == {"object": "feedback", "response_id": whole.id, "model": "tiny", "version": "7"}
    again = feedback(captured.url, {**said, "value": True, "source": {"source_type": "HUMAN", "source_id": "u1"}})
    assert again.status_code == 200  # last wins (serve.capture.feedback's default): both kept, the later counts
    wait_for(lambda: len(read_records(str(captured.store), "feedback")) == 2, what="two feedbacks")
    stored = read_records(str(captured.store), "feedback")
    assert [f["value"] for f in stored] == [False, True] and stored[0]["correction"] == "red"
    assert stored[1]["source"] == {"source_type": "HUMAN", "source_id": "u1"} and stored[0]["version"] == "7"

    refused = {
        "unknown": (feedback(captured.front, {**said, "response_id": "chatcmpl-nobody"}), 404, "unknown_response"),
        "too long": (feedback(captured.front, {**said, "correction": "x" * 201}), 413, "too_long"),
        "not a score": (feedback(captured.front, {**said, "value": "great"}), 400, None),
        "unknown field": (feedback(captured.front, {**said, "stars": 5}), 400, None),
        "no key": (feedback(captured.front, said, key=None), 401, None),
    }
    for what, (answer, status, code) in refused.items():
        assert answer.status_code == status, (what, answer.text)
        assert answer.json()["error"]["message"], what
        if code:
            assert answer.json()["error"]["code"] == code, (what, answer.text)
    assert "max_correction_chars" in refused["too long"][0].json()["error"]["message"]
    time.sleep(0.5)
    assert len(read_records(str(captured.store), "feedback")) == 2  # nothing kept of the refused ones
    metrics = httpx.get(f"{captured.url}/metrics", timeout=10).text
    assert (
        'ladle_captured_total{kind="captures"} 3.0' in metrics
        and 'ladle_captured_total{kind="feedback"} 2.0' in metrics
    )


def test_a_killed_server_leaves_whole_files_and_the_next_one_takes_feedback_on_its_answers(captured, backend):
    """SIGKILL loses only what had not been written; a writer's temporary file left by a crash is skipped by every
    reader; a server started over the same store takes feedback on the answers its predecessor gave."""
    client = openai.OpenAI(base_url=f"{captured.url}/v1", api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "blue"}], max_tokens=4)
    wait_for(lambda: answer.id in {r["id"] for r in read_records(str(captured.store), "captures")}, what="the record")
    before = read_records(str(captured.store), "captures")
    os.killpg(captured.proc.pid, signal.SIGKILL)
    captured.proc.wait(timeout=30)
    folder = Path(part_files(str(captured.store), "captures")[-1]).parent
    (folder / ".part-host-1-1700000000000-000001.jsonl.tmp").write_text('{"id": "torn", "mod')  # a crash's leftover
    assert read_records(str(captured.store), "captures") == before

    settings = Settings("tiny", 8, capture=CaptureSettings(enabled=True, url=str(captured.store), flush_s=0.2))
    app = create_app(backend, settings)
    running = Running(app)
    try:
        wait_for(lambda: answer.id in app.state.capture.known, what="the earlier answers read back")
        late = httpx.post(f"{running.url}/v1/feedback", json={"response_id": answer.id, "value": 1.0}, timeout=30)
        assert late.status_code == 200 and late.json()["version"] == "7", late.text  # its answer's version
    finally:
        running.stop()
        app.state.capture.close()


def test_a_failing_store_stops_capture_never_serving_and_a_second_feedback_may_be_refused(backend, tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    settings = Settings(
        "tiny", 8, capture=CaptureSettings(enabled=True, url=str(blocked / "traffic"), flush_s=3.0, feedback="refuse")
    )
    app = create_app(backend, settings)
    running = Running(app)
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        # Its record is written (and the write fails) up to flush_s = 3 s later: the feedbacks come before that.
        first = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "red"}], max_tokens=4
        )
        body = {"response_id": first.id, "value": True}
        assert httpx.post(f"{running.url}/v1/feedback", json=body, timeout=30).status_code == 200
        second = httpx.post(f"{running.url}/v1/feedback", json=body, timeout=30)
        assert second.status_code == 409 and second.json()["error"]["code"] == "feedback_exists"
        wait_for(lambda: app.state.capture.stopped == "write_failed", what="the capture to stop")
        for _ in range(3):  # serving goes on
            assert client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4
            )
        metrics = httpx.get(f"{running.url}/metrics", timeout=10).text
        assert 'ladle_capture_stopped{reason="write_failed"} 1.0' in metrics
    finally:
        running.stop()
        app.state.capture.close()
    warned = [line for line in capsys.readouterr().err.splitlines() if "capture stopped" in line]
    assert len(warned) == 1 and "serving goes on" in warned[0]

    off = Running(create_app(backend, Settings("tiny", 8)))
    try:
        answer = httpx.post(f"{off.url}/v1/feedback", json={"response_id": "x", "value": True}, timeout=30)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "capture_off"
    finally:
        off.stop()


def test_redaction_covers_keys_tokens_passwords_addresses_and_the_operators_patterns():
    redactor = Redactor([r"\bACCT-\d{6}\b"])
    record = {
        "messages": [{"role": "user", "content": f"{SECRET_TEXT}; Authorization: Bearer abcdefghijklmnopqrstu"}],
        "note": ["AKIAABCDEFGHIJKLMNOP", "ghp_" + "a" * 36, "account ACCT-123456", 'config {"api_key": "zzz999"}'],
    }
    text = json.dumps(redactor.record(record))
    for leak in (*LEAKS, "abcdefghijklmnopqrstu", "AKIAABCDEFGHIJKLMNOP", "ghp_aaaa", "ACCT-123456", "zzz999"):
        assert leak not in text, leak
    assert "[redacted:custom]" in text and "[redacted:bearer]" in text
    assert redactor.text("the colour is red, 3 items") == "the colour is red, 3 items"  # ordinary text untouched
    with pytest.raises(ValueError, match="is not a regular expression"):
        CaptureSettings(redact=["(unclosed"])


def test_an_error_in_the_writer_stops_capture_once_and_never_kills_it_silently(tmp_path, capsys):
    from ladle.serve.capture import Recorder

    recorder = Recorder(CaptureSettings(enabled=True, url=str(tmp_path), flush_s=0.1), str(tmp_path), "m", "1")
    try:
        recorder.record("a", {"answer": {"content": "kept"}})
        wait_for(lambda: read_records(str(tmp_path), "captures"), what="the first record")
        recorder.redactor.record = lambda record: 1 / 0  # a bug in the writer's path
        recorder.record("b", {"answer": {"content": "lost"}})
        wait_for(lambda: recorder.stopped == "error", what="the capture to stop")
        assert not recorder.record("c", {}) and recorder.thread.is_alive()  # stopped, the request path unharmed
    finally:
        recorder.close()
    assert [r["id"] for r in read_records(str(tmp_path), "captures")] == ["a"]  # what was written stays
    assert "capture stopped, serving goes on: ZeroDivisionError" in capsys.readouterr().err


def test_each_captured_call_is_also_an_mlflow_trace_and_its_feedback_an_assessment(tmp_path, monkeypatch):
    """``serve.capture.mlflow_experiment``: the writer logs each written record as an MLflow trace (inputs the
    request, outputs the answer, tagged with the response id) and each feedback as MLflow feedback on it, a
    correction as its expected response; a feedback after a restart finds its trace by the tag."""
    from mlflow import MlflowClient

    from ladle.serve.capture import Recorder
    from tests.helpers import fresh_registry

    uri = fresh_registry(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    settings = CaptureSettings(enabled=True, flush_s=0.05, mlflow_experiment="ladle-traffic")
    rec = Recorder(settings, str(tmp_path / "traffic"), "tiny", "4")
    request = {"messages": [{"role": "user", "content": "my password: hunter2hunter2"}], "max_tokens": 4}
    for i in range(2):
        rec.record(f"chatcmpl-{i}", {"route": "chat", "request": request, "answer": {"content": f"a{i}"}})
    rec.feedback({"response_id": "chatcmpl-0", "name": "user_feedback", "value": False, "correction": "b0"})
    rec.close()
    assert rec.stopped is None and not rec.trace_warned
    later = Recorder(settings, str(tmp_path / "traffic"), "tiny", "4")  # another server: no memory of the traces
    wait_for(lambda: "chatcmpl-1" in later.known, what="the earlier answers read back")
    later.feedback({"response_id": "chatcmpl-1", "name": "user_feedback", "value": 0.75, "rationale": "fine"})
    later.close()
    assert not later.trace_warned

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("ladle-traffic")
    traces = {t.info.tags["ladle.response_id"]: t for t in client.search_traces(locations=[experiment.experiment_id])}
    assert set(traces) == {"chatcmpl-0", "chatcmpl-1"}
    first = traces["chatcmpl-0"]
    assert first.info.tags["ladle.version"] == "4" and "hunter2" not in json.dumps(first.data.request)
    assert json.loads(first.data.response) == {"content": "a0"}
    said = {(a.name, str(getattr(a, "value", None))) for a in first.info.assessments}
    assert ("user_feedback", "False") in said and ("expected_response", "b0") in said
    assert ("user_feedback", "0.75") in {(a.name, str(a.value)) for a in traces["chatcmpl-1"].info.assessments}
