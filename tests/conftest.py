"""Shared fixtures. Real components throughout: gloo processes, SQLite MLflow,
a moto S3 server on 127.0.0.1, Prefect's test harness or its ephemeral server."""

from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ladle.platform.processes import stop_process  # noqa: F401 - the suite's one shutdown path

_SESSION = Path(tempfile.mkdtemp(prefix="ladle-tests-"))
# Set before anything imports prefect, and inherited by every subprocess.
os.environ["LADLE_HOME"] = str(_SESSION / "ladle-home")
# What ladle creates on first use in its home (the tiny model, the demo data, a GGUF base's converted folder)
# is one folder for the whole run: made by the first process that asks (its lock keeps a second from making
# it again at the same time), used by every pytest-xdist worker. The process that made the folder (the xdist
# controller, whose workers inherit the variable) removes it at the end. Run records and caches stay per worker.
_OWNS_SHARED = "LADLE_TESTS_SHARED" not in os.environ
if _OWNS_SHARED:
    os.environ["LADLE_TESTS_SHARED"] = tempfile.mkdtemp(prefix="ladle-tests-shared-")
for _name in ("assets", "models"):
    (Path(os.environ["LADLE_TESTS_SHARED"]) / _name).mkdir(exist_ok=True)
    (_SESSION / "ladle-home").mkdir(parents=True, exist_ok=True)
    (_SESSION / "ladle-home" / _name).symlink_to(Path(os.environ["LADLE_TESTS_SHARED"]) / _name)
os.environ["PREFECT_HOME"] = str(_SESSION / "prefect-home")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["MPLBACKEND"] = "Agg"


def pytest_configure(config):
    """The session's environment, set before any test module imports torch: GPUs hidden for the CPU suite
    on a GPU host, and each xdist worker's share of the cores. Collection (which imports torch, transformers
    and the rest) runs with the cyclic collector paused, as ladle's own processes import (``ladle.platform.
    startup``): 10-11 s instead of 15 s on 2 cores."""
    if not is_xdist_controller(config):  # the controller collects nothing: its collector stays on
        gc.disable()
    hide_gpus(config)
    share_cores(config)


def pytest_collection_finish(session):
    """What collection imported is frozen (kept out of every later collection) and the collector is back on."""
    gc.freeze()
    gc.enable()


def is_xdist_controller(config) -> bool:
    return getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


def share_cores(config) -> None:
    """Each pytest-xdist worker gets its share of the cores, for its own compute and every process it starts
    (training ranks, flow runs, servers), as ladle gives each training rank its share. With all cores per
    process, two workers' processes oversubscribe the machine and OpenMP's spinning threads wait on each
    other: measured on 2 cores, a one-process tiny training run beside the other worker took 24.5 s instead
    of 1.6 s (same losses). A user's OMP_NUM_THREADS wins.

    One worker (plain ``pytest``, or ``-n 1``) sets nothing: its share would be every core, and ladle's launcher
    takes an OMP_NUM_THREADS it finds as the user's value for every rank, where unset it gives each rank its own
    share. Set to 2 on 2 cores, the strategies module's two concurrent 2-rank launches ran 8 spinning threads and
    its fixture took 240 s instead of 28 s."""
    if is_xdist_controller(config):
        return  # its workers, started after this hook, set their own
    from ladle.machine.topology import usable_cores

    workers = config.workerinput["workercount"] if hasattr(config, "workerinput") else 1
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores(os.environ) // workers)))


