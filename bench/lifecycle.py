"""Lifecycle timings through a real Prefect server and process worker.

- Promotion event -> new version serving: two registered versions of the tiny model (the base, and a copy
  with a changed head) take turns as `champion` through `ladle model rollback --to`, which emits
  `ladle.model.promoted`; the `champion` deployment's trigger runs the serve flow, which swaps the version
  behind ladle's front. 4 clients send requests through the front the whole time: every failed request is
  counted. Each swap is split into: event -> flow run created (the automation), created -> running (the
  worker's poll and process start), running -> new version answering (model start, smoke test, switch).
- The nightly deployment with unchanged data: wall time of the flow run that ends "skipped", and from
  `prefect deployment run` to its Completed state.

Prefect's worker polls every PREFECT_WORKER_QUERY_SECONDS (10 s by default): it is run with the default,
and again with 2 s, to show what that setting costs.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SWAPS = 4


def wait_http(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer")


def served_version(front: str) -> str | None:
    try:
        return httpx.get(f"{front}/ready", timeout=2).json().get("version")
    except (httpx.HTTPError, ValueError):
        return None


def parse_time(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def run(query_seconds: str, work: Path, models: tuple[Path, Path]) -> dict:
    from ladle.assets import resolve_base
    from ladle.config import load_config
    from ladle.data.prepare import fingerprint
    from ladle.lifecycle import promote
    from ladle.platform.processes import free_port, stop_process
    from tests.helpers import Traffic, deployments_file

    work.mkdir(parents=True)
    port, front_port = free_port(), free_port()
    api = f"http://127.0.0.1:{port}/api"
    uri = f"sqlite:///{work / 'mlflow.db'}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(work / "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": query_seconds,
        "LADLE_REPO": str(ROOT),
        "MLFLOW_TRACKING_URI": uri,
    }
    procs = []
    try:
        with open(work / "server.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        wait_http(f"{api}/health")
        cfg = load_config("tiny-cpu", [f"serve.front_port={front_port}"])
        name = cfg.tracking.registered_model or cfg.name
        fp = fingerprint(cfg.data, resolve_base(cfg.base, cfg.training.dtype))
        for i, model in enumerate(models, 1):
            promote.register(
                uri, name, str(model), None, {"ladle.model_sha256": f"bench-{i}", "ladle.data_fingerprint": fp}
            )
        promote.promote(uri, name, "1", "bench")
        deployments_file(work, front_port=front_port)
        prefect = [str(BIN / "prefect")]
        subprocess.run(
            [*prefect, "work-pool", "create", "ladle-local", "--type", "process"],
            env=env,
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [*prefect, "--no-prompt", "deploy", "--all", "--prefect-file", str(work / "prefect.yaml")],
            env=env,
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        ladle = [str(BIN / "ladle")]
        subprocess.run(
            [*ladle, "model", "serve", "tiny-cpu", "--set", f"serve.front_port={front_port}"],
            env=env,
            check=True,
            capture_output=True,
        )
        front = f"http://127.0.0.1:{front_port}"
        with open(work / "worker.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [*prefect, "worker", "start", "--pool", "ladle-local"],
                    env=env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        time.sleep(3)
        swaps = []
        with Traffic(front, name) as traffic:
            for i in range(SWAPS):
                target = "2" if i % 2 == 0 else "1"
                t0 = time.time()
                subprocess.run(
                    [*ladle, "model", "rollback", name, "--to", target], env=env, check=True, capture_output=True
                )
                t_event = time.time()
                while served_version(front) != target:
                    if time.time() - t_event > 300:
                        raise RuntimeError(f"v{target} never served; see {work / 'worker.log'}")
                    time.sleep(0.05)
                t_served = time.time()
                runs = httpx.post(
                    f"{api}/flow_runs/filter", json={"sort": "EXPECTED_START_TIME_DESC", "limit": 1}, timeout=10
                ).json()
                flow_run = runs[0]
                started = parse_time(flow_run["start_time"]) if flow_run.get("start_time") else float("nan")
                swaps.append(
                    {
                        "to": target,
                        "event_to_serving_s": round(t_served - t_event, 2),
                        "event_to_flow_run_created_s": round(parse_time(flow_run["created"]) - t_event, 2),
                        "created_to_running_s": round(started - parse_time(flow_run["created"]), 2),
                        "running_to_serving_s": round(t_served - started, 2),
                        "rollback_command_s": round(t_event - t0, 2),
                    }
                )
                time.sleep(2)
        failures = traffic.failures()
        t0 = time.time()
        out = subprocess.run(
            [*prefect, "deployment", "run", "finetune-recipe/tiny-cpu-nightly"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        flow_run_id = next(line.split()[-1] for line in out.stdout.splitlines() if "UUID" in line)
        while (fr := httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json())["state"]["type"] not in (
            "COMPLETED",
            "FAILED",
            "CRASHED",
        ):
            time.sleep(0.2)
        t_done = time.time()
        nightly = {
            "state": fr["state"]["type"],
            "message": fr["state"]["message"],
            "flow_run_wall_s": round(parse_time(fr["end_time"]) - parse_time(fr["start_time"]), 2),
            "deployment_run_to_completed_s": round(t_done - t0, 2),
        }
        subprocess.run([*ladle, "model", "stop", name], env=env, capture_output=True)
        return {
            "worker_query_seconds": query_seconds,
            "swaps": swaps,
            "requests": len(traffic.results),
            "failed_requests": len(failures),
            "failures": failures[:5],
            "nightly": nightly,
        }
    finally:
        for proc in reversed(procs):
            stop_process(proc, group=True)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.assets import tiny_model_dir

    root = Path(tempfile.mkdtemp(prefix="ladle-bench-lifecycle-"))
    os.environ["LADLE_HOME"] = str(root / "home")
    base = tiny_model_dir()
    other = root / "other"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.roll(model.lm_head.weight, shifts=7, dims=0))
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(base).save_pretrained(other)
    results = [run(q, root / f"q{q}", (base, other)) for q in ("10", "2")]
    for r in results:
        e2s = [s["event_to_serving_s"] for s in r["swaps"]]
        print(
            f"worker polling {r['worker_query_seconds']} s: event -> serving median {statistics.median(e2s):.1f} s "
            f"(min {min(e2s):.1f}, max {max(e2s):.1f}); {r['failed_requests']} failed of {r['requests']} requests; "
            f"nightly skip: flow run {r['nightly']['flow_run_wall_s']} s, "
            f"deployment run -> Completed {r['nightly']['deployment_run_to_completed_s']} s ({r['nightly']['message']})"
        )
        for s in r["swaps"]:
            print("  ", json.dumps(s))
    print(save("lifecycle", {"runs": results}))


if __name__ == "__main__":
    main()
