"""DeepSpeed-MII: what can be checked without a GPU (the architecture check read from the installed DeepSpeed,
the startup watchdog, the options that reach it), and the real deployment on a GPU (skipped without one)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from ladle.config import ServeConfig
from ladle.errors import LadleError
from ladle.serve.deploy import server_argv
from ladle.serve.fastgen import check_architecture, fastgen_head_sizes, fastgen_model_types, start_within
from tests.helpers import needs_gpus


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
    from ladle.serve.engine import Job
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
