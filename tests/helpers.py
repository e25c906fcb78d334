"""What several test modules (and the bench scripts) share: recorded machines, published model
shapes, the CLI runner, and the train-spec set-up. Test modules import from here, never from each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

# -- recorded machines ------------------------------------------------------------------------------

# Recorded from `nvidia-smi --query-gpu=index,name,memory.total,compute_cap --format=csv,noheader,nounits`
# on an 8x A100 SXM4 80GB node.
A100_X8 = "\n".join(f"{i}, NVIDIA A100-SXM4-80GB, 81920, 8.0" for i in range(8)) + "\n"
T4_X2 = "0, Tesla T4, 15360, 7.5\n1, Tesla T4, 15360, 7.5\n"


LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def visible_gpus() -> int:
    """CUDA GPUs this session may use, as ladle's probe counts them (after ``CUDA_VISIBLE_DEVICES``, which
    ``conftest.py`` empties for a session that does not select the ``gpu`` marker)."""
    from ladle.machine.topology import probe

    return probe().gpu_count


def needs_gpus(n: int = 1):
    """A mark that skips a test unless this session sees at least ``n`` CUDA GPUs."""
    import pytest

    have = visible_gpus()
    return pytest.mark.skipif(
        have < n, reason=f"needs {n} CUDA GPU(s), this session sees {have} (on a GPU host: pytest -m gpu)"
    )


def matrix(
    links: list[list[str]],
    nics: dict[str, list[str]] | None = None,
    affinity: list[tuple[str, str]] | None = None,
    gpu_numa: bool | list[str] = False,
    sep: str = "\t",
) -> str:
    """Render a matrix the way nvidia-smi lays it out."""
    n = len(links)
    nics = nics or {}
    names = [f"GPU{i}" for i in range(n)] + list(nics)
    header = (
        [""] + names + (["CPU Affinity", "NUMA Affinity"] if affinity else []) + (["GPU NUMA ID"] if gpu_numa else [])
    )
    lines = [sep.join(header)]
    for i, row in enumerate(links):
        cells = [f"GPU{i}", *row, *[nics[k][i] for k in nics]]
        if affinity:
            cells += list(affinity[i])
        if gpu_numa:
            cells.append(gpu_numa[i] if isinstance(gpu_numa, list) else "N/A")
        lines.append(sep.join(cells))
    for k, col in nics.items():
        lines.append(sep.join([k, *col, *["X" if k == j else "SYS" for j in nics]]))
    return "\n".join(lines) + "\n" + LEGEND


def full(n: int, code: str) -> list[list[str]]:
    return [["X" if i == j else code for j in range(n)] for i in range(n)]


NVSWITCH_8 = matrix(
    full(8, "NV18"),
    nics={f"NIC{k}": ["PXB" if i // 2 == k else "SYS" for i in range(8)] for k in range(4)},
    affinity=[("0-47,96-143", "0")] * 4 + [("48-95,144-191", "1")] * 4,
    gpu_numa=True,
)
PAIRS_4 = matrix(
    [["X", "NV4", "PHB", "PHB"], ["NV4", "X", "PHB", "PHB"], ["PHB", "PHB", "X", "NV4"], ["PHB", "PHB", "NV4", "X"]],
    affinity=[("0-15", "0")] * 2 + [("16-31", "1")] * 2,
)
PCIE_8 = matrix(
    [["X" if i == j else "NODE" if i // 4 == j // 4 else "SYS" for j in range(8)] for i in range(8)],
    affinity=[("0-23", "0")] * 4 + [("24-47", "1")] * 4,
    sep="    ",
)
CONSUMER_2 = matrix(full(2, "PHB"), affinity=[("0-15", "N/A")] * 2)


# -- published model shapes ------------------------------------------------------------------------

# Published hyperparameters of real models (from their config.json files).
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


# -- processes and the CLI -------------------------------------------------------------------------


def stop_pid(pid: int, grace_s: float = 15.0) -> None:
    """``stop_process`` for a process known only by its pid (e.g. a server left running on purpose)."""
    from ladle.platform.processes import stop_pid as stop

    stop(pid, grace_s)


def run_cli(
    *args: str, env: dict | None = None, timeout: int = 900, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run the installed ``ladle`` command in a subprocess."""
    exe = Path(sys.executable).with_name("ladle")
    return subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd or ROOT,
    )


def assert_clean_error(done, *fragments: str) -> str:
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


# -- models and training ---------------------------------------------------------------------------


