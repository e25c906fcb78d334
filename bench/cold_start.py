"""Cold start of `ladle plan` and `ladle probe` (target <= 1.0 s), side by side with baselines.

    .venv/bin/python bench/cold_start.py [--reps 7]

Each measurement is a fresh process (a new interpreter, nothing imported), run in
turn with the baselines: a bare `python -c pass`, and `python -c "import torch"`
-- what the fast path avoids. The plan sizes the 70B recipe for a recorded 8-GPU
NVSwitch machine from the shipped config.json (no torch, no transformers).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def timed(argv: list[str]) -> float:
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed: {done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.helpers import NVSWITCH_8

    ladle = str(Path(sys.executable).with_name("ladle"))
    with tempfile.TemporaryDirectory() as tmp:
        topo = Path(tmp) / "topo.txt"
        topo.write_text(NVSWITCH_8)
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "ladle plan (70B recipe, recorded 8-GPU machine)": [
                ladle,
                "plan",
                "recipes/llama3-70b-fsdp2.yaml",
                "--topology-file",
                str(topo),
                "--gpu-memory",
                "80",
                "--json",
            ],
            "ladle probe --topology-file": [ladle, "probe", "--topology-file", str(topo), "--json"],
            "ladle probe (this machine)": [ladle, "probe", "--json"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.reps):
            for name, argv in commands.items():
                times[name].append(timed(argv))
    base = statistics.median(times["python -c pass"])
    print(f"{'command':<50}{'median s':>10}{'max s':>8}{'vs python':>11}")
    rows = {}
    for name, values in times.items():
        med = statistics.median(values)
        rows[name] = {"median_s": med, "max_s": max(values), "vs_bare_python": med / base}
        print(f"{name:<50}{med:>10.3f}{max(values):>8.3f}{med / base:>11.1f}")
    print("saved", save("cold_start", {"reps": args.reps, "rows": rows}))


if __name__ == "__main__":
    main()
