"""DeepSpeed-MII: what can be checked without a GPU (the architecture check read from the installed DeepSpeed,
the startup watchdog, the options that reach it), and the real deployment on a GPU (skipped without one)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from ladle.config import ServeConfig
from ladle.errors import LadleError
from ladle.fleet.deploy import server_argv
from ladle.serve.fastgen import check_architecture, fastgen_head_sizes, fastgen_model_types, start_within
from tests.helpers import ROOT, needs_gpus


def test_fastgen_architectures_come_from_the_installed_deepspeed(tmp_path):
    known = fastgen_model_types()
    assert {"llama", "mistral", "qwen2"} <= set(known)
    assert fastgen_head_sizes() == [64, 80, 96, 128]
    config = {"model_type": "llama", "hidden_size": 1024, "num_attention_heads": 8, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert check_architecture(str(tmp_path)) == "llama"
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(LadleError, match=r"cannot serve model_type 'gemma2'.*Use serve.backend=transformers"):
        check_architecture(str(tmp_path))
    # The demo's tiny model as saved: float32 and 32-wide heads, both named at once.
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 32, "dtype": "float32"}))
    with pytest.raises(LadleError, match=r"would be float32.*this model's is 32"):
        check_architecture(str(tmp_path))
    # A vocabulary FastGen's unembedding kernel refuses (channels % 8) is named before MII's ranks start and die.
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 49_155}))
    with pytest.raises(LadleError, match=r"vocab_size divisible by 8 and this model's is 49155.*Resize .* to 49216"):
        check_architecture(str(tmp_path))


def test_the_watchdog_kills_what_a_hung_start_spawned():
    spawned = []
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # started before: kept

    def hang():
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        time.sleep(600)

    began = time.monotonic()
    with pytest.raises(LadleError, match=r"serve.start_timeout_s = 2: the test server did not start in time"):
        start_within(hang, 2, "the test server")
    assert time.monotonic() - began < 10
    spawned[0].wait(timeout=10)  # killed, so it is reaped at once
    assert not psutil.pid_exists(spawned[0].pid) or psutil.Process(spawned[0].pid).status() == "zombie"
    assert bystander.poll() is None, "a process the start did not spawn was killed"
    bystander.kill()
    bystander.wait(timeout=10)


def test_a_failed_start_says_why():
    def boom():
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(LadleError, match="failed to start: RuntimeError: CUDA out of memory"):
        start_within(boom, 5, "the deployment")


def test_serve_settings_reach_the_backend_that_accepts_them(tmp_path):
    mii = server_argv(tmp_path, "m", ServeConfig(backend="mii", tensor_parallel=2, replica_num=3), 8000)
    assert {"tensor_parallel=2", "replica_num=3", "start_timeout_s=600.0", "max_batch=32"} <= set(mii)
    plain = server_argv(tmp_path, "m", ServeConfig(max_batch_size=4, api_key_env="KEY"), 8000)
    assert "max_batch=4" in plain and "tensor_parallel=0" not in plain and plain[-2:] == ["--api-key-env", "KEY"]


@pytest.mark.gpu
@needs_gpus()
def test_mii_serves_the_offline_greedy_answer(tiny_model):
    pytest.importorskip("mii", reason="needs the mii extra: pip install 'ladle[mii]'")
    from ladle.serve.backends import MiiBackend
    from ladle.serve.rows import Job
    from tests.helpers import offline_greedy

    backend = MiiBackend.start(str(tiny_model), tensor_parallel=1, start_timeout_s=600)
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    events = []
    done = __import__("threading").Event()

    def emit(kind, data):
        events.append((kind, data))
        if kind in ("done", "error"):
            done.set()

    backend.submit(Job(ids=backend.encode_chat(messages), max_new_tokens=8, emit=emit))
    assert done.wait(120), events
    text = "".join(d["text"] for k, d in events if k == "text")
    assert text == offline_greedy(tiny_model, messages, 8)


# -- ladle's MII backend over a stand-in deployment (tests/fakes/mii: MII's process tree, client and stream) ----


@pytest.fixture
def fake_mii(monkeypatch, tiny_model, tmp_path):
    """The stand-in ``mii`` importable, and a model folder FastGen would accept (bf16, 64-wide heads)."""
    import shutil

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fakes"))
    for name in [m for m in sys.modules if m == "mii" or m.startswith("mii.")]:
        monkeypatch.delitem(sys.modules, name)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "head_dim": 64, "vocab_size": 384}))
    # The stand-in launches its own model server, not MII's module: ladle's rerouting of MII's launch is tested on
    # MII's real classes (tests/serve/test_mii_stream.py).
    monkeypatch.setattr("ladle.serve.mii_server.route_server_processes", lambda: None)
    yield model
    fakes = str(ROOT / "tests" / "fakes")
    for name in [m for m in sys.modules if m == "mii" or m.startswith("mii.")]:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(fakes):
            del sys.modules[name]  # the real mii, if it was imported, comes back with monkeypatch's undo


def descendants() -> set[int]:
    """This process's live descendants; one that ends while they are listed is left out (it is not live)."""
    alive = set()
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.add(proc.pid)
    return alive


