"""Helpers shared by the benchmarks: machine description and result files."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import train_spec  # noqa: E402, F401 - the suite's spec set-up, shared with the benches

OUT = Path(__file__).resolve().parent / "out"


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"
    )


def cpu_capability() -> str:
    """What the CPU can do for the numbers beside it: torch's kernel level and native bf16 (or not)."""
    import torch

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    bf16 = "native bf16" if flags & {"avx512_bf16", "amx_bf16"} else "no native bf16 (emulated, slow)"
    return f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {bf16}"


def save(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "cpu_capability": cpu_capability(), "date": dt.date.today().isoformat(), **payload}
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def random_llama(name: str, shape: dict) -> Path:
    """A random-init Llama of ``shape`` with the demo tokenizer, created once under $LADLE_HOME/assets/``name``
    (400 MB safetensors shards; nothing downloaded)."""
    from ladle.assets import ladle_home, tiny_model_dir
    from ladle.assets.demo import write_random_llama

    path = ladle_home() / "assets" / name
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_llama(path, tiny_model_dir(), **shape)
    return path


def wait(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; past ``timeout`` seconds the bench stops naming ``what``."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def answers(url: str) -> bool:
    """``url`` answers 200."""
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class FrontOverServer:
    """The demo's tiny model served by ``python -m ladle.serve`` behind ladle's front, on 127.0.0.1 in a
    ``LADLE_HOME`` of its own, the front pointed at the server (its argv and log given, so the front's supervisor
    can restart it). ``stop()`` stops the front and whatever server it serves now."""

    def __init__(self, tree: Path | None = None) -> None:
        """``tree``: serve with the ladle of another source tree (an earlier commit's worktree), front included."""
        import subprocess
        import tempfile

        from ladle.assets import tiny_model_dir
        from ladle.platform.processes import free_port

        self.home = Path(tempfile.mkdtemp())
        env = {**os.environ, "LADLE_HOME": str(self.home), "PREFECT_API_URL": ""}
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        self.model = tiny_model_dir()
        port, front_port = free_port(), free_port()
        self.argv = [
            sys.executable,
            "-m",
            "ladle.serve",
            "--model",
            str(self.model),
            "--name",
            "m",
            "--port",
            str(port),
        ]
        self.log = self.home / "server.log"
        with self.log.open("w") as out:
            self.server = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        self.front = subprocess.Popen(
            [sys.executable, "-m", "ladle.fleet.front", "--name", "m", "--port", str(front_port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        self.url, self.front_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{front_port}"
        self.record_file = self.home / "served" / "routers" / "m.json"

    def start(self) -> FrontOverServer:
        """Wait for both, then point the front at the server."""
        import httpx

        wait(lambda: answers(f"{self.url}/ready"), 120, "the server")
        wait(lambda: answers(f"{self.front_url}/health") and self.record_file.is_file(), 60, "the front")
        token = json.loads(self.record_file.read_text())["token"]
        body = {
            "url": self.url,
            "version": "1",
            "pid": self.server.pid,
            "model_dir": str(self.model),
            "argv": self.argv,
            "log": str(self.log),
        }
        answer = httpx.put(f"{self.front_url}/ladle/upstream", json=body, headers={"x-ladle-admin-token": token})
        answer.raise_for_status()
        return self

    def stop(self) -> None:
        from ladle.platform.processes import stop_pid

        current = json.loads(self.record_file.read_text()).get("upstream") if self.record_file.is_file() else None
        stop_pid(self.front.pid, 20, group=True)
        for pid in {self.server.pid, (current or {}).get("pid")} - {None}:
            stop_pid(pid, 20, group=True)


def launch_trl(script: Path, args: list[str]) -> tuple[list[dict], float]:
    """A TRL worker script on 2 CPU processes under ``accelerate launch --multi_gpu`` (gloo), each rank printing one
    ``TRL_RESULT {json}`` line; every rank's result and the wall seconds.

    Raises:
        SystemExit: the run failed, with its output's tail.
    """
    import subprocess
    import time

    from ladle.platform.processes import free_port

    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)), "TOKENIZERS_PARALLELISM": "false"}
    argv = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
        str(script), *args,
    ]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - began
    prefix = "TRL_RESULT "
    ranks = [json.loads(line.removeprefix(prefix)) for line in done.stdout.splitlines() if line.startswith(prefix)]
    if done.returncode != 0 or len(ranks) != 2:
        raise SystemExit(f"TRL run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return ranks, wall


def launch_grpo(cfg, tmp: Path, name: str) -> dict:
    """One GRPO run of ``cfg`` on this machine (its rewards' files read as a run reads them): its completion
    tokens, the seconds inside steps and their rate, the engine's seconds, each step's reward, its peak and wall."""
    import time

    from ladle import rewards
    from ladle.machine.topology import probe
    from ladle.train.run import launch

    spec = train_spec(cfg, tmp, name, topo=probe())
    spec = spec.model_copy(update={"reward_files": rewards.bundle(cfg.training.rl.rewards)})
    events: list[dict] = []
    began = time.perf_counter()
    result = launch(spec, on_progress=lambda e: events.append(e) if e["event"] == "step" else None)
    return {
        "tokens": result.real_tokens,
        "seconds": result.train_seconds,
        "tokens_per_s": result.tokens_per_s,
        "generation_s": sum(e["generation_s"] for e in events),
        "rewards": [e["reward"] for e in events],
        "peak_mib": result.peak_memory_mib,
        "wall_s": time.perf_counter() - began,
    }
