"""Eval forwards at the training micro-batch against the planner's eval micro-batch (FSDP2, 2 CPU processes).

    .venv/bin/python bench/eval_batch.py [--reps 2]

The N-D bench's locally created random-init Llama (56M parameters), LoRA, FSDP2 on 2 gloo processes, packed
128-token rows, micro-batch 1, one training step, half the rows held out (eval before and after training).
Each run is timed whole (launch to result); the two settings alternate. Every FSDP2 forward all-gathers
every layer, so the eval's forward count is what `training.eval_micro_batch_size` changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save  # noqa: E402
from bench.nd import mid_model  # noqa: E402


def run(base: Path, eval_micro: str, root: Path) -> dict:
    from ladle.config import build_config
    from ladle.data.prepare import prepare
    from ladle.machine.topology import probe
    from ladle.plan.planner import make_plan
    from ladle.train.run import launch
    from ladle.train.spec import TrainSpec

    cfg = build_config(
        {
            "base": str(base),
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128, "eval_ratio": 0.5},
            "parallelism": {"strategy": "fsdp2"},
            "training": {
                "max_steps": 1,
                "micro_batch_size": 1,
                "eval_micro_batch_size": eval_micro,
                "checkpoint_every": 0,
            },
        },
        [],
    )
    plan = make_plan(cfg, probe(env={}, query_output=""), model=json.loads((base / "config.json").read_text()))
    dataset = prepare(cfg.data, base, str(root))
    spec = TrainSpec(config=cfg, plan=plan, dataset=dataset, base_dir=str(base), run_url=str(root / eval_micro))
    began = time.perf_counter()
    result = launch(spec)
    return {
        "eval_micro_batch": plan.eval_micro_batch_size,
        "eval_rows": dataset.eval_rows,
        "seconds": time.perf_counter() - began,
        "eval_loss_before": result.eval_loss_before,
        "peak_memory_mib": result.peak_memory_mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    base = mid_model()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for setting in ("1", "auto") if rep % 2 == 0 else ("auto", "1"):
                rows.append({"setting": setting, "rep": rep, **run(base, setting, Path(tmp) / f"rep{rep}")})
                print(json.dumps(rows[-1]), flush=True)
    med = {s: statistics.median(r["seconds"] for r in rows if r["setting"] == s) for s in ("1", "auto")}
    print(f"median seconds: micro 1 {med['1']:.1f}, auto {med['auto']:.1f} ({med['1'] / med['auto']:.2f}x)")
    save("eval_batch", {"rows": rows, "median_seconds": med})


if __name__ == "__main__":
    main()
