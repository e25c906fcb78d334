"""ladle's process start-ups with the cyclic collector paused during their imports (``ladle.platform.startup``) vs
the same code with it left on, side by side, alternating.

    .venv/bin/python bench/startup.py [--reps 3] [--strategies ddp,zero3]

The baseline runs the very same entry point in a process where ``gc.disable`` and ``gc.freeze`` do nothing (so
the collector runs through the imports, as Python's default has it); nothing else differs. Three start-ups:

- the fork launcher: a short 2-rank run of the tiny model (6 LoRA steps), wall and CPU of the launcher and its
  ranks (``RUSAGE_CHILDREN``), and the losses (the collector changes when memory is scanned, not what is
  computed);
- the temporary Prefect API server ``ladle run`` starts: seconds to its first healthy answer, and its CPU by then
  (its database already made, as on every run after a machine's first);
- a model server (``python -m ladle.serve`` on the tiny model): seconds to ``/health``.

And the processes that import as they go, with the collector's thresholds raised (``raise_thresholds``) vs
Python's default (``gc.set_threshold`` made a no-op; nothing else differs): ``ladle`` commands (``model list``
on a SQLite store, ``data prepare`` of the demo recipe, ``plan``), and the libraries a flow run's stages
import (a Prefect worker's flow-run process: the engine, the flow, torch, transformers, peft, MLflow).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402
from launcher import once  # noqa: E402

from ladle.platform.processes import free_port, stop_process  # noqa: E402
from tests.helpers import strategy_spec  # noqa: E402

# The baseline: the collector left on through everything (ladle's pause and freeze made no-ops), then the module run.
COLLECTOR_ON = (
    "import gc, runpy, sys; gc.disable = lambda: None; gc.freeze = lambda: None; "
    "module = sys.argv.pop(1); sys.argv[0] = module; runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def command(variant: str, module: str, args: list[str]) -> list[str]:
    if variant == "paused":
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-c", COLLECTOR_ON, module, *args]


def launch_once(spec, variant: str) -> dict:
    return once(spec, "ladle.train.launch", lambda argv: command(variant, "ladle.train.launch", argv[3:]))


def until_healthy(argv: list[str], url: str, env: dict, deadline_s: float = 120) -> dict:
    import httpx
    import psutil

    began = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.perf_counter() - began > deadline_s:
                raise RuntimeError(f"{' '.join(argv[:6])} never answered {url}")
            time.sleep(0.02)
        wall = time.perf_counter() - began
        times = psutil.Process(proc.pid).cpu_times()
        return {"wall_s": wall, "cpu_s": times.user + times.system}
    finally:
        stop_process(proc)


def prefect_once(variant: str, home: Path) -> dict:
    port = free_port()
    args = ["prefect.server.api.server", "--", "-m", "uvicorn"] if variant == "paused" else []
    args += ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--log-level", "error", "--lifespan", "on"]
    if variant == "paused":
        argv = [sys.executable, "-m", "ladle.platform.startup", *args]
    else:  # the command Prefect's own SubprocessASGIServer runs
        argv = [sys.executable, "-m", "uvicorn", *args]
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    return until_healthy(argv, f"http://127.0.0.1:{port}/api/health", env)


def serve_once(variant: str, model: Path) -> dict:
    port = free_port()
    argv = command(variant, "ladle.serve", ["--model", str(model), "--name", "tiny", "--port", str(port)])
    return until_healthy(argv, f"http://127.0.0.1:{port}/health", dict(os.environ))


THRESHOLDS_OFF = "import gc; gc.set_threshold = lambda *a: None; "
CLI = "import sys; from ladle.cli.main import main; sys.argv = ['ladle', *sys.argv[1:]]; main()"
FLOW_RUN = (
    "import os; os.environ['PREFECT__FLOW_RUN_ID'] = 'bench'; "
    "from ladle.platform.startup import flow_run_process; flow_run_process(); "
    "import prefect.engine, ladle.flows.recipe, torch, transformers, peft, mlflow.tracking, ladle.data.prepare, "
    "ladle.lifecycle.evaluate, ladle.lifecycle.merge; "
    "from transformers import AutoModelForCausalLM, AutoTokenizer"
)


def cpu_of(argv: list[str]) -> dict:
    """Wall and CPU seconds of one process run to its end (status 0)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": time.perf_counter() - began, "cpu_s": cpu}


