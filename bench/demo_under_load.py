"""The demo on a busy machine: `ladle run recipes/tiny-cpu.yaml --json` N times while busy loops hog the cores.

    .venv/bin/python bench/demo_under_load.py [--runs 10] [--busy 2] [--probes 3]

Every run starts from an empty $LADLE_HOME and output folder (so it also
creates the tiny model and tokenizer), with `--busy` processes spinning in
pure-Python loops for the whole time. A run counts as a success when it exits 0
and its JSON summary says `ok`. It records, per run, the wall time, the embedded
Prefect API server's startup (process start to first healthy answer) and how
long the run actually waited for it (the rest overlapped with loading and
checking), and the demo's accuracy.

"Before" is measured under the same load with `--probes` starts of Prefect's own
temporary server (`SubprocessASGIServer().start()`, what a flow started lazily
before ladle owned the server), against the 20 s Prefect gave it by default.
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
BUSY = "while True:\n    pass\n"
PREFECT_DEFAULT_BUDGET_S = 20
PROBE = """
import time
from prefect.server.api.server import SubprocessASGIServer
began = time.perf_counter()
server = SubprocessASGIServer()
server.start(timeout=600)
print(round(time.perf_counter() - began, 2))
server.stop()
"""


def one_run(tmp: Path, index: int) -> dict:
    home, out = tmp / f"home{index}", tmp / f"out{index}"
    env = {**os.environ, "LADLE_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    ladle = Path(sys.executable).with_name("ladle")
    began = time.perf_counter()
    done = subprocess.run(
        [str(ladle), "run", str(ROOT / "recipes" / "tiny-cpu.yaml"), "--json", "--set", f"output={out}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    wall = round(time.perf_counter() - began, 1)
    try:
        summary = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        summary = {"status": "failed", "error": done.stderr[-500:]}
    ok = done.returncode == 0 and summary.get("status") == "ok"
    keys = (
        "prefect_api_startup_s",
        "prefect_api_waited_s",
        "eval_accuracy_before",
        "eval_accuracy_after",
        "answer_correct",
    )
    return {
        "ok": ok,
        "exit": done.returncode,
        "wall_s": wall,
        **{k: summary.get(k) for k in keys},
        "error": None if ok else summary.get("error", done.stderr[-500:]),
    }


def probe_prefect_lazy_start() -> float:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--busy", type=int, default=2)
    parser.add_argument("--probes", type=int, default=3)
    args = parser.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
    runs, probes = [], []
    try:
        for _ in range(args.probes):
            probes.append(probe_prefect_lazy_start())
            print(
                f"before: Prefect's temporary server answered after {probes[-1]:.1f} s "
                f"(its default budget: {PREFECT_DEFAULT_BUDGET_S} s)",
                flush=True,
            )
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                runs.append(one_run(Path(tmp), i))
                r = runs[-1]
                print(
                    f"run {i + 1}: {'ok' if r['ok'] else 'FAILED'} in {r['wall_s']} s; API server up after "
                    f"{r['prefect_api_startup_s']} s, waited {r['prefect_api_waited_s']} s; accuracy "
                    f"{r['eval_accuracy_before']} -> {r['eval_accuracy_after']}"
                    + (f"; {r['error']}" if not r["ok"] else ""),
                    flush=True,
                )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    ok = sum(r["ok"] for r in runs)
    starts = [r["prefect_api_startup_s"] for r in runs if r["prefect_api_startup_s"] is not None]
    waits = [r["prefect_api_waited_s"] for r in runs if r["prefect_api_waited_s"] is not None]
    print(f"\n{ok}/{len(runs)} runs succeeded with {args.busy} busy loops on {os.cpu_count()} cores")
    if probes:
        print(
            f"before (Prefect's lazy start): median {statistics.median(probes):.1f} s, max {max(probes):.1f} s; "
            f"{sum(p > PREFECT_DEFAULT_BUDGET_S for p in probes)}/{len(probes)} over its {PREFECT_DEFAULT_BUDGET_S} s budget"
        )
    if starts:
        print(
            f"after (ladle's early start): server up after median {statistics.median(starts):.1f} s (max {max(starts):.1f}); "
            f"the run waited median {statistics.median(waits):.1f} s (max {max(waits):.1f}); budget 180 s"
        )
    print(
        "saved",
        save("demo_under_load", {"busy": args.busy, "runs": runs, "succeeded": ok, "prefect_lazy_start_s": probes}),
    )


if __name__ == "__main__":
    main()
