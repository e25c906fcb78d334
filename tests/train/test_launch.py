"""ladle's CPU launcher (``python -m ladle.train.launch``), killed every way: a failed rank stops the others and
fails the launch with its code; SIGINT stops every rank, SIGTERM has them checkpoint their step and exit 75; a
launcher killed outright takes its ranks with it.
Each rank gets the environment ``accelerate launch`` and torchrun would give it. (Every other training test
launches through it too: the strategies' equalities, resume, multi-node, Slurm.)"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from ladle.platform.processes import free_port, stop_process
from ladle.train import launch as launcher
from ladle.train.run import launch, progress_events, start_launcher, worker_env, write_spec
from tests.helpers import strategy_spec

pytestmark = pytest.mark.pipeline


@pytest.fixture(scope="module")
def spec(tmp_path_factory, tiny_model):
    """A DDP run over 2 ranks long enough to be killed mid-way (its steps take ~0.05 s on 2 cores)."""
    return strategy_spec("ddp", tmp_path_factory.mktemp("launch"), "training.checkpoint_every=0", steps=100_000)


class Launch:
    """The launcher in its own session, as ``ladle.train.run.launch`` starts it; its output read by a thread."""

    def __init__(self, spec, tmp_path) -> None:
        spec_file = write_spec(spec.model_copy(update={"run_url": str(tmp_path / "run")}), str(tmp_path))
        argv = spec.plan.launcher_argv([str(spec_file)], port=free_port())
        self.proc = start_launcher(argv, spec)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self.read, daemon=True).start()

    def read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for_step(self, step: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.output)[-3000:]
                continue
            self.output.append(line)
            if any(e.get("event") == "step" and e["step"] >= step for e in progress_events(line)):
                return
        raise AssertionError(f"no step {step} in {timeout} s: {''.join(self.output)[-3000:]}")

    def ranks(self) -> list[psutil.Process]:
        children = psutil.Process(self.proc.pid).children()
        assert len(children) == 2, children
        return children

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout=timeout)
        time.sleep(0.2)  # the reader thread takes the last lines
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return code

    def close(self) -> None:
        stop_process(self.proc, grace_s=5, group=True)


def gone(procs: list[psutil.Process], timeout: float = 30) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


def test_a_failed_rank_stops_the_other_and_fails_the_launch_with_its_code(spec, tmp_path):
    run = Launch(spec, tmp_path)
    try:
        run.wait_for_step(2)
        ranks = run.ranks()
        assert sorted(p.name() for p in ranks) == ["ladle-rank0", "ladle-rank1"]
        ranks[1].send_signal(signal.SIGKILL)
        assert run.wait() == 128 + signal.SIGKILL
        assert gone(ranks)
        # rank 0 may have ended too by the launcher's next look (its collective lost a member): the killed rank
        # is still the one named first, and its signal is the launch's exit code
        assert "ladle launch: rank 1 was killed by SIGKILL" in "".join(run.output)
    finally:
        run.close()


@pytest.mark.parametrize(
    ("sig", "code", "said"),
    [
        # (SIGTERM, a cluster's stop, has the ranks checkpoint their step and exit 75: tests/train/test_resume.py)
        (signal.SIGINT, 128 + signal.SIGINT, "ladle launch: SIGINT: stopping 2 rank(s)"),
        # no handler runs: the kernel ends the ranks (PR_SET_PDEATHSIG)
        (signal.SIGKILL, -signal.SIGKILL, None),
    ],
    ids=["sigint", "sigkill"],
)
def test_a_stopped_or_killed_launcher_takes_every_rank_with_it(spec, tmp_path, sig, code, said):
    run = Launch(spec, tmp_path)
    try:
        run.wait_for_step(2)
        ranks = run.ranks()
        run.proc.send_signal(sig)  # the launcher alone, not its session
        assert run.wait() == code
        assert gone(ranks), [p.pid for p in ranks if p.is_running()]
        assert said is None or said in "".join(run.output)
    finally:
        run.close()


def test_each_rank_gets_accelerates_environment_and_torchruns_variables():
    port = str(free_port())
    argv = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port", port]
    worker = ["-m", "ladle.train.worker", "spec.json"]
    ranks, worker_args = launcher.rank_layout([*argv, "--mixed_precision", "bf16", "--dynamo_backend", "no", *worker])
    assert worker_args == ["spec.json"]
    assert [(r["RANK"], r["LOCAL_RANK"]) for r in ranks] == [("0", "0"), ("1", "1")]
    for env in ranks:
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
            "2",
            "2",
            "127.0.0.1",
            port,
        )
        assert (env["ACCELERATE_MIXED_PRECISION"], env["ACCELERATE_DYNAMO_BACKEND"]) == ("bf16", "NO")
        assert env["PATH"] == os.environ["PATH"]  # the launcher's own environment, as accelerate passes it on
    one, _ = launcher.rank_layout(["--cpu", "--num_processes", "1", *worker])
    assert len(one) == 1 and one[0]["ACCELERATE_USE_CPU"] == "True" and "RANK" not in one[0]
    # Across machines the plan keeps accelerate launch (torchrun's agents meet every node first); asked anyway:
    across = ["--multi_gpu", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.7"]
    with pytest.raises(launcher.LaunchRefused, match="across machines use accelerate launch"):
        launcher.rank_layout([*across, "--main_process_port", port, *worker])


def test_a_rank_of_several_threads_is_forked_and_trains_on_them(tmp_path, tiny_model, monkeypatch):
    """OpenMP (torch's) and OpenBLAS (numpy's) start their worker threads as they load when told to use more than
    one, and a fork copies none of them: the launcher loads them on one thread, so that a one-process CPU run with
    2 threads forks its rank (it used to find 2 threads running and start a new interpreter, 6 s more), and the
    rank sets its count back and trains on 2."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a user's value (each xdist worker sets its share, 1 here)
    spec = strategy_spec("ddp", tmp_path, "parallelism.cpu_processes=1", "training.checkpoint_every=0", steps=2)
    events, lines = [], []
    result = launch(spec, on_progress=events.append, on_line=lines.append)
    (start,) = [e for e in events if e.get("event") == "start"]
    assert (start["world_size"], start["threads"]) == (1, 2)
    assert not [line for line in lines if "ladle launch:" in line], lines
    assert len(result.train_losses) == 2


