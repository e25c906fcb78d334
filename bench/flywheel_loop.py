"""The data flywheel on SmolLM2-135M-Instruct, end to end on this machine (docs/howto/flywheel.md):

    .venv/bin/python bench/flywheel_loop.py [--out DIR]

1. ``ladle run recipes/smollm2-135m-flywheel-cpu.yaml``: v1, trained before any traffic, becomes champion;
2. ``ladle model serve`` it, with capture on; ``bench/flywheel_users.py`` asks it 24 questions it cannot know and
   corrects it, approves its colour-task answers, asks four questions nobody judges;
3. ``ladle data from-traffic``: the rows and what was dropped;
4. ``ladle run`` again: the corrections join the data, the challenger answers a replay of the champion's traffic
   (shadow evaluation) and the gate decides;
5. the new champion served, the users ask the corrected questions again (``--check``).

Prints one JSON object (saved to bench/out/flywheel.json): each step's figures and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "smollm2-135m-flywheel-cpu.yaml")
BIN = Path(sys.executable).parent


def run(argv: list[str], env: dict, what: str) -> tuple[dict, float]:
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    took = round(time.perf_counter() - began, 1)
    if done.returncode != 0:
        sys.exit(f"{what} failed ({done.returncode}):\n{done.stderr[-4000:]}\n{done.stdout[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="Output folder (default: a new temporary one).")
    parser.add_argument("--front-port", type=int, default=8611)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ladle-flywheel-"))
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    sets = ["--set", f"output={out}", "--set", f"serve.front_port={args.front_port}"]
    front = f"http://127.0.0.1:{args.front_port}"
    ladle, python = str(BIN / "ladle"), str(BIN / "python")
    users = [python, str(ROOT / "bench" / "flywheel_users.py"), "--front", front]
    result: dict = {"out": str(out)}

    v1, result["v1_s"] = run([ladle, "run", RECIPE, "--json", *sets], env, "the first run")
    result["v1"] = {k: v1.get(k) for k in ("promotion", "eval_before", "eval_after", "probe_before", "probe_after")}
    try:
        run([ladle, "model", "serve", RECIPE, "--json", *sets], env, "serving v1")
        result["users"], result["users_s"] = run(users, env, "the users")
        result["v1_check"], _ = run([*users, "--check"], env, "asking v1 again")
    finally:
        subprocess.run([ladle, "model", "stop", "smollm2-135m-flywheel-cpu"], env=env, capture_output=True, check=False)
    report, result["from_traffic_s"] = run([ladle, "data", "from-traffic", RECIPE, "--json", *sets], env, "curation")
    result["from_traffic"] = {k: report[k] for k in ("requests", "with_feedback", "rows", "dropped")}

    v2, result["v2_s"] = run([ladle, "run", RECIPE, "--json", *sets], env, "the run on traffic")
    keys = ("promotion", "promoted", "eval_before", "eval_after", "probe_before", "probe_after", "shadow")
    result["v2"] = {k: v2.get(k) for k in keys}
    if v2.get("promoted"):
        try:
            run([ladle, "model", "serve", RECIPE, "--json", *sets], env, "serving v2")
            result["v2_check"], _ = run([*users, "--check"], env, "asking v2")
        finally:
            subprocess.run(
                [ladle, "model", "stop", "smollm2-135m-flywheel-cpu"], env=env, capture_output=True, check=False
            )
    print(json.dumps(result, indent=2))
    save("flywheel", result)


if __name__ == "__main__":
    main()
