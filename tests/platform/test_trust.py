"""Write access to the artifact store or the registry is not code execution or a path outside a folder on the
hosts that read them: keys with ``..`` are refused, checkpoints load as data only, a registry tag is checked
before it names a folder, two processes making the first copy of a version never write into one folder, and a
process that SIGKILL cannot end is reported after a deadline instead of waited on for ever."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch

from ladle.errors import LadleError
from ladle.platform import processes, storage


class Payload:
    """A pickle that would run a command when loaded."""

    def __reduce__(self):
        return (subprocess.call, (["touch", "/tmp/ladle-pwned"],))


def test_a_key_with_dotdot_is_not_written_outside_the_folder(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe("/evil/model/config.json", b"{}")
    fs.pipe("/evil/model/../../escaped.txt", b"x")  # a key, not a path: stores keep it as written
    fs.store["/evil/model/sub/../../../escaped.txt"] = fs.store.pop(next(k for k in fs.store if "escaped" in k))
    with pytest.raises(ValueError, match=r"would be written outside"):
        storage.download_dir("memory://evil/model", tmp_path / "copy")
    assert not (tmp_path / "escaped.txt").exists() and not list(tmp_path.rglob("escaped.txt"))


def test_a_checkpoint_is_loaded_as_data_only(tmp_path, monkeypatch):
    from ladle.train import checkpoint

    root = str(tmp_path / "ckpt")
    target = checkpoint.step_dir(root, 3)
    buffer = io.BytesIO()
    torch.save({"step": 3, "format": "dcp", "evil": Payload()}, buffer)
    storage.write_bytes(storage.join(target, "state.pt"), buffer.getvalue())
    storage.mark_complete(target)
    Path("/tmp/ladle-pwned").unlink(missing_ok=True)
    with pytest.raises(Exception, match="Weights only load failed"):
        checkpoint.load_latest(None, root, None, None, None, None, None)
    assert not Path("/tmp/ladle-pwned").exists()


def test_a_registry_tag_that_is_not_a_hash_names_no_folder(tmp_path):
    assert storage.cache_key("ab" * 32, "tag") == "ab" * 8
    for bad in ("../../etc", "v3-1700000000", "AB" * 32, "", "/abs/path/0123456789abcdef"):
        with pytest.raises(ValueError, match=r"tag = .*not a hex content hash"):
            storage.cache_key(bad, "tag")
    from ladle.serve.__main__ import local_model

    with pytest.raises(LadleError, match=r"--model-sha256 = '\.\./x'"):
        local_model("memory://models/m", "../x")


def test_two_first_copies_at_once_never_share_a_folder(tmp_path):
    source = tmp_path / "store" / "model"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "weights.bin").write_bytes(b"w" * 2_000_000)
    target = tmp_path / "served" / "0123456789abcdef"
    code = (
        "import sys; from pathlib import Path; from ladle.platform import storage; "
        "storage.cached_copy(sys.argv[1], Path(sys.argv[2]))"
    )
    runs = [
        subprocess.Popen([sys.executable, "-c", code, f"file://{source}", str(target)], stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    errors = [run.communicate(timeout=120)[1] for run in runs]
    assert [run.returncode for run in runs] == [0] * 4, errors
    assert (target / "weights.bin").read_bytes() == b"w" * 2_000_000
    assert json.loads((target / "config.json").read_text()) == {}
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temporary folder left


def test_a_process_sigkill_cannot_end_is_reported_not_waited_on(monkeypatch, capsys):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Uninterruptible sleep cannot be made here; a process that still looks alive after SIGKILL stands in.
        monkeypatch.setattr(processes, "exited", lambda pid: False)
        monkeypatch.setattr(processes, "KILL_WAIT_S", 0.5)
        assert processes.stop_pid(proc.pid, grace_s=0.2) == "unkillable"
        assert f"process {proc.pid} is still there" in capsys.readouterr().out
    finally:
        proc.kill()
        proc.wait()


def test_a_tracking_password_never_stays_in_the_config(monkeypatch):
    from ladle.config import ConfigError, load_config

    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config("recipes/tiny-cpu.yaml", ["tracking.uri=https://ops:hunter2-secret@mlflow.example:5000/"])
    assert cfg.tracking.uri == "https://mlflow.example:5000/"
    assert "hunter2" not in cfg.model_dump_json() and "hunter2" not in json.dumps(cfg.model_dump())
    import os

    from ladle.platform.secrets import credential_env, redact, with_credentials

    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ  # kept for that server, not for the whole process
    assert with_credentials(cfg.tracking.uri) == "https://ops:hunter2-secret@mlflow.example:5000/"
    assert credential_env(cfg.tracking.uri)["MLFLOW_TRACKING_PASSWORD"] == "hunter2-secret"
    assert redact("failed: hunter2-secret") == "failed: ***"
    with pytest.raises(ConfigError) as refused:
        load_config("recipes/tiny-cpu.yaml", ["tracking.uri=postgresql://ops:pw12345@db/mlflow"])
    assert "postgresql://ops:***@db/mlflow carries a password" in str(refused.value)
    assert "pw12345" not in str(refused.value)  # the error echoes the value: masked there too


def test_two_configs_in_one_process_each_keep_their_own_servers_password(monkeypatch):
    """A process that reads two configs (a worker, a test, a notebook) sends each server its own credentials
    only: nothing lands in the environment for the next config's server to receive, and the training processes
    of a run get their run's server's pair alone."""
    import os
    from types import SimpleNamespace

    from ladle.config import load_config
    from ladle.platform.secrets import credential_env, with_credentials
    from ladle.train.run import worker_env

    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    a = load_config("recipes/tiny-cpu.yaml", ["tracking.uri=https://alice:alice-pass-1@mlflow-a.example/"])
    b = load_config("recipes/tiny-cpu.yaml", ["tracking.uri=http://bob:bob-pass-22@mlflow-b.example:5000"])
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ
    assert with_credentials(a.tracking.uri) == "https://alice:alice-pass-1@mlflow-a.example/"
    assert with_credentials(b.tracking.uri) == "http://bob:bob-pass-22@mlflow-b.example:5000"
    assert with_credentials("https://mlflow-c.example/") == "https://mlflow-c.example/"
    assert credential_env("https://mlflow-c.example/") == {}
    plan = SimpleNamespace(device="cpu", processes_per_machine=1, num_machines=1)
    env = worker_env(SimpleNamespace(plan=plan, tracking_uri=b.tracking.uri))
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == ("bob", "bob-pass-22")


@pytest.mark.parametrize(
    "override",
    [
        "output=s3://AKIAXX:secret-key-1@bucket/runs",
        "data.path=https://u:secret-key-2@host/d.jsonl",
        "base=s3://a:secret-key-3@b/m",
    ],
)
def test_a_password_in_a_store_url_is_refused_and_never_echoed(override):
    from ladle.config import ConfigError, load_config

    field = override.split("=", 1)[0]
    with pytest.raises(ConfigError) as refused:
        load_config("recipes/tiny-cpu.yaml", [override])
    said = str(refused.value)
    assert f"{field}'s URL carries a password" in said and "secret-key" not in said and ":***@" in said


def test_the_mlflow_block_keeps_its_uri_secret():
    from ladle.blocks import MlflowServer

    block = MlflowServer(tracking_uri="https://ops:hunter2-secret@mlflow.example")
    assert "hunter2" not in repr(block) and "hunter2" not in block.model_dump_json()
    assert block.tracking_uri.get_secret_value().endswith("@mlflow.example")


def test_mlflows_client_sends_each_server_its_own_credentials(monkeypatch):
    """Through MLflow's own client and HTTP stack: two tracking servers read from two configs in one process
    each receive their own basic-auth pair, and neither the other's."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from ladle.config import load_config
    from ladle.lifecycle.mlflow_client import client

    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    seen: dict[int, list] = {}

    class Registry(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            pair = self.headers.get("Authorization", "")
            seen.setdefault(self.server.server_address[1], []).append(
                base64.b64decode(pair.split()[1]).decode() if pair else None
            )
            body = json.dumps({"registered_models": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = [HTTPServer(("127.0.0.1", 0), Registry) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ports = [s.server_address[1] for s in servers]
        a = load_config("recipes/tiny-cpu.yaml", [f"tracking.uri=http://ann:ann-pass-1@127.0.0.1:{ports[0]}"])
        b = load_config("recipes/tiny-cpu.yaml", [f"tracking.uri=http://bob:bob%40pass-2@127.0.0.1:{ports[1]}"])
        client(a.tracking.uri).search_registered_models()
        client(b.tracking.uri).search_registered_models()
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert seen == {ports[0]: ["ann:ann-pass-1"], ports[1]: ["bob:bob@pass-2"]}