def is_model_server(process) -> bool:
    """The stand-in's model server (the launcher's command line names its script too, as an argument)."""
    return process.cmdline()[1:2] == [str(ROOT / "tests" / "fakes" / "mii" / "model_server.py")]


def reversed_answer(backend, messages, n: int) -> str:
    return "".join(w + " " for w in backend.tokenizer.decode(backend.encode_chat(messages)).split()[::-1][:n])


def test_mii_backend_serves_streams_and_holds_concurrent_clients_then_leaves_nothing(fake_mii):
    import openai

    from ladle.serve.backends import MiiBackend
    from ladle.serve.server import Settings, create_app
    from tests.serve.running import Running

    before = descendants()
    backend = MiiBackend(str(fake_mii), tensor_parallel=1, start_timeout_s=60)
    assert len(backend.processes) == 2 and backend.ready()  # the launcher and its model server
    server = Running(create_app(backend, Settings("m", max_new_tokens=6)))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    try:
        asks = [[{"role": "user", "content": f"question number {i} for the deployment"}] for i in range(24)]

        def ask(messages):
            return client.chat.completions.create(model="m", messages=messages, max_tokens=6).choices[0]

        with ThreadPoolExecutor(24) as pool:  # 24 requests in flight on the backend's one loop
            answers = list(pool.map(ask, asks))
        assert [a.message.content for a in answers] == [reversed_answer(backend, m, 6) for m in asks]
        assert {a.finish_reason for a in answers} == {"length"}
        stream = client.chat.completions.create(model="m", messages=asks[0], max_tokens=3, stream=True)
        pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
        assert len(pieces) == 3 and "".join(pieces) == reversed_answer(backend, asks[0], 3)
        with pytest.raises(openai.BadRequestError, match="seed is not supported by the mii backend"):
            client.chat.completions.create(model="m", messages=asks[0], seed=1)
        assert httpx.get(f"{server.url}/ready").status_code == 200

        model_server = next(p for p in backend.processes if is_model_server(p))
        model_server.kill()  # the deployment dies under the front
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/ready").status_code != 503:
            assert time.monotonic() < deadline, "/ready did not notice the dead model server"
            time.sleep(0.2)
        assert "model server is down" in httpx.get(f"{server.url}/ready").json()["error"]["message"]
        with pytest.raises(openai.InternalServerError, match="the MII deployment failed"):
            ask(asks[0])
    finally:
        server.stop()
        backend.close()
    deadline = time.monotonic() + 15
    while descendants() - before:
        assert time.monotonic() < deadline, f"left running: {descendants() - before}"
        time.sleep(0.1)