def offline_greedy(model_dir, messages, max_new_tokens):
    """The greedy answer ladle's own evaluation gets for ``messages`` (``greedy_answers``: transformers'
    ``generate`` through the chat template, one prompt, no padding): what a server must answer too. One
    generation path for evaluation and the tests that compare a server with it."""
    from ladle.lifecycle.evaluate import greedy_answers

    return greedy_answers(Path(model_dir), [messages], 1, lambda tokenizer, rows: max_new_tokens)[0]


def train_spec(cfg, root: Path, run: str = "run", topo=None):
    """A ``TrainSpec`` for ``cfg``: planned for ``topo`` (default: this machine as a CPU host), its
    dataset prepared under ``root``, its outputs under ``root/run``."""
    from ladle.data.prepare import prepare
    from ladle.machine.topology import probe
    from ladle.plan.inputs import base_dir_of
    from ladle.plan.planner import make_plan
    from ladle.train.spec import TrainSpec

    base = base_dir_of(cfg)  # the run's base folder: with the config's chat_template, where it has one
    model = json.loads((base / "config.json").read_text(encoding="utf-8"))
    plan = make_plan(cfg, topo or probe(env={}, query_output=""), model=model)
    dataset = prepare(cfg.data, base, str(root), objective=cfg.training.objective)
    return TrainSpec(config=cfg, plan=plan, dataset=dataset, base_dir=str(base), run_url=str(Path(root) / run))


def launch_all(specs: dict, parallel: int = 2) -> dict:
    """``launch`` each spec, ``parallel`` at a time; results by the same keys.

    Two launches overlap well on 2 cores: most of a short run is process start-up (imports, gloo
    rendezvous, model load), not compute, and float32 results do not depend on what else runs.
    """
    from concurrent.futures import ThreadPoolExecutor

    from ladle.train.run import launch

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {key: pool.submit(launch, spec) for key, spec in specs.items()}
        return {key: future.result() for key, future in futures.items()}


def strategy_spec(strategy: str, root: Path, *overrides: str, steps: int = 6, topo=None):
    """The strategy suite's run: LoRA on every linear layer plus a trained head, global batch 8 = 2 micro x
    2 ranks x 2 accumulation (exercises no_sync), a checkpoint every 3 steps; outputs under a folder named
    after the strategy and overrides."""
    from ladle.config import build_config

    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "parallelism": {"strategy": strategy, "pipeline": {"allow_cpu": True}},
            "training": {
                "max_steps": steps,
                "lr": 3e-3,
                "micro_batch_size": 2,
                "global_batch_size": 8,
                "checkpoint_every": 3,
                "lora": {"target_modules": "all-linear", "modules_to_save": ["lm_head"]},
            },
        },
        list(overrides),
    )
    return train_spec(cfg, Path(root), strategy + "".join(overrides), topo)


def start_server(model_dir, log_path: Path, name: str = "tiny", **serve):
    """The server the deploy stage starts (its argv and readiness wait, for ``ServeConfig(**serve)``), in its
    own process group and ready; returns (process, url). The caller stops it (``stop_process(..., group=True)``).
    """
    from ladle.config import ServeConfig
    from ladle.fleet import deploy
    from ladle.platform.processes import free_port

    proc, url, _ = deploy.start_server(Path(model_dir), name, ServeConfig(**serve), free_port(), Path(log_path))
    try:
        deploy.wait_healthy(proc, url, 120, Path(log_path))
    except BaseException:
        proc.kill()
        raise
    return proc, url


# -- traffic through ladle's front ----------------------------------------------------------------


class Clients:
    """Threads that each run ``loop(arg)`` until stopped, recording outcomes in ``results``; a context manager that
    starts them and, on leaving, stops and joins them."""

    def __init__(self, args: list):
        self.stop_flag, self.results = threading.Event(), []
        self.threads = [threading.Thread(target=self.loop, args=(arg,), daemon=True) for arg in args]

    def loop(self, arg) -> None:
        raise NotImplementedError

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=60)


