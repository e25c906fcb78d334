"""Wall time of the demo pipeline (`ladle run recipes/tiny-cpu.yaml`) after setup, per stage.

    .venv/bin/python bench/demo_stages.py [--runs 2]

Each run is the real CLI in a subprocess. "startup" is everything outside the
stages: interpreter and imports, config and input checks, waiting for the
Prefect temporary server, MLflow database creation, and shutdown. "api_up" is
when that server first answered (seconds after ladle started it) and
"api_waited" how long the run blocked on it; the rest overlapped with loading. The first run also creates the tiny model
(cached under LADLE_HOME) unless it already exists.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("probe", "plan", "prepare", "train", "merge", "evaluate", "deploy")


def one_run(out: Path) -> dict:
    ladle = Path(sys.executable).with_name("ladle")
    began = time.perf_counter()
    done = subprocess.run(
        [str(ladle), "run", str(ROOT / "recipes" / "tiny-cpu.yaml"), "--json", "--set", f"output={out}"],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"demo run failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    stages = summary["stage_seconds"]
    return {
        "wall": wall,
        **stages,
        "startup": wall - sum(stages.values()),
        "tokens_per_s": summary["tokens_per_s"],
        "api_up": summary["prefect_api_startup_s"] or 0.0,
        "api_waited": summary["prefect_api_waited_s"] or 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            runs.append(one_run(Path(tmp) / f"run{i}"))
    keys = ("wall", *STAGES, "startup", "api_up", "api_waited")
    median = {k: statistics.median(r[k] for r in runs) for k in keys}
    print(f"{'stage':<10} {'median s':>9} {'share':>7}   runs")
    for k in keys:
        print(
            f"{k:<10} {median[k]:>9.2f} {median[k] / median['wall']:>7.1%}   " + " ".join(f"{r[k]:.2f}" for r in runs)
        )
    print(f"train tokens/s (median): {statistics.median(r['tokens_per_s'] for r in runs):.0f}")
    print("saved", save("demo_stages", {"runs": runs, "median": median}))


if __name__ == "__main__":
    main()