def test_a_model_server_killed_during_start_stops_the_whole_deployment(fake_mii, monkeypatch):
    import threading

    from ladle.serve.backends import MiiBackend

    monkeypatch.setenv("FAKE_MII_LOAD_S", "60")
    before = descendants()

    def kill_the_model_server() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for pid in descendants() - before:
                with contextlib.suppress(psutil.Error):
                    if is_model_server(psutil.Process(pid)):
                        psutil.Process(pid).kill()
                        return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_model_server)
    killer.start()
    began = time.monotonic()
    with pytest.raises(
        LadleError, match=r"failed to start: RuntimeError: server crashed.*process\(es\) it had started"
    ):
        MiiBackend(str(fake_mii), tensor_parallel=1, start_timeout_s=120)
    killer.join(timeout=10)
    assert time.monotonic() - began < 30
    assert not descendants() - before


def test_a_launcher_killed_during_start_does_not_orphan_its_server(fake_mii, monkeypatch):
    """The launcher dies first: its model server leaves this process's tree, yet is stopped with the rest."""
    import threading

    from ladle.serve.backends import MiiBackend

    monkeypatch.setenv("FAKE_MII_LOAD_S", "60")
    before = descendants()
    servers = []

    def kill_the_launcher() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = [psutil.Process(pid) for pid in descendants() - before]
            servers.extend(p for p in found if is_model_server(p))
            launchers = [p for p in found if p.cmdline()[1:2] == ["-c"]]
            if servers and launchers:
                time.sleep(0.5)  # the start has seen both
                launchers[0].kill()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_launcher)
    killer.start()
    with pytest.raises(LadleError, match=r"failed to start: RuntimeError: server crashed"):
        MiiBackend(str(fake_mii), tensor_parallel=1, start_timeout_s=120)
    killer.join(timeout=10)
    assert servers and not servers[0].is_running()


def test_a_start_that_runs_out_of_time_leaves_no_process(fake_mii, monkeypatch):
    from ladle.serve.backends import MiiBackend

    monkeypatch.setenv("FAKE_MII_LOAD_S", "120")
    before = descendants()
    with pytest.raises(LadleError, match=r"serve.start_timeout_s = 3: the DeepSpeed-MII deployment .* did not start"):
        MiiBackend(str(fake_mii), tensor_parallel=1, start_timeout_s=3)
    assert not descendants() - before


def test_each_deployment_gets_ports_of_its_own(fake_mii):
    """A champion swap starts the new deployment while the old one serves: their ports never meet."""
    from ladle.serve.backends import MiiBackend
    from ladle.serve.rows import Job

    old = MiiBackend(str(fake_mii), tensor_parallel=1)
    new = MiiBackend(str(fake_mii), tensor_parallel=1)
    try:
        first, second = old.client.mii_config, new.client.mii_config
        assert first.port_number != second.port_number and first.deployment_name != second.deployment_name
        assert first.torch_dist_port != second.torch_dist_port and first.zmq_port_number != second.zmq_port_number
        for backend in (old, new):
            done = __import__("threading").Event()
            events = []
            job = Job(ids=backend.encode("one two three"), max_new_tokens=2)
            job.emit = lambda kind, data, events=events, done=done: (
                events.append((kind, data)),
                kind != "text" and done.set(),
            )
            backend.submit(job)
            assert done.wait(30) and events[-1][0] == "done" and events[-1][1]["completion_tokens"] == 2
    finally:
        old.close()
        new.close()


def test_a_request_mii_does_not_answer_within_its_wait_gets_a_503(fake_mii, monkeypatch):
    """FastGen's queue is MII's own: the request's deadline runs to its first message."""
    from ladle.serve.backends import MiiBackend
    from ladle.serve.limits import ServeLimits
    from ladle.serve.server import Settings, create_app
    from tests.serve.running import Running

    monkeypatch.setenv("FAKE_MII_DELAY_S", "2.0")  # every word 2 s apart, the first too
    backend = MiiBackend(str(fake_mii), tensor_parallel=1, start_timeout_s=60)
    server = Running(create_app(backend, Settings("m", max_new_tokens=2, limits=ServeLimits(queue_timeout_s=0.3))))
    try:
        body = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2}
        late = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout", late.text
        assert late.headers["retry-after"] == "1"
    finally:
        server.stop()
        backend.close()
