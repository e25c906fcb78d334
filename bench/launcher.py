"""ladle's CPU launcher (ranks forked from one process that imported their libraries once) vs ``accelerate launch``
(torchrun starting each rank as a new interpreter), same plan, same worker, same arguments.

    .venv/bin/python bench/launcher.py [--reps 4] [--strategies ddp,zero3] [--processes 2]

Each launch is a short run of the tiny model (6 LoRA steps, so start-up dominates, as in most of the test
suite and any short CPU job); the variants alternate so machine drift hits both. Reported per launch: wall time,
the CPU time of the launcher and every rank (``RUSAGE_CHILDREN``), and the losses (the same for both: the
launcher changes how ranks start, not what they compute). Ratios are ladle / accelerate.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

from ladle.platform import storage  # noqa: E402
from ladle.train.run import free_port, worker_env, write_spec  # noqa: E402
from ladle.train.spec import TrainResult  # noqa: E402
from tests.helpers import strategy_spec  # noqa: E402


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def once(spec, module: str, command=None) -> dict:
    """One launch of ``spec`` by ``python -m MODULE`` (its argv through ``command`` when given): wall, CPU, losses."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = write_spec(spec, tmp)
        argv = spec.plan.launcher_argv([str(spec_file)], port=free_port())
        argv[2] = module
        argv = command(argv) if command else argv
        cpu, began = children_cpu(), time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=worker_env(spec))
        wall, cpu = time.perf_counter() - began, children_cpu() - cpu
    result = TrainResult.model_validate(storage.read_json(storage.join(spec.run_url, "train_result.json")))
    return {"wall_s": wall, "cpu_s": cpu, "losses": result.train_losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--strategies", default="ddp,zero3")
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-launcher-"))
    rows = {}
    for name in args.strategies.split(","):
        spec = strategy_spec(name, root, f"parallelism.cpu_processes={args.processes}")
        runs: dict[str, list[dict]] = {"accelerate": [], "ladle": []}
        for _ in range(args.reps):
            runs["accelerate"].append(once(spec, "accelerate.commands.launch"))
            runs["ladle"].append(once(spec, "ladle.train.launch"))
        same = all(r["losses"] == runs["accelerate"][0]["losses"] for v in runs.values() for r in v)
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "cpu_s")} for k, v in runs.items()}
        rows[name] = {
            **{f"{k}_{m}": round(v[m], 2) for k, v in med.items() for m in v},
            "wall_ratio": round(med["ladle"]["wall_s"] / med["accelerate"]["wall_s"], 3),
            "cpu_ratio": round(med["ladle"]["cpu_s"] / med["accelerate"]["cpu_s"], 3),
            "same_losses": same,
        }
        print(name, rows[name], flush=True)
    print(save("launcher", {"reps": args.reps, "processes": args.processes, "rows": rows}))


if __name__ == "__main__":
    main()