def test_another_program_is_refused_by_name():
    done = subprocess.run(
        [*launcher_python(), "--multi_gpu", "--num_processes", "2", "-m", "my.trainer", "x.json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "ladle launch: refused: it starts only `-m ladle.train.worker` (got 'my.trainer')" in done.stderr
    assert "Traceback" not in done.stderr


def launcher_python() -> list[str]:
    import sys

    return [sys.executable, "-m", "ladle.train.launch"]


# slow: launching ranks is proven in make test by the tests above; this adds the launcher's other start-up
# (new interpreters when a thread runs), which a Prefect task's process takes.
@pytest.mark.slow
def test_with_another_thread_running_the_ranks_start_as_new_interpreters(tmp_path, tiny_model):
    """A fork copies only the forking thread; with another one running (a library's pool) the launcher does not
    fork: it starts each rank as ``python -m ladle.train.worker`` would be, and the run trains as usual."""
    short = strategy_spec("ddp", tmp_path / "short", steps=2)
    spec_file = write_spec(short, str(tmp_path))
    argv = short.plan.launcher_argv([str(spec_file)], port=free_port())
    with_a_thread = (
        "import sys, threading; from ladle.train import launch; stop = threading.Event(); "
        "threading.Thread(target=stop.wait, daemon=True).start(); sys.exit(launch.main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [argv[0], "-c", with_a_thread, *argv[3:]],
        capture_output=True,
        text=True,
        env=worker_env(short),
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 other thread(s) running after the imports" in done.stderr
    assert "starting each rank as a new interpreter instead" in done.stderr
    assert '"event": "done"' in done.stdout
    assert "is deprecated" not in done.stdout + done.stderr  # libraries' own deprecations stay out of the run's log


def test_a_rank_keeps_its_session_until_the_process_ends(monkeypatch):
    """Freeing a rank's session mid-process can deadlock it (DDP's reducer frees a gloo group whose destructor
    joins the group's run loop with the GIL held, while the run loop waits for the GIL to free its last work's
    tensors: seen under load). The session stays referenced until the rank ends with ``os._exit``."""
    from ladle.train import worker

    session = object()
    monkeypatch.setattr(worker, "setup", lambda spec: session)
    monkeypatch.setattr(worker, "train_loop", lambda s: (0, 0.0))
    monkeypatch.setattr(worker, "finish", lambda s, tokens, seconds: "result")
    kept: list = []
    monkeypatch.setattr(worker, "KEPT", kept)
    assert worker.run(None) == "result"
    assert kept == [session]


def test_a_rank_that_fails_before_training_prints_the_error_and_exits_1(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ladle.train.worker", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "FileNotFoundError" in done.stderr
