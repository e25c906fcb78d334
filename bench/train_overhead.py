"""Orchestration overhead of the train stage: through the Prefect flow vs a bare `accelerate launch`.

    .venv/bin/python bench/train_overhead.py [--steps 80] [--reps 3]

Same prepared dataset, same plan, same worker; the two variants alternate so
machine drift hits both. Reported: real (non-padding) tokens/s measured by the
worker over its training steps, and the wall time of the whole stage. The
ratio flow/bare is the figure of merit (target >= 0.98 for tokens/s).
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
from common import save, train_spec  # noqa: E402

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow  # noqa: E402

from ladle.config import build_config  # noqa: E402
from ladle.lifecycle import tracking  # noqa: E402
from ladle.machine.topology import probe  # noqa: E402
from ladle.platform import storage  # noqa: E402
from ladle.tasks.train import train_task  # noqa: E402
from ladle.train.run import free_port, worker_env  # noqa: E402
from ladle.train.spec import TrainResult, TrainSpec  # noqa: E402


def bare(spec: TrainSpec) -> tuple[TrainResult, float]:
    spec_file = Path(spec.run_url) / "spec.json"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(spec.model_dump_json())
    began = time.perf_counter()
    subprocess.run(
        spec.plan.launcher_argv([str(spec_file)], port=free_port()),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=worker_env(spec),
    )
    wall = time.perf_counter() - began
    return TrainResult.model_validate(storage.read_json(storage.join(spec.run_url, "train_result.json"))), wall


@flow(name="bench-train")
def through_flow(spec: TrainSpec, track: tracking.Tracking) -> tuple[TrainResult, float]:
    began = time.perf_counter()
    result = train_task(spec.config, spec.plan, spec.dataset, spec.run_url, track)
    return result, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(
            {
                "base": "ladle://tiny-llama",
                "data": {"path": "ladle://demo-alpaca"},
                "output": tmp,
                "training": {
                    "max_steps": args.steps,
                    "lr": 3e-3,
                    "lora": {"r": 16, "target_modules": "all-linear", "modules_to_save": ["lm_head", "embed_tokens"]},
                },
            },
            [],
        )
        prepared = train_spec(cfg, Path(tmp), "runs", topo=probe())
        track = tracking.start_run(cfg, None, "bench-train-overhead")
        rows = []
        for rep in range(args.reps):
            for variant in ("bare", "flow") if rep % 2 == 0 else ("flow", "bare"):
                run_url = f"{tmp}/runs/{variant}-{rep}"
                spec = prepared.model_copy(update={"run_url": run_url})
                result, wall = bare(spec) if variant == "bare" else through_flow(spec, track)
                rows.append({"variant": variant, "rep": rep, "tokens_per_s": result.tokens_per_s, "stage_wall_s": wall})
                print(f"rep {rep} {variant:<4} {result.tokens_per_s:8.0f} tok/s  stage {wall:6.2f} s", flush=True)
    med = {
        v: {k: statistics.median(r[k] for r in rows if r["variant"] == v) for k in ("tokens_per_s", "stage_wall_s")}
        for v in ("bare", "flow")
    }
    ratio_tps = med["flow"]["tokens_per_s"] / med["bare"]["tokens_per_s"]
    ratio_wall = med["bare"]["stage_wall_s"] / med["flow"]["stage_wall_s"]
    print(f"\n{'':<6}{'tokens/s':>10}{'stage s':>10}")
    for v in ("bare", "flow"):
        print(f"{v:<6}{med[v]['tokens_per_s']:>10.0f}{med[v]['stage_wall_s']:>10.2f}")
    print(f"ratio flow/bare tokens/s: {ratio_tps:.3f}   wall-time speed ratio bare/flow: {ratio_wall:.3f}")
    print(
        "saved",
        save(
            "train_overhead",
            {
                "steps": args.steps,
                "rows": rows,
                "median": med,
                "ratio_tokens_per_s": ratio_tps,
                "ratio_wall": ratio_wall,
            },
        ),
    )


if __name__ == "__main__":
    main()