def thresholds_rows(reps: int, root: Path) -> dict:
    store = f"sqlite:///{root / 'mlflow.db'}"
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from mlflow.tracking import MlflowClient; c = MlflowClient('{store}'); c.create_registered_model('tiny-cpu'); "
            f"c.create_model_version('tiny-cpu', source='{root}')",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    data = root / "rows.jsonl"
    data.write_text('{"instruction": "Add 1 and 2.", "output": "3"}\n' * 50)
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml")
    cases = {
        "ladle model list": [CLI, "model", "list", "tiny-cpu", "--tracking-uri", store, "--json"],
        "ladle data prepare": [CLI, "data", "prepare", recipe, "--set", f"data.path={data}", "--set", "output=OUT"],
        "ladle plan": [CLI, "plan", recipe, "--json"],
        "flow run's stage imports": [FLOW_RUN],
    }
    rows = {}
    for label, (code, *args) in cases.items():
        runs: dict[str, list[dict]] = {"on": [], "paused": []}  # "on": Python's default; "paused": raised
        for rep in range(reps):
            for variant, prefix in (("on", THRESHOLDS_OFF), ("paused", "")):
                fresh = [a.replace("OUT", str(root / f"out-{label[-7:]}-{variant}-{rep}")) for a in args]  # no cache
                runs[variant].append(cpu_of([sys.executable, "-c", prefix + code, *fresh]))
        rows[label] = medians(runs)
        print(label, rows[label], flush=True)
    return rows


def medians(runs: dict[str, list[dict]]) -> dict:
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "cpu_s")} for k, v in runs.items()}
    return {
        **{f"{k}_{m}": round(v[m], 2) for k, v in med.items() for m in v},
        "wall_ratio": round(med["paused"]["wall_s"] / med["on"]["wall_s"], 3),
        "cpu_ratio": round(med["paused"]["cpu_s"] / med["on"]["cpu_s"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--strategies", default="ddp,zero3")
    parser.add_argument("--only-thresholds", action="store_true", help="Only the raised-thresholds rows.")
    args = parser.parse_args()
    from ladle.assets import tiny_model_dir

    root = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    rows = thresholds_rows(args.reps, root)
    if args.only_thresholds:
        print(save("startup-thresholds", {"reps": args.reps, "rows": rows}))
        return
    for name in args.strategies.split(","):
        runs: dict[str, list[dict]] = {"on": [], "paused": []}
        for rep in range(args.reps):
            for variant in runs:  # each launch its own output folder: none resumes another's checkpoint
                spec = strategy_spec(name, root / f"{variant}-{rep}")
                runs[variant].append(launch_once(spec, variant))
        same = all(r["losses"] == runs["on"][0]["losses"] for v in runs.values() for r in v)
        rows[f"launch {name}"] = {**medians(runs), "same_losses": same}
        print(f"launch {name}", rows[f"launch {name}"], flush=True)
    home = root / "prefect-home"
    prefect_once("on", home)  # makes the database: not counted
    model = tiny_model_dir()
    for label, once_of in (("prefect api", lambda v: prefect_once(v, home)), ("serve", lambda v: serve_once(v, model))):
        runs = {"on": [], "paused": []}
        for _ in range(args.reps):
            for variant in runs:
                runs[variant].append(once_of(variant))
        rows[label] = medians(runs)
        print(label, rows[label], flush=True)
    print(save("startup", {"reps": args.reps, "rows": rows}))


if __name__ == "__main__":
    main()
