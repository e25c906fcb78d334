"""A deployment run through a real Prefect server and a process worker.

prefect server start  ->  prefect deploy (deployments/prefect.yaml)  ->  prefect worker start
->  prefect deployment run 'finetune-recipe/tiny-cpu'  ->  flow run COMPLETED, model served
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ladle import storage
from ladle.processes import stop_process
from ladle.train.run import free_port
from tests.helpers import ROOT
from tests.pipeline import checks

pytestmark = pytest.mark.pipeline
PREFECT = str(Path(sys.executable).with_name("prefect"))


def prefect(*args: str, env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    done = subprocess.run([PREFECT, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "LADLE_REPO": str(ROOT),
    }
    with open(home / "server.log", "w") as log:  # the child keeps its own copy of the descriptor
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            stop_process(server, grace_s=0)
            pytest.fail(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield env
    stop_process(server)


def flow_run_state(env: dict, flow_run_id: str) -> str:
    response = httpx.get(f"{env['PREFECT_API_URL']}/flow_runs/{flow_run_id}", timeout=10)
    return response.json()["state"]["type"]


def test_deployment_runs_through_server_and_worker(prefect_server, s3_server, monkeypatch, tmp_path, tiny_model):
    """Every artifact of this run lives on S3 (a moto server on 127.0.0.1): the same pipeline, remote store."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)  # this process reads the results back from S3 too
    env = {**prefect_server, **s3_server}
    prefect("work-pool", "create", "ladle-local", "--type", "process", env=env)
    prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml", env=env)
    params = {"overrides": ["training.max_steps=10", "output=s3://ladle/deployed", "name=deployed"]}
    started = prefect("deployment", "run", "finetune-recipe/tiny-cpu", "--params", json.dumps(params), env=env)
    flow_run_id = next(line.split()[-1] for line in started.stdout.splitlines() if "UUID" in line)

    # Its own session: the worker's flow-run processes (and their training processes) stop with it.
    with open(tmp_path / "worker.log", "w") as worker_log:
        worker = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", "ladle-local"],
            env=env,
            cwd=ROOT,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600
        while (state := flow_run_state(env, flow_run_id)) not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert time.monotonic() < deadline, "flow run did not finish in 10 minutes"
            time.sleep(2)
    finally:
        stop_process(worker, group=True)
    assert state == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]

    fs, _ = storage.filesystem("s3://ladle/deployed")
    summaries = fs.glob("ladle/deployed/runs/deployed-*/summary.json")
    assert len(summaries) == 1
    summary = storage.read_json("s3://" + summaries[0])
    assert summary["flow_run_id"] != flow_run_id  # the pipeline runs as a subflow of the deployment's flow run
    checks.check_summary(summary, 10)
    assert summary["output_url"].startswith("s3://ladle/deployed/runs/deployed-")
    assert storage.is_complete(summary["merged_model_url"])
    checks.check_served_answer_is_offline_greedy(summary, max_new_tokens=16)
    checks.check_mlflow(summary, 10, "deployed")
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(summary["mlflow_tracking_uri"]).get_run(summary["mlflow_run_id"]).data.tags
    assert tags["prefect.parent_flow_run_id"] == flow_run_id

    flt = {"artifacts": {"flow_run_id": {"any_": [summary["flow_run_id"]]}}}
    artifacts = {
        a["key"]: a for a in httpx.post(f"{env['PREFECT_API_URL']}/artifacts/filter", json=flt, timeout=10).json()
    }
    assert {"plan", "data-report", "mlflow-run", "topology", "train-progress", "eval-examples"} <= set(artifacts)
    assert "strategy | ddp" in artifacts["plan"]["data"]
    assert summary["mlflow_run_id"] in artifacts["mlflow-run"]["data"]

    schedules = httpx.post(f"{env['PREFECT_API_URL']}/deployments/filter", json={}, timeout=10).json()
    nightly = next(d for d in schedules if d["name"] == "tiny-cpu-nightly")
    assert nightly["schedules"][0]["schedule"]["cron"] == "30 2 * * *"


def test_ladle_run_uses_the_configured_server_and_starts_none(prefect_server, tmp_path, tiny_model):
    """PREFECT_API_URL set: the flow run is recorded on that server and ladle starts no temporary one.

    The run fails inside the flow (a data error found by the prepare task), which proves the same
    routing as a full run at a fraction of its time; full runs through that server are the test above.
    """
    from tests.helpers import run_cli

    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n")
    before = {
        r["id"] for r in httpx.post(f"{prefect_server['PREFECT_API_URL']}/flow_runs/filter", json={}, timeout=10).json()
    }
    done = run_cli(
        "run",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        "--json",
        "--set",
        f"data.path={bad}",
        "--set",
        f"output={tmp_path / 'out'}",
        env=prefect_server,
    )
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed["status"] == "failed" and "no usable training rows" in failed["error"], done.stderr[-3000:]
    assert failed["prefect_api_startup_s"] is None and failed["prefect_api_waited_s"] is None
    runs = httpx.post(f"{prefect_server['PREFECT_API_URL']}/flow_runs/filter", json={}, timeout=10).json()
    new = [r for r in runs if r["id"] not in before and r["name"] and r["flow_id"]]
    assert len(new) == 1 and new[0]["state"]["type"] == "FAILED"
