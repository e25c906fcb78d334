"""A run told to stop under Slurm: steps lost, and the time from the signal to the requeued run training again.

    .venv/bin/python bench/preempt_slurm.py [--steps 40] [--at 10] [--signal USR1|TERM] [--cred-expire 5]

Starts the two-node local Slurm cluster the tests use (``tests/compute/slurm_cluster.py``; needs `make slurm`),
trains the tiny model through ``sbatch`` on both nodes (one rank each), and at step ``--at`` sends the job's steps
the signal a cluster sends (``scancel --signal=USR1``: the warning before a time limit; TERM: a preemption). It
records the step the ranks checkpointed, the step the requeued run resumed from (steps lost = checkpointed step -
resumed step; redone = steps trained twice), when the signal was sent, when the job went back to the queue, when
it ran again, and when the first step after the resume was reported. ``--cred-expire`` is the cluster's
``AuthInfo=cred_expire`` (Slurm holds a requeued job this long; 120 s by default, 5 s in the tests).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--at", type=int, default=10)
    parser.add_argument("--signal", default="USR1", choices=["USR1", "TERM"])
    parser.add_argument("--cred-expire", type=int, default=5)
    args = parser.parse_args()
    import os

    from ladle import compute
    from ladle.config import build_config
    from tests.compute import slurm_cluster
    from tests.helpers import train_spec

    original = slurm_cluster.config
    slurm_cluster.config = lambda *a: original(*a).replace("cred_expire=5", f"cred_expire={args.cred_expire}")
    cluster = slurm_cluster.LocalSlurm(Path(tempfile.mkdtemp(prefix="ladle-slurm-"))).start()
    os.environ.update({k: cluster.env[k] for k in ("SLURM_CONF", "PATH")})
    try:
        out = Path(tempfile.mkdtemp(prefix="ladle-bench-preempt-"))
        cfg = build_config(
            {
                "base": "ladle://tiny-llama",
                "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
                "output": str(out),
                "training": {"max_steps": args.steps, "micro_batch_size": 2},
                "parallelism": {"nodes": 2, "cpu_processes": 1},
                "compute": {"target": "slurm", "slurm": {"poll_interval_s": 0.2}},
            },
            [],
        )
        target = compute.get(cfg)
        spec = train_spec(cfg, out, "preempt", topo=target.probe())
        commands, marks, steps = [], {}, []

        def progress(event: dict) -> None:
            now = time.monotonic()
            if event["event"] == "step":
                steps.append(event["step"])
                if event["step"] == args.at and "signal" not in marks:
                    job = commands[0].split("Slurm job ")[1].split(",")[0]
                    marks["signal"] = now
                    subprocess.run(["scancel", f"--signal={args.signal}", job], env=cluster.env, check=True)
                elif "queued" in marks and "first_step_after" not in marks:
                    marks["first_step_after"] = now
            elif event["event"] == "preempted":
                marks["checkpointed"], marks["checkpointed_step"] = now, event["step"]
            elif event["event"] == "start" and "signal" in marks:
                marks["started_again"], marks["resumed_from"] = now, event["resumed_from"]

        def line(text: str) -> None:
            if "went back to the queue" in text and "queued" not in marks:
                marks["queued"] = time.monotonic()

        began = time.monotonic()
        result = target.run(spec, on_progress=progress, on_line=line, on_command=commands.append)
        total = time.monotonic() - began
    finally:
        cluster.stop()
        slurm_cluster.config = original
    signal_at = marks["signal"]
    trained = len(steps)
    report = {
        "machine": machine(),
        "signal": args.signal,
        "steps": args.steps,
        "signal_at_step": args.at,
        "checkpointed_step": marks.get("checkpointed_step"),
        "resumed_from_step": result.resumed_from_step,
        "steps_lost": (marks.get("checkpointed_step") or 0) - result.resumed_from_step,
        "steps_trained_twice": trained - args.steps,
        "signal_to_checkpoint_s": round(marks["checkpointed"] - signal_at, 2),
        "signal_to_back_in_queue_s": round(marks["queued"] - signal_at, 2),
        "signal_to_running_again_s": round(marks["started_again"] - signal_at, 2),
        "signal_to_first_step_after_s": round(marks["first_step_after"] - signal_at, 2),
        "cred_expire_s": args.cred_expire,
        "whole_run_s": round(total, 1),
    }
    print(json.dumps(report, indent=1))
    save("preempt_slurm", report)


if __name__ == "__main__":
    main()