class Traffic(Clients):
    """Clients that send requests through the front without pause until stopped; they record every outcome."""

    def __init__(self, url: str, model: str, clients: int = 4, pause_s: float = 0.0):
        self.url, self.model, self.pause_s = url, model, pause_s
        super().__init__(list(range(clients)))
        # (time answered, version header or error, kind, time sent)
        self.results: list[tuple[float, str, str, float]] = []

    def loop(self, i: int) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "red blue"}], "max_tokens": 6}
        with httpx.Client(timeout=60) as client:
            while not self.stop_flag.is_set():
                stream, sent = i % 2 == 1, time.monotonic()
                try:
                    if stream:
                        with client.stream(
                            "POST", f"{self.url}/v1/chat/completions", json={**body, "stream": True}
                        ) as answer:
                            text = "".join(answer.iter_text())
                            ok = answer.status_code == 200 and text.rstrip().endswith("data: [DONE]")
                    else:
                        answer = client.post(f"{self.url}/v1/chat/completions", json=body)
                        ok = answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] is not None
                    outcome = answer.headers.get("x-ladle-model-version", "?") if ok else f"HTTP {answer.status_code}"
                except httpx.HTTPError as exc:
                    outcome = f"error {exc.__class__.__name__}: {exc}"
                self.results.append((time.monotonic(), outcome, "stream" if stream else "whole", sent))
                self.stop_flag.wait(self.pause_s)

    def failures(self) -> list:
        return [r for r in self.results if not r[1].isdigit()]

    def versions_after(self, t0: float) -> set[str]:
        return {r[1] for r in self.results if r[0] > t0}


def wait_for_requests(traffic: Traffic, n: int, timeout: float = 60) -> None:
    start, deadline = len(traffic.results), time.monotonic() + timeout
    while len(traffic.results) < start + n:
        assert time.monotonic() < deadline, f"no traffic went through: {traffic.results[-5:]}"
        time.sleep(0.1)


def deployments_file(folder: Path, feedback_threshold: int | None = None, **serving) -> Path:
    """deployments/prefect.yaml as an operator adapts it: ``serving`` parameters (front port, artifact store)
    set on the `champion` deployment and on its trigger, and the feedback trigger's threshold; written to
    ``folder/prefect.yaml``."""
    import yaml

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    champion = next(d for d in spec["deployments"] if d["name"] == "champion")
    champion["parameters"].update(serving)
    champion["triggers"][0]["parameters"].update(serving)
    if feedback_threshold is not None:
        on_feedback = next(d for d in spec["deployments"] if d["name"] == "tiny-cpu-on-feedback")
        on_feedback["triggers"][0]["threshold"] = feedback_threshold
        if "artifact_store" in serving:  # its runs' outputs in the operator's store too
            on_feedback["parameters"]["artifact_store"] = serving["artifact_store"]
    path = folder / "prefect.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_ranks(target, world: int, *args) -> list:
    """Start ``target(rank, world, port, queue, *args)`` in ``world`` spawned processes (a gloo group on a free
    port); returns what each put on the queue, once all have exited cleanly."""
    from ladle.platform.processes import free_port
    from tests.warm_launch import context

    # The fork server imports torch once (in a process that has run no torch op, so no OpenMP pool is forked);
    # each rank forks from it instead of importing torch again: ~2.2 s of CPU per rank under spawn.
    ctx = context()
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, queue, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def start_service(argv: list[str], health_url: str, home: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a server in its own session, logging to ``home/server.log``; return once ``health_url`` answers 200."""
    import pytest

    from ladle.platform.processes import stop_process

    with open(home / "server.log", "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(health_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc, grace_s=0, group=True)
            pytest.fail(f"{argv[0]} did not start:\n{(home / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)


def strict_crd_schema(path) -> dict:
    """A CustomResourceDefinition's pinned ``openAPIV3Schema`` as the API server applies it with strict field
    validation (``kubectl apply --validate=strict``, the default since Kubernetes 1.27): a field the schema does
    not declare is an error, except where it says ``x-kubernetes-preserve-unknown-fields``."""
    import json
    from pathlib import Path

    def close(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)
        return node

    schema = close(json.loads(Path(path).read_text()))
    schema["properties"].setdefault("status", {"type": "object"})
    return schema


_REGISTRY_TEMPLATE: list[Path] = []


def fresh_registry(folder: Path, name: str = "mlflow.db") -> str:
    """A new, empty MLflow store on SQLite at ``folder / name``; its URI. MLflow builds a new SQLite store by running
    its whole chain of schema migrations (2-5 s on these machines, more under load); this copies one empty store
    that this process migrated once, which is the same empty store. ``ladle run``'s own first store, and MLflow
    servers started without one, still migrate as a user's would (the demo, the pipeline tests)."""
    import atexit
    import shutil
    import tempfile

    if not _REGISTRY_TEMPLATE or not _REGISTRY_TEMPLATE[0].is_file():
        from mlflow.tracking import MlflowClient

        home = Path(tempfile.mkdtemp(prefix="ladle-registry-template-"))
        atexit.register(shutil.rmtree, home, True)
        template = home / "mlflow.db"
        MlflowClient(f"sqlite:///{template}").search_experiments()  # the migrations, once
        _REGISTRY_TEMPLATE[:] = [template]
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_REGISTRY_TEMPLATE[0], folder / name)
    return f"sqlite:///{folder / name}"