def hide_gpus(config) -> None:
    """On a host with NVIDIA GPUs, a session that does not select the ``gpu`` marker is the CPU suite: it
    hides the GPUs (``CUDA_VISIBLE_DEVICES=""``, inherited by every process it starts), so that ladle's probe
    and torch see a CPU host and its tests (gloo ranks, the CPU-only refusals) mean what they do on one.
    ``pytest -m gpu`` keeps them visible. A host without ``nvidia-smi`` is left as it is."""
    selects_gpu = re.search(r"(?<!not )\bgpu\b", config.option.markexpr or "") is not None
    if shutil.which("nvidia-smi") and not selects_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_sessionfinish(session, exitstatus):
    """No process outlives the suite: any left is listed, killed, and fails the run.

    Under pytest-xdist each worker checks its own children and reports what it killed to the controller
    (``workeroutput``, read in ``pytest_testnodedown``), whose exit status it fails; the controller's own
    children are those workers, which xdist stops after this hook, so the controller checks nothing itself.
    """
    import psutil

    if _OWNS_SHARED:
        shutil.rmtree(os.environ["LADLE_TESTS_SHARED"], ignore_errors=True)
    if is_xdist_controller(session.config):
        shutil.rmtree(_SESSION, ignore_errors=True)
        if LEAKS:
            print(f"\nprocesses left running by the suite (killed): {'; '.join(LEAKS)}", file=sys.stderr)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return
    # multiprocessing's resource tracker and fork server (``run_ranks`` starts ranks from one) are the
    # interpreter's own helpers: each exits when this process does (its pipe closes), so neither is a leak.
    pool = POOL[0] if POOL else None

    def running() -> list:
        children = psutil.Process().children(recursive=True)
        return [p for p in children if not is_multiprocessing_helper(p) and (pool is None or p.pid != pool.pid)]

    left = running()
    if left:  # an ended process its parent has not reaped yet (the pool reaps every 0.2 s) is not a leak
        time.sleep(1.0)
        left = running()
    if left:
        names = [f"{p.pid}: {describe(p)}" for p in left]
        print(f"\nprocesses left running by the suite (killed): {'; '.join(names)}", file=sys.stderr)
        for proc in left:
            proc.kill()
        psutil.wait_procs(left, timeout=10)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if hasattr(session.config, "workeroutput"):
            session.config.workeroutput["leaks"] = names
    if pool is not None:  # after the check: what it forked and left running was counted above
        stop_process(pool, 10)
    shutil.rmtree(_SESSION, ignore_errors=True)


POOL: list[subprocess.Popen] = []  # this process's server pool, stopped after the leak check


@pytest.fixture(scope="session", autouse=True)
def server_pool():
    """The model servers this process starts (deploys, restarts, the fleet's swaps) fork from one warm pool
    (``ladle.serve.pool``), as a host's servers do where one runs: each start costs the model's load, not the
    imports. Started without waiting: until its socket answers, a server starts cold. Stopped after the leak
    check (``pytest_sessionfinish``), so a server it forked and a test left running is still found."""
    from ladle.serve import pool

    socket_path = _SESSION / "server-pool.sock"
    log = (_SESSION / "server-pool.log").open("w")
    POOL.append(
        subprocess.Popen(
            [sys.executable, "-m", "ladle.serve.pool", "--socket", str(socket_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    )
    log.close()
    os.environ[pool.ENV] = str(socket_path)
    yield


LEAKS: list[str] = []  # in the xdist controller: what the workers killed


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    LEAKS.extend(getattr(node, "workeroutput", {}).get("leaks", []))


def is_multiprocessing_helper(proc) -> bool:
    """The resource tracker or the fork server itself: this process's own child. What the fork server forked
    (ranks, warm launchers: ``tests/warm_launch.py``) shows the same command line and is not a helper."""
    import psutil

    try:
        command = " ".join(proc.cmdline())
        helper = (
            "multiprocessing.resource_tracker" in command or "from multiprocessing.forkserver import main" in command
        )
        return helper and proc.ppid() == os.getpid()
    except psutil.Error:
        return False


def describe(proc) -> str:
    import psutil

    try:
        return " ".join(proc.cmdline())[:160]
    except psutil.Error as exc:  # a zombie nobody reaped is a leak too
        return f"({exc.__class__.__name__}, parent {proc.ppid()})"


@pytest.fixture(autouse=True)
def no_environment_leaks():
    """Whatever a test sets in os.environ (directly, or through code it calls) is undone after it."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def prefect_harness():
    """A real Prefect API (temporary server + database) for in-process flows, shared by the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from ladle.assets import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def demo_data() -> Path:
    from ladle.assets import demo_data_file

    return demo_data_file()


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server bound to 127.0.0.1; yields the env that points boto/s3fs at it."""
    from ladle.platform.processes import free_port

    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            client.create_bucket(Bucket="ladle")
            break
        except Exception:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.3)
    yield env
    stop_process(proc)


@pytest.fixture(scope="session")
def tool_caller() -> Path:
    """A tiny model taught to call the calculator, with a Hermes template (``tests/agents/tool_caller.py``): made
    once per test run in the workers' shared assets (named by the teaching code's digest), by one worker while
    another waits for it."""
    import hashlib
    import inspect

    from ladle.platform.files import one_builder
    from ladle.platform.home import ladle_home
    from tests.agents import tool_caller as made

    digest = hashlib.sha256(inspect.getsource(made).encode()).hexdigest()[:12]
    folder = ladle_home() / "assets" / f"tool-caller-{digest}"
    with one_builder(folder, deadline_s=300):
        if not (folder / "config.json").is_file():
            made.teach(folder.with_name(folder.name + ".tmp"))
            folder.with_name(folder.name + ".tmp").rename(folder)
    return folder
